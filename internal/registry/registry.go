// Package registry is buildq's client for OCI/Docker registries: it asks
// whether an image exists (Head), retags and copies images without changing
// their digests (Copy), pushes images built in process (Push) and creates
// Harbor projects on demand (EnsureHarborProject).
//
// It authenticates with a docker config.json, the same file kaniko pushes
// with, so the worker and its build jobs always act as the same registry
// user. Everything else is go-containerregistry.
package registry

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// ErrNotFound means the registry said the manifest or repository does not
// exist (HTTP 404, MANIFEST_UNKNOWN, NAME_UNKNOWN) in answer to a manifest
// request. Any other failure (network, auth, 5xx, a host that is not a
// registry) is NOT ErrNotFound: callers treat those as transient and must
// never read them as "exists" or as "gone".
var ErrNotFound = errors.New("registry: manifest or repository not found")

// IsNotFound reports errors.Is(err, ErrNotFound).
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// Options configures a Client.
type Options struct {
	// DockerConfig is the path of a docker config.json (the same
	// credentials kaniko pushes with, i.e. the content of a
	// kubernetes.io/dockerconfigjson Secret). Empty: anonymous.
	DockerConfig string
	// DockerConfigData, when set, is DockerConfig's content, already
	// read: New parses it instead of reading the file (DockerConfig then
	// only names it in errors).
	DockerConfigData []byte
	// Insecure lists registries (host[:port]) reached over plain HTTP.
	Insecure []string
	// Transport, when set, replaces http.DefaultTransport (tests, proxies).
	Transport http.RoundTripper
	// UserAgent (default "buildq").
	UserAgent string
}

// DefaultUserAgent is the User-Agent prefix when Options.UserAgent is empty.
const DefaultUserAgent = "buildq"

// Client talks to registries with one set of credentials. Its settings are
// fixed by New; it is safe for concurrent use.
type Client struct {
	creds     *credentials
	keychain  authn.Keychain
	insecure  map[string]bool // lower-case host[:port]
	transport http.RoundTripper
	userAgent string

	// backoff overrides go-containerregistry's retry backoff (1s, 3s);
	// tests set it so that 5xx answers do not cost seconds.
	backoff *remote.Backoff

	// heads keeps the authenticated transports of Head per repository.
	heads headCache
}

// headCache holds a go-containerregistry Puller for Head: without it every
// call pings /v2/ and authenticates before its HEAD, two or three round
// trips for one — on every cache hit and every new build's preflight. It
// is renewed every headCacheTTL, so the repositories it remembers stay
// few and a transport that went bad does not live on.
type headCache struct {
	mu   sync.Mutex
	p    *remote.Puller
	made time.Time
}

const headCacheTTL = 10 * time.Minute

// puller returns the current Puller, making a new one when there is none
// or it is older than headCacheTTL; nil if one cannot be made.
func (c *Client) puller() *remote.Puller {
	c.heads.mu.Lock()
	defer c.heads.mu.Unlock()
	if c.heads.p == nil || time.Since(c.heads.made) > headCacheTTL {
		p, err := remote.NewPuller(c.RemoteOptions(context.Background())...)
		if err != nil {
			return nil
		}
		c.heads.p, c.heads.made = p, time.Now()
	}
	return c.heads.p
}

// New builds a Client. It reads and validates Options.DockerConfig once, so
// a malformed Secret fails at start-up, naming the file, rather than at the
// first push; later edits of the file are not seen.
func New(opts Options) (*Client, error) {
	c := &Client{
		creds:     &credentials{},
		insecure:  map[string]bool{},
		transport: opts.Transport,
		userAgent: opts.UserAgent,
	}
	if c.userAgent == "" {
		c.userAgent = DefaultUserAgent
	}
	for _, h := range opts.Insecure {
		h = strings.TrimSpace(h)
		if _, err := name.NewRegistry(h, name.StrictValidation); err != nil {
			return nil, fmt.Errorf("registry: insecure registry %q must be host[:port]: %w", h, err)
		}
		c.insecure[strings.ToLower(h)] = true
	}
	if opts.DockerConfig != "" || opts.DockerConfigData != nil {
		data := opts.DockerConfigData
		if data == nil {
			var err error
			if data, err = os.ReadFile(opts.DockerConfig); err != nil {
				return nil, fmt.Errorf("registry: read docker config: %w", err)
			}
		}
		creds, err := parseDockerConfig(data)
		if err != nil {
			return nil, fmt.Errorf("registry: docker config %s: %w", opts.DockerConfig, err)
		}
		c.creds = creds
	}
	c.keychain = keychain{c.creds}
	return c, nil
}

