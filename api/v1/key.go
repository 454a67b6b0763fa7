package v1

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"regexp"
	"sort"
)

// DefaultPlatform is the platform of a request that names none.
const DefaultPlatform = "linux/amd64"

// keyInput is the canonical encoding of everything that decides an image's
// content. Field order is fixed by the struct, maps are encoded with sorted
// keys by encoding/json, and platforms are sorted: two requests that would
// build the same image get the same key. Labels are in it: they are
// written into the image's config, so they change its digest. The
// destination (image, tags) and bookkeeping (requestId, timeout) are not.
// Labels are omitted when empty, so requests without labels keep the keys
// they had before labels counted.
type keyInput struct {
	Version    int               `json:"v"`
	Context    string            `json:"context"`
	GitURL     string            `json:"gitUrl,omitempty"`
	GitSubPath string            `json:"gitSubPath,omitempty"`
	Dockerfile string            `json:"dockerfile"`
	BuildArgs  map[string]string `json:"buildArgs"`
	Target     string            `json:"target"`
	Platforms  []string          `json:"platforms"`
	Executor   string            `json:"executor"`
	Labels     map[string]string `json:"labels,omitempty"`
}

// BuildKey returns the hex sha256 build key of a valid request for the
// given executor identity (for kaniko, its pinned image reference; for the
// local executor, its name and version).
func BuildKey(r *Request, executor string) string {
	in := keyInput{
		Version:    1,
		Dockerfile: r.DockerfileOrDefault(),
		BuildArgs:  r.BuildArgs,
		Target:     r.Target,
		Platforms:  r.PlatformsOrDefault(),
		Executor:   executor,
		Labels:     r.Labels,
	}
	if in.BuildArgs == nil {
		in.BuildArgs = map[string]string{}
	}
	switch {
	case r.Source.S3 != nil:
		in.Context = r.ContextDigest
	case r.Source.Git != nil:
		in.Context = "git:" + r.Source.Git.Commit
		in.GitURL = r.Source.Git.URL
		in.GitSubPath = r.Source.Git.SubPath
	}
	b, err := json.Marshal(in)
	if err != nil {
		// Only strings, maps of strings and slices: cannot fail.
		panic("buildq: encode build key: " + err.Error())
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// DockerfileOrDefault returns the Dockerfile path, "Dockerfile" when unset.
func (r *Request) DockerfileOrDefault() string {
	if r.Dockerfile == "" {
		return DefaultDockerfile
	}
	return r.Dockerfile
}

// PlatformsOrDefault returns the sorted platforms, [linux/amd64] when unset.
func (r *Request) PlatformsOrDefault() []string {
	if len(r.Platforms) == 0 {
		return []string{DefaultPlatform}
	}
	p := append([]string(nil), r.Platforms...)
	sort.Strings(p)
	return p
}

// DefaultTag is the tag every build gets: the key's first 12 hex digits.
func DefaultTag(key string) string {
	if len(key) < 12 {
		return key
	}
	return key[:12]
}

var buildKeyRe = regexp.MustCompile(`^[a-f0-9]{64}$`)

// IsBuildKey reports whether s looks like a build key (64 hex digits), as
// the tenant API tells a key from a request id.
func IsBuildKey(s string) bool { return buildKeyRe.MatchString(s) }
