package gateway

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"sigs.k8s.io/yaml"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/natsconf"
)

// FileConfig is the gateway's configuration file (YAML, `buildq gateway
// --config`). Secrets are never written in it, only the files that hold
// them; a relative path is relative to the configuration file's directory.
type FileConfig struct {
	// MsgIDKeyFile holds the secret (at least 32 bytes) every replica
	// derives the Nats-Msg-Id nonces from (see RequestMsgID): the same
	// key on every replica makes a redelivery to another replica store
	// nothing new.
	MsgIDKeyFile string         `json:"msgIdKeyFile,omitempty"`
	Tenants      []TenantConfig `json:"tenants"`
}

// TenantConfig is one tenant of the configuration file.
type TenantConfig struct {
	// Name is the tenant (a DNS-1123 label): the requests it sends go to
	// buildq.requests.<name>.
	Name     string         `json:"name"`
	Auth     AuthConfig     `json:"auth,omitempty"`
	NATS     NATSIdentity   `json:"nats,omitempty"`
	Webhooks WebhooksConfig `json:"webhooks,omitempty"`
	Triggers []Trigger      `json:"triggers,omitempty"`
}

// AuthConfig says how a tenant's CloudEvents producers authenticate.
type AuthConfig struct {
	// TokenSHA256 are the SHA-256 hashes (64 hex digits, optionally
	// "sha256:"-prefixed) of the bearer tokens that act as the tenant:
	// printf %s "$TOKEN" | sha256sum.
	TokenSHA256 []string `json:"tokenSHA256,omitempty"`
	// ClientCertSubjects are the subjects of client certificates (verified
	// against --tls-client-ca) that act as the tenant, as Go's
	// pkix.Name.String prints them (RFC 2253 order: "CN=ci,O=Acme").
	ClientCertSubjects []string `json:"clientCertSubjects,omitempty"`
}

// WebhooksConfig holds a tenant's webhook secrets.
type WebhooksConfig struct {
	// GitHub: the secret of the repository's or organization's webhook
	// (X-Hub-Signature-256), for POST /hooks/github/<tenant>.
	GitHub *WebhookSecret `json:"github,omitempty"`
	// GitLab: the webhook's secret token (X-Gitlab-Token), for POST
	// /hooks/gitlab/<tenant>.
	GitLab *WebhookSecret `json:"gitlab,omitempty"`
}

// WebhookSecret names the file that holds a webhook secret (a trailing
// newline is ignored).
type WebhookSecret struct {
	SecretFile string `json:"secretFile"`
}

// NATSIdentity is the tenant's own NATS user, one of: a credentials file
// (decentralized mode: `buildq nats-config --mode jwt` writes
// creds/<tenant>.creds), an nkey seed file (config-file mode:
// <tenant>.seed), or a user and a file holding its password.
type NATSIdentity struct {
	CredsFile    string `json:"credsFile,omitempty"`
	NKeySeedFile string `json:"nkeySeedFile,omitempty"`
	User         string `json:"user,omitempty"`
	PasswordFile string `json:"passwordFile,omitempty"`
}

// Trigger maps pushes to a repository to a build request of the tenant.
type Trigger struct {
	// Repository is the repository's https://, http:// or ssh:// URL. It
	// becomes the request's source.git.url; a push matches when one of the
	// payload's repository URLs (clone, web, ssh) is the same repository
	// (compared without scheme, user, port, ".git" and case).
	Repository string `json:"repository"`
	// Name, Image, Dockerfile, Target, Platforms and BuildArgs are the
	// request's fields of the same names; SubPath and Submodules its
	// source.git's.
	Name       string            `json:"name"`
	Image      string            `json:"image,omitempty"`
	Dockerfile string            `json:"dockerfile,omitempty"`
	SubPath    string            `json:"subPath,omitempty"`
	Target     string            `json:"target,omitempty"`
	Platforms  []string          `json:"platforms,omitempty"`
	BuildArgs  map[string]string `json:"buildArgs,omitempty"`
	Submodules bool              `json:"submodules,omitempty"`
	// Branches and Tags are glob patterns (path.Match: * stays within a
	// '/'-separated segment) of the branch or tag names that build. With
	// neither, every branch and tag push builds; with only one of them,
	// pushes of the other kind do not.
	Branches []string `json:"branches,omitempty"`
	Tags     []string `json:"tags,omitempty"`
}

// Settings is a loaded and validated configuration, secrets read.
type Settings struct {
	Tenants []*Tenant
	// MsgIDKey is the Nats-Msg-Id nonce key (nil without msgIdKeyFile).
	MsgIDKey []byte
}