// RemoteOptions returns the remote.Options (auth keychain, transport, user
// agent, ctx) for pulls, e.g. base images, so that they use the same
// credentials and transport as everything else.
func (c *Client) RemoteOptions(ctx context.Context) []remote.Option {
	opts := []remote.Option{
		remote.WithContext(ctx),
		remote.WithAuthFromKeychain(c.keychain),
		remote.WithUserAgent(c.userAgent),
	}
	if c.transport != nil {
		opts = append(opts, remote.WithTransport(c.transport))
	}
	if c.backoff != nil {
		opts = append(opts, remote.WithRetryBackoff(*c.backoff))
	}
	return opts
}

// ParseReference parses ref strictly (explicit registry, and a tag or a
// digest: buildq never wants Docker Hub or "latest" by accident), honouring
// Insecure (name.Insecure for those registries, so they are reached over
// plain HTTP).
func (c *Client) ParseReference(ref string) (name.Reference, error) {
	r, err := name.ParseReference(ref, name.StrictValidation)
	if err != nil {
		return nil, fmt.Errorf("registry: invalid image reference %q: %w", ref, err)
	}
	if c.insecure[strings.ToLower(r.Context().RegistryStr())] {
		if r, err = name.ParseReference(ref, name.StrictValidation, name.Insecure); err != nil {
			return nil, fmt.Errorf("registry: invalid image reference %q: %w", ref, err)
		}
	}
	return r, nil
}

// parseTag parses ref like ParseReference and insists on a tag: writes
// need a name to land under.
func (c *Client) parseTag(ref string) (name.Tag, error) {
	r, err := c.ParseReference(ref)
	if err != nil {
		return name.Tag{}, err
	}
	t, ok := r.(name.Tag)
	if !ok {
		return name.Tag{}, fmt.Errorf("registry: %q must be repository:tag, not a digest", ref)
	}
	return t, nil
}

// Head returns the digest ("sha256:…") of ref (repo:tag or repo@digest)
// using remote.Head with auth and context. It falls back to a GET when the
// registry cannot answer HEAD properly (405, or a response without the
// digest headers), as crane does. A missing manifest or repository gives
// an error wrapping ErrNotFound; every other failure does not.
func (c *Client) Head(ctx context.Context, ref string) (string, error) {
	r, err := c.ParseReference(ref)
	if err != nil {
		return "", err
	}
	opts := c.RemoteOptions(ctx)
	if p := c.puller(); p != nil {
		opts = append(opts, remote.Reuse(p))
	}
	desc, err := remote.Head(r, opts...)
	if err == nil {
		return desc.Digest.String(), nil
	}
	if ctx.Err() == nil && headUnsupported(err) {
		d, gerr := remote.Get(r, opts...)
		if gerr == nil {
			return d.Digest.String(), nil
		}
		err = gerr
	}
	return "", wrapErr("head", ref, err)
}

// Copy makes dst (a repo:tag) refer to the image or index at src
// (repo@digest or repo:tag) and returns the digest at dst. Within one
// repository it only tags (remote.Tag); to another repository or registry
// it writes the manifest and everything it references (remote.Write for
// images, remote.WriteIndex for indexes; blobs are cross-repository
// mounted when the registry is the same). The manifest bytes are copied
// as they are, so the digest is preserved exactly.
func (c *Client) Copy(ctx context.Context, src, dst string) (string, error) {
	return c.CopyTo(ctx, src, dst, c)
}

// CopyTo is Copy reading src with c's credentials and writing dst with
// writer's: the worker reads any tenant's image with its own and writes
// into a tenant's repository with that tenant's. Blobs are read through
// c as they are written (a cross-repository mount needs writer to read
// src, and falls back to an upload when it cannot).
func (c *Client) CopyTo(ctx context.Context, src, dst string, writer *Client) (string, error) {
	s, err := c.ParseReference(src)
	if err != nil {
		return "", err
	}
	d, err := writer.parseTag(dst)
	if err != nil {
		return "", err
	}
	desc, err := remote.Get(s, c.RemoteOptions(ctx)...)
	if err != nil {
		return "", wrapErr("copy: get", src, err)
	}
	opts := writer.RemoteOptions(ctx)
	switch {
	case s.Context().Name() == d.Context().Name():
		err = remote.Tag(d, desc, opts...)
	case desc.MediaType.IsIndex():
		var idx v1.ImageIndex
		if idx, err = desc.ImageIndex(); err == nil {
			err = remote.WriteIndex(d, idx, opts...)
		}
	case desc.MediaType.IsImage():
		var img v1.Image
		if img, err = desc.Image(); err == nil {
			err = remote.Write(d, img, opts...)
		}
	default:
		// Schema 1 and artifacts with other media types: remote.Push
		// knows how to carry those.
		err = remote.Push(d, desc, opts...)
	}
	if err != nil {
		return "", fmt.Errorf("registry: copy %s to %s: %w", src, dst, err)
	}
	return desc.Digest.String(), nil
}

