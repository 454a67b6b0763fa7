package gateway

import (
	"maps"
	"net/url"
	"path"
	"slices"
	"strings"

	v1 "github.com/buildq/buildq/api/v1"
)

// push is what a webhook's push payload says, whichever the forge.
type push struct {
	// ref is the full ref pushed (refs/heads/main, refs/tags/v1).
	ref string
	// before and after are the ref's commits before and after the push;
	// commit is the commit to build (after, or the commit an annotated
	// tag points to).
	before, after, commit string
	// deleted: the push removed the ref.
	deleted bool
	// repoURLs are every URL the payload gives for the repository.
	repoURLs []string
}

// zeroCommit is the "after" of a push that deleted its ref (SHA-1 or
// SHA-256 repositories).
func zeroCommit(c string) bool {
	return c != "" && strings.Trim(c, "0") == ""
}

// matches reports whether trigger i of t builds the push.
func (t *Tenant) matches(i int, p push) bool {
	if !containsRepo(p.repoURLs, t.repos[i]) {
		return false
	}
	return refMatches(t.Triggers[i], p.ref)
}

// refMatches applies a trigger's branch and tag filters to a full ref.
func refMatches(tr Trigger, ref string) bool {
	var name string
	var patterns []string
	switch {
	case strings.HasPrefix(ref, "refs/heads/"):
		name, patterns = strings.TrimPrefix(ref, "refs/heads/"), tr.Branches
	case strings.HasPrefix(ref, "refs/tags/"):
		name, patterns = strings.TrimPrefix(ref, "refs/tags/"), tr.Tags
	default:
		return false // neither a branch nor a tag
	}
	if len(tr.Branches) == 0 && len(tr.Tags) == 0 {
		return true
	}
	for _, p := range patterns {
		if ok, err := path.Match(p, name); err == nil && ok {
			return true
		}
	}
	return false
}

func containsRepo(urls []string, want string) bool {
	if want == "" {
		return false
	}
	for _, u := range urls {
		if normalizeRepo(u) == want {
			return true
		}
	}
	return false
}

// normalizeRepo reduces a repository URL to host/path for matching:
// https://github.com/Acme/Web.git, git@github.com:acme/web.git,
// ssh://git@github.com:22/acme/web and git://github.com/acme/web all
// become github.com/acme/web. Scheme, user, port, a ".git" suffix, slashes
// around the path and case do not count. It is "" for what is no
// repository URL.
func normalizeRepo(raw string) string {
	s := strings.TrimSpace(raw)
	if s == "" {
		return ""
	}
	var host, p string
	if strings.Contains(s, "://") {
		u, err := url.Parse(s)
		if err != nil || u.Host == "" {
			return ""
		}
		host, p = u.Hostname(), u.Path
	} else {
		// scp-like: [user@]host:path
		at := strings.LastIndex(s[:max(strings.Index(s, ":"), 0)], "@")
		rest := s[at+1:]
		h, pth, ok := strings.Cut(rest, ":")
		if !ok || h == "" || strings.Contains(h, "/") {
			return ""
		}
		host, p = h, pth
	}
	p = strings.Trim(p, "/")
	p = strings.TrimSuffix(p, ".git")
	p = strings.Trim(p, "/")
	if host == "" || p == "" {
		return ""
	}
	return strings.ToLower(host + "/" + p)
}

// request is the build request a trigger makes for a push of ref at
// commit.
func (tr Trigger) request(tenant, requestID, ref, commit string) *v1.Request {
	r := &v1.Request{
		APIVersion: v1.APIVersion,
		RequestID:  requestID,
		Tenant:     tenant,
		Name:       tr.Name,
		Source: v1.Source{Git: &v1.GitSource{
			URL: tr.Repository, Ref: ref, Commit: commit, SubPath: tr.SubPath, Submodules: tr.Submodules,
		}},
		Dockerfile: tr.Dockerfile,
		Target:     tr.Target,
		Image:      tr.Image,
	}
	r.Platforms = slices.Clone(tr.Platforms)
	r.BuildArgs = maps.Clone(tr.BuildArgs)
	return r
}