// Tenant is a validated tenant with its secrets. The secrets are
// unexported: nothing prints them.
type Tenant struct {
	Name string
	// NATS is the tenant's identity, its paths absolute.
	NATS     NATSIdentity
	Triggers []Trigger

	tokens       [][sha256.Size]byte
	subjects     []string
	githubSecret []byte
	gitlabToken  []byte
	password     string
	repos        []string // normalized Triggers[i].Repository
}

// HasNATSIdentity reports whether the tenant names a NATS identity.
func (t *Tenant) HasNATSIdentity() bool { return t.NATS != (NATSIdentity{}) }

// NATSOptions are the connection options of the tenant's NATS identity
// (none without one).
func (t *Tenant) NATSOptions() ([]nats.Option, error) {
	switch {
	case t.NATS.CredsFile != "":
		return []nats.Option{nats.UserCredentials(t.NATS.CredsFile)}, nil
	case t.NATS.NKeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(t.NATS.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("tenant %s: nkeySeedFile %s: %w", t.Name, t.NATS.NKeySeedFile, err)
		}
		return []nats.Option{o}, nil
	case t.NATS.User != "":
		return []nats.Option{nats.UserInfo(t.NATS.User, t.password)}, nil
	}
	return nil, nil
}

// Limits of the configuration's files.
const (
	maxConfigBytes = 4 << 20
	maxSecretBytes = 64 << 10
	// MinMsgIDKeyBytes is the shortest msgIdKeyFile accepted.
	MinMsgIDKeyBytes = 32
)

// Load reads and validates the configuration file at file, and reads the
// secrets it names. Every problem is reported, each with its place in the
// file ("tenants[1].triggers[0].repository: ..."); no secret is part of an
// error.
func Load(file string) (*Settings, error) {
	b, err := readLimited(file, maxConfigBytes)
	if err != nil {
		return nil, err
	}
	abs, err := filepath.Abs(file)
	if err != nil {
		return nil, err
	}
	return Parse(b, filepath.Dir(abs))
}

// Parse is Load for a configuration already read; relative paths are
// relative to dir.
func Parse(data []byte, dir string) (*Settings, error) {
	var fc FileConfig
	if err := yaml.UnmarshalStrict(data, &fc); err != nil {
		return nil, fmt.Errorf("not a gateway configuration: %w", err)
	}
	v := &validator{dir: dir}
	s := &Settings{}
	if fc.MsgIDKeyFile != "" {
		if key := v.secret("msgIdKeyFile", fc.MsgIDKeyFile); key != nil && len(key) < MinMsgIDKeyBytes {
			v.addf("msgIdKeyFile", "holds %d bytes, fewer than %d (make one with: head -c 32 /dev/urandom | base64)", len(key), MinMsgIDKeyBytes)
		} else {
			s.MsgIDKey = key
		}
	}
	if len(fc.Tenants) == 0 {
		v.addf("tenants", "is empty: list at least one tenant")
	}
	names := map[string]int{}
	tokens := map[[sha256.Size]byte]string{}
	subjects := map[string]string{}
	for i, tc := range fc.Tenants {
		at := fmt.Sprintf("tenants[%d]", i)
		if err := natsconf.CheckTenant(tc.Name); err != nil {
			v.addf(at+".name", "%v", err)
		} else if j, dup := names[tc.Name]; dup {
			v.addf(at+".name", "tenant %q is also tenants[%d]", tc.Name, j)
		} else {
			names[tc.Name] = i
			at += " (" + tc.Name + ")"
		}
		t := &Tenant{Name: tc.Name, Triggers: tc.Triggers}
		for j, h := range tc.Auth.TokenSHA256 {
			sum, ok := parseTokenHash(h)
			switch {
			case !ok:
				v.addf(fmt.Sprintf("%s.auth.tokenSHA256[%d]", at, j), "is not a SHA-256 hash (64 hex digits; printf %%s \"$TOKEN\" | sha256sum)")
			case tokens[sum] != "":
				v.addf(fmt.Sprintf("%s.auth.tokenSHA256[%d]", at, j), "the same token is also given for %s: a token names one tenant", tokens[sum])
			default:
				tokens[sum] = at
				t.tokens = append(t.tokens, sum)
			}
		}
		for j, subj := range tc.Auth.ClientCertSubjects {
			f := fmt.Sprintf("%s.auth.clientCertSubjects[%d]", at, j)
			switch {
			case strings.TrimSpace(subj) == "" || subj != strings.TrimSpace(subj):
				v.addf(f, "must be a certificate subject such as \"CN=ci.acme.example,O=Acme\" (no surrounding spaces)")
			case subjects[subj] != "":
				v.addf(f, "%q is also given for %s: a subject names one tenant", subj, subjects[subj])
			default:
				subjects[subj] = at
				t.subjects = append(t.subjects, subj)
			}
		}
		v.identity(at+".nats", tc.NATS, t)
		if tc.Webhooks.GitHub != nil {
			t.githubSecret = v.secret(at+".webhooks.github.secretFile", tc.Webhooks.GitHub.SecretFile)
		}
		if tc.Webhooks.GitLab != nil {
			t.gitlabToken = v.secret(at+".webhooks.gitlab.secretFile", tc.Webhooks.GitLab.SecretFile)
		}
		if len(tc.Triggers) > 0 && tc.Webhooks.GitHub == nil && tc.Webhooks.GitLab == nil {
			v.addf(at+".triggers", "are only used by webhooks: give webhooks.github or webhooks.gitlab a secretFile")
		}
		keys := map[string]int{}
		for j, tr := range tc.Triggers {
			f := fmt.Sprintf("%s.triggers[%d]", at, j)
			v.trigger(f, tc.Name, tr)
			t.repos = append(t.repos, normalizeRepo(tr.Repository))
			if repoURLProblem(tr.Repository) != "" {
				continue // reported; its key would be no repository's
			}
			if k, dup := keys[tr.key()]; dup {
				v.addf(f, "builds what triggers[%d] builds (same repository, name, image, dockerfile, subPath and target)", k)
			}
			keys[tr.key()] = j
		}
		s.Tenants = append(s.Tenants, t)
	}
	if err := errors.Join(v.errs...); err != nil {
		return nil, err
	}
	return s, nil
}