// Push writes img under every ref in refs (all repo:tag) and returns its
// digest. The first ref gets the full write; further refs in a repository
// already written only get a tag (a manifest PUT). A ref in another
// repository of a registry already written to is copied from there, so
// that its blobs are mounted rather than uploaded again.
func (c *Client) Push(ctx context.Context, img v1.Image, refs []string) (string, error) {
	if len(refs) == 0 {
		return "", errors.New("registry: push: no references")
	}
	tags := make([]name.Tag, len(refs))
	for i, ref := range refs {
		t, err := c.parseTag(ref)
		if err != nil {
			return "", err
		}
		tags[i] = t
	}
	digest, err := img.Digest()
	if err != nil {
		return "", fmt.Errorf("registry: push: image digest: %w", err)
	}
	opts := c.RemoteOptions(ctx)
	// One Pusher, so that each repository is pinged and authorised once.
	p, err := remote.NewPusher(opts...)
	if err != nil {
		return "", fmt.Errorf("registry: push: %w", err)
	}
	written := map[string]bool{}             // repositories holding the image
	mountFrom := map[string]name.Reference{} // registry -> the image there, by digest
	for i, t := range tags {
		repo, reg := t.Context().Name(), t.Context().RegistryStr()
		switch from, ok := mountFrom[reg]; {
		case written[repo]:
			err = p.Put(ctx, t, img)
		case ok:
			var desc *remote.Descriptor
			if desc, err = remote.Get(from, opts...); err == nil {
				err = p.Push(ctx, t, desc)
			} else {
				err = p.Push(ctx, t, img) // cannot mount: upload
			}
		default:
			err = p.Push(ctx, t, img)
		}
		if err != nil {
			return "", fmt.Errorf("registry: push %s: %w", refs[i], err)
		}
		written[repo] = true
		mountFrom[reg] = t.Context().Digest(digest.String())
	}
	return digest.String(), nil
}

// wrapErr prefixes err with the operation and reference, and adds
// ErrNotFound when the registry said the manifest or repository does not
// exist.
func wrapErr(op, ref string, err error) error {
	if isNotFound(err) {
		return fmt.Errorf("registry: %s %s: %w: %w", op, ref, ErrNotFound, err)
	}
	return fmt.Errorf("registry: %s %s: %w", op, ref, err)
}

// isNotFound: only an answer to a manifest request counts. A 404 from the
// /v2/ ping or a token endpoint means a misconfigured registry, not a
// missing image, and a 5xx is the server's fault whatever its body says.
func isNotFound(err error) bool {
	var terr *transport.Error
	if !errors.As(err, &terr) || terr.Request == nil || terr.Request.URL == nil ||
		!strings.Contains(terr.Request.URL.Path, "/manifests/") {
		return false
	}
	if terr.StatusCode == http.StatusNotFound {
		return true
	}
	if terr.StatusCode < 400 || terr.StatusCode >= 500 {
		return false
	}
	for _, d := range terr.Errors {
		if d.Code == transport.ManifestUnknownErrorCode || d.Code == transport.NameUnknownErrorCode {
			return true
		}
	}
	return false
}

// headUnsupported reports whether a failed HEAD is worth a GET: the
// registry refused the method, or answered without the headers a HEAD
// needs. Network failures and HTTP errors would just repeat.
func headUnsupported(err error) bool {
	var terr *transport.Error
	if errors.As(err, &terr) {
		return terr.StatusCode == http.StatusMethodNotAllowed || terr.StatusCode == http.StatusNotImplemented
	}
	var uerr *url.Error
	var nerr net.Error
	return !errors.As(err, &uerr) && !errors.As(err, &nerr)
}
