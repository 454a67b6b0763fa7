package v1

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
)

// Limits on request fields. They keep every value inside what Kubernetes
// (labels, annotations, args) and NATS (subjects, headers) accept.
const (
	MaxRequestBytes    = 64 << 10
	MaxRequestIDLen    = 128
	MaxLabelLen        = 63 // DNS-1123 label
	MaxBuildArgs       = 64
	MaxBuildArgKeyLen  = 128
	MaxBuildArgValLen  = 4096
	MaxBuildArgsBytes  = 32 << 10
	MaxTags            = 16
	MaxPlatforms       = 8
	MaxLabels          = 64
	MaxUserLabelKeyLen = 128
	MaxUserLabelValLen = 1024
	MaxPathLen         = 255
	MaxS3KeyLen        = 1024
	MaxTimeout         = 24 * time.Hour
	MinTimeout         = 10 * time.Second
	DefaultDockerfile  = "Dockerfile"
)

var (
	dns1123Label = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	requestIDRe  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]*$`)
	buildArgRe   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	targetRe     = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)
	tagRe        = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	labelKeyRe   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]*$`)
	bucketRe     = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$`)
	digestRe     = regexp.MustCompile(`^sha256:[a-f0-9]{64}$`)
	commitRe     = regexp.MustCompile(`^([a-f0-9]{40}|[a-f0-9]{64})$`)
)

// Known platforms: os/arch[/variant]. Anything else is refused rather than
// handed to an executor that would fail late.
var (
	knownOS    = map[string]bool{"linux": true, "windows": true}
	knownArch  = map[string]bool{"amd64": true, "arm64": true, "arm": true, "386": true, "ppc64le": true, "s390x": true, "riscv64": true}
	knownVarnt = map[string]bool{"v5": true, "v6": true, "v7": true, "v8": true}
)

// FieldError is one invalid field.
type FieldError struct {
	Field  string
	Detail string
}

func (e FieldError) Error() string { return e.Field + ": " + e.Detail }

// ValidationError lists every invalid field of a request.
type ValidationError struct{ Fields []FieldError }

func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Fields))
	for i, f := range e.Fields {
		parts[i] = f.Error()
	}
	return "invalid request: " + strings.Join(parts, "; ")
}

// ErrInvalid matches every validation or decoding failure with errors.Is.
var ErrInvalid = errors.New("invalid request")

// Is makes errors.Is(err, ErrInvalid) true for validation errors.
func (e *ValidationError) Is(target error) bool { return target == ErrInvalid }

// DecodeError is a request that is not valid JSON for this API.
type DecodeError struct{ Err error }

func (e *DecodeError) Error() string { return "invalid request: " + e.Err.Error() }

// Unwrap returns the JSON error.
func (e *DecodeError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrInvalid) true for decoding errors.
func (e *DecodeError) Is(target error) bool { return target == ErrInvalid }

// DecodeRequest parses a request strictly (unknown fields are refused, so a
// misspelt option is an error rather than silently ignored) and validates it.
// On a validation error the decoded request is still returned, so the caller
// can address a failure result to it.
func DecodeRequest(data []byte) (*Request, error) {
	if len(data) > MaxRequestBytes {
		return nil, &DecodeError{Err: fmt.Errorf("request is %d bytes, more than the %d allowed", len(data), MaxRequestBytes)}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var r Request
	if err := dec.Decode(&r); err != nil {
		return nil, &DecodeError{Err: err}
	}
	if dec.More() {
		return nil, &DecodeError{Err: errors.New("trailing data after the JSON object")}
	}
	if err := r.Validate(); err != nil {
		return &r, err
	}
	return &r, nil
}

// GeneratedIDPrefix begins the id a worker gives a request it cannot read
// and whose message names no usable id (invalid-<stream sequence>): no
// request may take such an id, so no refusal of another message is ever
// a request's answer.
const GeneratedIDPrefix = "invalid-"

// Validate checks every field and returns a *ValidationError listing all
// problems, or nil.
func (r *Request) Validate() error {
	var fe []FieldError
	add := func(field, format string, args ...any) {
		fe = append(fe, FieldError{Field: field, Detail: fmt.Sprintf(format, args...)})
	}
	if r.APIVersion != APIVersion {
		add("apiVersion", "must be %q, got %q", APIVersion, r.APIVersion)
	}
	switch {
	case r.RequestID == "":
		add("requestId", "is required")
	case len(r.RequestID) > MaxRequestIDLen:
		add("requestId", "is %d characters, more than %d", len(r.RequestID), MaxRequestIDLen)
	case !requestIDRe.MatchString(r.RequestID):
		add("requestId", "may hold only letters, digits, '_', '.', ':' and '-'")
	case strings.HasPrefix(r.RequestID, GeneratedIDPrefix):
		add("requestId", "may not begin with %q: workers give such ids to requests they cannot read", GeneratedIDPrefix)
	}
	checkLabel := func(field, v string) {
		if msg := DNSLabelProblem(v); msg != "" {
			add(field, "%s", msg)
		}
	}
	checkLabel("tenant", r.Tenant)
	checkLabel("name", r.Name)

	switch {
	case r.Source.S3 != nil && r.Source.Git != nil:
		add("source", "must have exactly one of s3 or git, not both")
	case r.Source.S3 != nil:
		s := r.Source.S3
		if !bucketRe.MatchString(s.Bucket) {
			add("source.s3.bucket", "%q is not a valid bucket name", s.Bucket)
		}
		if msg := relPathProblem(s.Key, MaxS3KeyLen); msg != "" {
			add("source.s3.key", "%s", msg)
		}
		if !digestRe.MatchString(r.ContextDigest) {
			add("contextDigest", "must be sha256:<64 hex digits> for an s3 source, got %q", truncate(r.ContextDigest, 80))
		}
	case r.Source.Git != nil:
		g := r.Source.Git
		if !(strings.HasPrefix(g.URL, "https://") || strings.HasPrefix(g.URL, "http://") || strings.HasPrefix(g.URL, "ssh://")) || len(g.URL) > 2048 || strings.ContainsAny(g.URL, " \t\r\n") {
			add("source.git.url", "must be an https://, http:// or ssh:// URL")
		}
		switch {
		case g.Ref == "" && g.Commit == "":
			add("source.git", "needs a ref (branch, tag or full ref), a commit, or both")
		case g.Commit != "" && !commitRe.MatchString(g.Commit):
			add("source.git.commit", "must be a full commit hash (40 or 64 lowercase hex digits)")
		}
		if g.Ref != "" {
			if msg := GitRefProblem(g.Ref); msg != "" {
				add("source.git.ref", "%s", msg)
			}
		}
		if g.SubPath != "" {
			if msg := relPathProblem(g.SubPath, MaxPathLen); msg != "" {
				add("source.git.subPath", "%s", msg)
			}
		}
		if r.ContextDigest != "" {
			add("contextDigest", "is only for s3 sources")
		}
	default:
		add("source", "is required: s3 (bucket, key) or git (url, ref or commit)")
	}

	if r.Dockerfile != "" {
		if msg := relPathProblem(r.Dockerfile, MaxPathLen); msg != "" {
			add("dockerfile", "%s", msg)
		}
	}
	if len(r.BuildArgs) > MaxBuildArgs {
		add("buildArgs", "has %d entries, more than %d", len(r.BuildArgs), MaxBuildArgs)
	}
	total := 0
	for _, k := range sortedKeys(r.BuildArgs) {
		v := r.BuildArgs[k]
		total += len(k) + len(v)
		switch {
		case len(k) > MaxBuildArgKeyLen || !buildArgRe.MatchString(k):
			add("buildArgs", "%q is not a valid argument name (letters, digits and '_', at most %d)", truncate(k, 40), MaxBuildArgKeyLen)
		case len(v) > MaxBuildArgValLen:
			add("buildArgs."+k, "value is %d bytes, more than %d", len(v), MaxBuildArgValLen)
		case strings.ContainsRune(v, 0):
			add("buildArgs."+k, "value holds a NUL byte")
		}
	}
	if total > MaxBuildArgsBytes {
		add("buildArgs", "total %d bytes, more than %d", total, MaxBuildArgsBytes)
	}
	if len(r.SecretBuildArgs) > MaxBuildArgs {
		add("secretBuildArgs", "has %d entries, more than %d", len(r.SecretBuildArgs), MaxBuildArgs)
	}
	for _, k := range r.SecretBuildArgs {
		if _, ok := r.BuildArgs[k]; !ok {
			add("secretBuildArgs", "%q is not one of the build arguments", truncate(k, 40))
		}
	}
	if r.Target != "" && (len(r.Target) > MaxLabelLen || !targetRe.MatchString(r.Target)) {
		add("target", "%q is not a valid stage name", truncate(r.Target, 40))
	}
	if len(r.Platforms) > MaxPlatforms {
		add("platforms", "has %d entries, more than %d", len(r.Platforms), MaxPlatforms)
	}
	seen := map[string]string{}
	for _, p := range r.Platforms {
		c := canonicalPlatform(p)
		if msg := PlatformProblem(p); msg != "" {
			add("platforms", "%s", msg)
		} else if first, ok := seen[c]; ok && first == p {
			add("platforms", "%q is listed twice", p)
		} else if ok {
			add("platforms", "%q and %q are one platform, listed twice", first, p)
		}
		if _, ok := seen[c]; !ok {
			seen[c] = p
		}
	}
	if r.Image != "" {
		if msg := RepositoryProblem(r.Image); msg != "" {
			add("image", "%s", msg)
		}
	}
	if len(r.Tags) > MaxTags {
		add("tags", "has %d entries, more than %d", len(r.Tags), MaxTags)
	}
	for _, t := range r.Tags {
		if !tagRe.MatchString(t) {
			add("tags", "%q is not a valid tag", truncate(t, 40))
		}
	}
	if r.Timeout.Duration != 0 && (r.Timeout.Duration < MinTimeout || r.Timeout.Duration > MaxTimeout) {
		add("timeout", "must be between %s and %s, got %s", MinTimeout, MaxTimeout, r.Timeout.Duration)
	}
	if _, ok := PriorityOf(r.Priority); !ok {
		add("priority", "must be %q, %q or %q, got %q", PriorityHigh, PriorityNormal, PriorityLow, truncate(r.Priority, 40))
	}
	if len(r.Labels) > MaxLabels {
		add("labels", "has %d entries, more than %d", len(r.Labels), MaxLabels)
	}
	for _, k := range sortedKeys(r.Labels) {
		v := r.Labels[k]
		if len(k) > MaxUserLabelKeyLen || !labelKeyRe.MatchString(k) {
			add("labels", "%q is not a valid label key", truncate(k, 40))
		}
		if len(v) > MaxUserLabelValLen || strings.ContainsRune(v, 0) {
			add("labels."+truncate(k, 40), "value is longer than %d bytes or holds a NUL byte", MaxUserLabelValLen)
		}
	}
	if len(fe) > 0 {
		return &ValidationError{Fields: fe}
	}
	return nil
}

// DNSLabelProblem says what makes v an invalid DNS-1123 label, or "" when it
// is valid. A valid label is also a safe NATS subject token.
func DNSLabelProblem(v string) string {
	switch {
	case v == "":
		return "is required"
	case len(v) > MaxLabelLen:
		return fmt.Sprintf("is %d characters, more than %d", len(v), MaxLabelLen)
	case !dns1123Label.MatchString(v):
		return fmt.Sprintf("%q must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit", truncate(v, 40))
	}
	return ""
}

// PlatformProblem says what makes p an invalid os/arch[/variant], or "".
// A variant is one its architecture has (arm: v5, v6, v7; arm64: v8).
func PlatformProblem(p string) string {
	parts := strings.Split(p, "/")
	if len(parts) < 2 || len(parts) > 3 || !knownOS[parts[0]] || !knownArch[parts[1]] || (len(parts) == 3 && !knownVarnt[parts[2]]) {
		return fmt.Sprintf("%q is not a known platform (os/arch[/variant], e.g. linux/amd64)", truncate(p, 40))
	}
	if len(parts) == 3 && !archVariant[parts[1]][parts[2]] {
		return fmt.Sprintf("%q: architecture %s has no variant %s", truncate(p, 40), parts[1], parts[2])
	}
	return ""
}

// archVariant lists the variants each architecture has.
var archVariant = map[string]map[string]bool{"arm": {"v5": true, "v6": true, "v7": true}, "arm64": {"v8": true}}

// canonicalPlatform spells p the way image indexes match it: arm64 is
// arm64/v8 and arm is arm/v7 when no variant is named (as containerd
// normalizes them), so two spellings of one platform are one.
func canonicalPlatform(p string) string {
	parts := strings.Split(p, "/")
	if len(parts) == 2 {
		switch parts[1] {
		case "arm64":
			return p + "/v8"
		case "arm":
			return p + "/v7"
		}
	}
	return p
}

// RepositoryProblem says what makes s an invalid image repository, or "".
// Tags and digests are refused: they belong in tags, and the digest is an
// output.
func RepositoryProblem(s string) string {
	if len(s) > 255 {
		return "is longer than 255 characters"
	}
	if strings.Contains(s, "@") {
		return fmt.Sprintf("%q holds a digest; give the repository only", truncate(s, 80))
	}
	if _, err := name.NewRepository(s, name.StrictValidation); err != nil {
		if _, terr := name.NewTag(s, name.StrictValidation); terr == nil {
			return fmt.Sprintf("%q holds a tag; give the repository only and put tags in tags", truncate(s, 80))
		}
		return fmt.Sprintf("%q is not a valid repository: %v", truncate(s, 80), err)
	}
	return ""
}

func relPathProblem(p string, maxLen int) string {
	switch {
	case p == "":
		return "is required"
	case len(p) > maxLen:
		return fmt.Sprintf("is longer than %d characters", maxLen)
	case strings.HasPrefix(p, "/"):
		return fmt.Sprintf("%q must be a relative path", truncate(p, 80))
	case strings.ContainsAny(p, "\x00\r\n\\"):
		return "holds a control character or a backslash"
	case path.Clean(p) != p || p == "." || strings.HasPrefix(p, "../") || p == "..":
		return fmt.Sprintf("%q must be a clean relative path without '..'", truncate(p, 80))
	}
	return ""
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// MaxGitRefLen bounds a git ref's length.
const MaxGitRefLen = 255

// GitRefProblem says what is wrong with ref as a branch, tag or full ref
// name (git check-ref-format's rules, and no leading "-", so a ref never
// reads as an option), or "" when nothing is.
func GitRefProblem(ref string) string {
	switch {
	case len(ref) > MaxGitRefLen:
		return fmt.Sprintf("is longer than %d bytes", MaxGitRefLen)
	case strings.HasPrefix(ref, "-"):
		return fmt.Sprintf("%q starts with '-'", truncate(ref, 80))
	case ref == "@", strings.Contains(ref, ".."), strings.Contains(ref, "@{"), strings.Contains(ref, "//"),
		strings.HasPrefix(ref, "/"), strings.HasSuffix(ref, "/"), strings.HasSuffix(ref, "."), strings.HasSuffix(ref, ".lock"):
		return fmt.Sprintf("%q is not a valid git ref name", truncate(ref, 80))
	}
	for _, c := range ref {
		if c < 0x20 || c == 0x7f || strings.ContainsRune(" ~^:?*[\\", c) {
			return fmt.Sprintf("%q is not a valid git ref name (it holds %q)", truncate(ref, 80), c)
		}
	}
	for _, part := range strings.Split(ref, "/") {
		if strings.HasPrefix(part, ".") {
			return fmt.Sprintf("%q is not a valid git ref name (a component starts with '.')", truncate(ref, 80))
		}
	}
	return ""
}