// ProductionProblems says what a configuration lacks for `buildq gateway`
// (rather than `buildq dev`, which publishes over its own NATS): a
// msgIdKeyFile, every tenant's own NATS identity, and a way in for every
// tenant (a token, a client certificate subject or a webhook).
func (s *Settings) ProductionProblems() error {
	var errs []error
	if s.MsgIDKey == nil {
		errs = append(errs, errors.New("msgIdKeyFile: is required: every replica derives the Nats-Msg-Id nonces from it"))
	}
	for _, t := range s.Tenants {
		if !t.HasNATSIdentity() {
			errs = append(errs, fmt.Errorf("tenant %s: nats: give its own NATS identity (credsFile, nkeySeedFile, or user and passwordFile): the gateway publishes as the tenant, never as an operator", t.Name))
		}
		if len(t.tokens) == 0 && len(t.subjects) == 0 && t.githubSecret == nil && t.gitlabToken == nil {
			errs = append(errs, fmt.Errorf("tenant %s: no way in: give auth.tokenSHA256, auth.clientCertSubjects or a webhook", t.Name))
		}
	}
	return errors.Join(errs...)
}

// HasClientCertSubjects reports whether any tenant authenticates by client
// certificate (the server then needs a client CA).
func (s *Settings) HasClientCertSubjects() bool {
	for _, t := range s.Tenants {
		if len(t.subjects) > 0 {
			return true
		}
	}
	return false
}

// key identifies what a trigger builds; two triggers of a tenant with the
// same key would be one build, and it is part of the request ids.
func (tr Trigger) key() string {
	return strings.Join([]string{normalizeRepo(tr.Repository), tr.Name, tr.Image, tr.Dockerfile, tr.SubPath, tr.Target}, "\x00")
}

type validator struct {
	dir  string
	errs []error
}

func (v *validator) addf(field, format string, args ...any) {
	v.errs = append(v.errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
}

func (v *validator) path(p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(v.dir, p)
}

// secret reads a secret file: trailing whitespace dropped, not empty.
// Errors name the file, never its content.
func (v *validator) secret(field, p string) []byte {
	if p == "" {
		v.addf(field, "is required")
		return nil
	}
	b, err := readLimited(v.path(p), maxSecretBytes)
	if err != nil {
		v.addf(field, "%v", err)
		return nil
	}
	b = bytes.TrimRight(b, " \t\r\n")
	if len(b) == 0 {
		v.addf(field, "%s is empty", p)
		return nil
	}
	return b
}

// identity checks a tenant's NATS identity: at most one kind, its files
// readable and of the right kind.
func (v *validator) identity(at string, id NATSIdentity, t *Tenant) {
	kinds := 0
	for _, set := range []bool{id.CredsFile != "", id.NKeySeedFile != "", id.User != "" || id.PasswordFile != ""} {
		if set {
			kinds++
		}
	}
	if kinds > 1 {
		v.addf(at, "give one of credsFile, nkeySeedFile, or user and passwordFile")
		return
	}
	switch {
	case id.CredsFile != "":
		t.NATS.CredsFile = v.path(id.CredsFile)
		if b := v.secret(at+".credsFile", id.CredsFile); b != nil {
			if tok, err := jwt.ParseDecoratedJWT(b); err != nil {
				v.addf(at+".credsFile", "%s holds no user JWT: %v", id.CredsFile, err)
			} else if _, err := jwt.DecodeUserClaims(tok); err != nil {
				v.addf(at+".credsFile", "%s holds no user JWT (buildq nats-config --mode jwt writes creds/<tenant>.creds)", id.CredsFile)
			} else if kp, err := nkeys.ParseDecoratedNKey(b); err != nil {
				v.addf(at+".credsFile", "%s holds no nkey seed: %v", id.CredsFile, err)
			} else {
				kp.Wipe()
			}
		}
	case id.NKeySeedFile != "":
		t.NATS.NKeySeedFile = v.path(id.NKeySeedFile)
		if b := v.secret(at+".nkeySeedFile", id.NKeySeedFile); b != nil {
			kp, err := nkeys.ParseDecoratedNKey(b)
			if err != nil {
				v.addf(at+".nkeySeedFile", "%s holds no nkey seed: %v", id.NKeySeedFile, err)
				return
			}
			pub, err := kp.PublicKey()
			kp.Wipe()
			if err != nil || !nkeys.IsValidPublicUserKey(pub) {
				v.addf(at+".nkeySeedFile", "%s holds no user seed (SU...)", id.NKeySeedFile)
			}
		}
	case id.User != "" || id.PasswordFile != "":
		if id.User == "" {
			v.addf(at+".user", "is required with passwordFile")
		}
		t.NATS.User, t.NATS.PasswordFile = id.User, v.path(id.PasswordFile)
		if b := v.secret(at+".passwordFile", id.PasswordFile); b != nil {
			t.password = string(b)
		}
	}
}

// trigger checks a trigger by v1's own rules: a request it would make must
// be valid.
func (v *validator) trigger(at, tenant string, tr Trigger) {
	if tr.Repository == "" {
		v.addf(at+".repository", "is required")
	} else if msg := repoURLProblem(tr.Repository); msg != "" {
		v.addf(at+".repository", "%s", msg)
	}
	for _, f := range []struct {
		name     string
		patterns []string
	}{{"branches", tr.Branches}, {"tags", tr.Tags}} {
		for j, p := range f.patterns {
			if _, err := path.Match(p, "x"); err != nil || p == "" {
				v.addf(fmt.Sprintf("%s.%s[%d]", at, f.name, j), "%q is not a glob pattern (path.Match: *, ?, [a-z])", p)
			}
		}
	}
	if tr.Repository == "" || repoURLProblem(tr.Repository) != "" {
		return
	}
	sample := tr.request(tenant, "sample", "refs/heads/main", strings.Repeat("a", 40))
	var ve *v1.ValidationError
	if err := sample.Validate(); errors.As(err, &ve) {
		for _, fe := range ve.Fields {
			field := fe.Field
			switch {
			case field == "source.git.url":
				field = "repository"
			case strings.HasPrefix(field, "source.git."):
				field = strings.TrimPrefix(field, "source.git.")
			case field == "tenant":
				continue // reported as the tenant's name
			}
			v.addf(at+"."+field, "%s", fe.Detail)
		}
	}
}

// repoURLProblem says what makes u unusable as a trigger's repository.
func repoURLProblem(u string) string {
	p, err := url.Parse(u)
	switch {
	case !strings.Contains(u, "://"):
		return fmt.Sprintf("%q: want an https://, http:// or ssh:// URL (an scp-like git@host:path is written ssh://git@host/path)", u)
	case err != nil:
		return fmt.Sprintf("%q is not a URL", u)
	case p.Scheme != "https" && p.Scheme != "http" && p.Scheme != "ssh":
		return fmt.Sprintf("%q: want an https://, http:// or ssh:// URL (an scp-like git@host:path is written ssh://git@host/path)", u)
	case p.Host == "":
		return fmt.Sprintf("%q has no host", u)
	case p.User != nil && (p.Scheme != "ssh" || hasPassword(p.User)):
		return "must not hold credentials: the worker holds each tenant's git credentials"
	case p.RawQuery != "" || p.Fragment != "":
		return fmt.Sprintf("%q: a repository URL has no query or fragment", u)
	case strings.Trim(p.Path, "/") == "":
		return fmt.Sprintf("%q names no repository path", u)
	}
	return ""
}

func hasPassword(u *url.Userinfo) bool {
	_, ok := u.Password()
	return ok
}

// parseTokenHash reads a bearer token's SHA-256 hash.
func parseTokenHash(h string) ([sha256.Size]byte, bool) {
	var sum [sha256.Size]byte
	h = strings.ToLower(strings.TrimPrefix(h, "sha256:"))
	b, err := hex.DecodeString(h)
	if err != nil || len(b) != sha256.Size {
		return sum, false
	}
	copy(sum[:], b)
	return sum, true
}

// readLimited reads a file of at most limit bytes.
func readLimited(p string, limit int64) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s is larger than %d bytes", p, limit)
	}
	return b, nil
}
