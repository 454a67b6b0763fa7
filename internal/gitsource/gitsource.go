// Package gitsource turns a git source (a repository URL, a ref and/or a
// commit, a sub-path) into the same content-addressed build context an
// upload produces: the normalized tar.gz of internal/contexttar, with the
// same bytes and digest as if a user had checked that directory out and
// sent it with `buildq submit` (the .git directory aside).
//
// It runs entirely inside the worker process: no git binary, no shell, and
// never the build Pod, which therefore holds no git credential. The git
// wire protocol (v0 over smart HTTP and over SSH) is spoken by this package
// itself on top of go-git's packet and object formats and its on-disk
// object store, so that every connection goes through one dialer that
// enforces the worker's host policy on the address actually dialed, every
// byte received is counted, and every pack is checked object by object
// against the limits before go-git indexes it. Nothing is registered in
// go-git's global transport table: two Fetchers with different policies
// in one process stay apart.
//
// A Fetch resolves the ref with the server's ref advertisement, fetches
// exactly the commit it needs (depth 1 at the ref's tip; a commit below
// the tip directly by hash when the server allows it and otherwise by
// deepening the ref up to Limits.MaxDepth, after which it must be
// reachable from the ref), writes the sub-path's tree into a private
// directory through an os.Root (so no symlink of the repository can lead a
// write outside it), applying .dockerignore as it goes, and packs that
// directory with contexttar.Write into a temporary .tar.gz the caller
// uploads and then removes.
package gitsource

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/buildq/buildq/internal/contexttar"
)

// Source is the git source of one request, as v1.GitSource carries it.
type Source struct {
	// URL is https://, http:// (only for Policy.InsecureHosts) or ssh://.
	// Userinfo in it is never used and never shown: credentials come only
	// from Fetcher.Credentials.
	URL string
	// Ref is a branch, a tag or a full ref ("refs/heads/main", "HEAD").
	// Commit is optional with Ref and required without.
	Ref    string
	Commit string
	// SubPath is the directory of the commit to pack ("" = the root).
	SubPath string
	// Submodules fetches the commit's submodules into the context; without
	// it a submodule is the empty directory a plain checkout leaves.
	Submodules bool
	// Dockerfile is relative to SubPath ("" = "Dockerfile"). It is kept in
	// the context even when .dockerignore excludes it.
	Dockerfile string
}

// Credentials are a tenant's git credentials.
type Credentials struct {
	// Username and Password are HTTPS basic auth; a token goes in Password
	// (Username "x-access-token" when empty). They are sent only to the
	// host of the source's URL, never to a submodule's other host.
	Username, Password string
	// SSHKey is a PEM private key (unencrypted).
	SSHKey []byte
	// KnownHosts holds known_hosts lines; SSH to a host without a matching
	// key is refused unless InsecureIgnoreHostKey is set.
	KnownHosts            []byte
	InsecureIgnoreHostKey bool
}

// Policy says which git servers a worker may reach.
type Policy struct {
	// AllowedHosts are exact host names, "*.example.com" wildcards (any
	// subdomain, not the domain itself), "*" (any host), IP addresses or
	// CIDRs (10.0.0.0/8). A URL's host name must match a name entry (or
	// "*"); an IP or CIDR entry matches URLs whose host is an address in
	// it, and lets any allowed host resolve into it. Empty refuses every
	// git source. Validate checks the entries.
	AllowedHosts []string
	// InsecureHosts, in the same syntax, may be reached over plain http://.
	InsecureHosts []string
	// AllowPrivate lets an allowed host resolve to a loopback, private,
	// link-local, unspecified or multicast address (buildq dev). Without
	// it such an address is refused unless an AllowedHosts IP or CIDR
	// entry contains it.
	AllowPrivate bool
}

// Limits bound one Fetch. Zero values take the defaults given.
type Limits struct {
	// MaxFetchBytes caps the bytes received from git servers (as read from
	// the network, submodules included); default 512 MiB.
	MaxFetchBytes int64
	// MaxObjects caps the objects in what was fetched; default 500,000.
	MaxObjects int
	// MaxContextBytes caps the packed context's file content (contexttar's
	// MaxBytes); default contexttar.DefaultMaxBytes.
	MaxContextBytes int64
	// Timeout bounds resolve, fetch (go-git's indexing of the packs
	// included) and pack together; default 5m.
	Timeout time.Duration
	// MaxDepth caps the commits of history fetched when the commit is not
	// the ref's tip; default 1000.
	MaxDepth int
	// MaxObjectBytes caps the inflated size of any one fetched object,
	// which go-git holds in memory while indexing it; default 64 MiB
	// (a worker of 512 MiB runs 4 fetches at once).
	MaxObjectBytes int64
	// MaxExpandedBytes caps what indexing the fetched objects may
	// inflate and rebuild, so that a pack of few bytes cannot expand, or
	// keep go-git busy, without bound: each object's inflated size, and
	// for a delta also what rebuilding it from the whole object at the
	// start of its chain takes (its chain's sizes; git's default of at
	// most 50 deltas a chain is enforced too); default 4 GiB.
	MaxExpandedBytes int64
	// MaxSubmodules caps the submodule repositories one Fetch opens
	// (every instance counts: a repository that lists a submodule three
	// times over five levels would open 363); default 50.
	MaxSubmodules int
}

// Limit defaults.
const (
	DefaultMaxFetchBytes    int64 = 512 << 20
	DefaultMaxObjects             = 500_000
	DefaultTimeout                = 5 * time.Minute
	DefaultMaxDepth               = 1000
	DefaultMaxObjectBytes   int64 = 64 << 20
	DefaultMaxExpandedBytes int64 = 4 << 30
	DefaultMaxSubmodules          = 50
)

// withDefaults fills in the zero fields of l.
func (l Limits) withDefaults() Limits {
	if l.MaxFetchBytes <= 0 {
		l.MaxFetchBytes = DefaultMaxFetchBytes
	}
	if l.MaxObjects <= 0 {
		l.MaxObjects = DefaultMaxObjects
	}
	if l.MaxContextBytes <= 0 {
		l.MaxContextBytes = contexttar.DefaultMaxBytes
	}
	if l.Timeout <= 0 {
		l.Timeout = DefaultTimeout
	}
	if l.MaxDepth <= 0 {
		l.MaxDepth = DefaultMaxDepth
	}
	if l.MaxObjectBytes <= 0 {
		l.MaxObjectBytes = DefaultMaxObjectBytes
	}
	if l.MaxExpandedBytes <= 0 {
		l.MaxExpandedBytes = DefaultMaxExpandedBytes
	}
	if l.MaxSubmodules <= 0 {
		l.MaxSubmodules = DefaultMaxSubmodules
	}
	return l
}

// Fetcher turns git sources into contexts. Its fields are read, never
// written, by Fetch, which may be called concurrently.
type Fetcher struct {
	Policy Policy
	Limits Limits
	// Credentials returns tenant's git credentials; a nil func or
	// (nil, nil) means anonymous access. An error fails the Fetch as
	// transient trouble.
	Credentials func(tenant string) (*Credentials, error)
	// TempDir holds the work directory and the packed context ("" =
	// os.TempDir()).
	TempDir string
	// RootCAs verifies HTTPS servers (nil = the system's roots).
	RootCAs *x509.CertPool
}

// Progress is one step of a Fetch, for progress events.
type Progress struct {
	// Step is "resolving", "fetching" or "packing".
	Step string
	// Bytes is, while fetching, the bytes received so far; while packing,
	// the file bytes packed so far. Objects is the objects received, or
	// the entries packed.
	Bytes, Objects int64
	Message        string
}

// Progress steps.
const (
	StepResolving = "resolving"
	StepFetching  = "fetching"
	StepPacking   = "packing"
)

// Context is a packed git source.
type Context struct {
	// URL is the source's URL without userinfo.
	URL string
	// Ref is the full ref name the source's ref resolved to
	// ("refs/heads/main"; "" without a ref); Commit the commit packed.
	Ref, Commit, SubPath string
	// Digest is "sha256:<hex>" of the normalized tar, exactly as
	// contexttar reports it (an upload's contextDigest).
	Digest string
	// Size is the length of the .tar.gz at Path.
	Size int64
	// Path is a temporary .tar.gz for the caller to upload and Remove.
	Path string
}

// Open opens the packed context for reading.
func (c *Context) Open() (io.ReadCloser, error) {
	f, err := os.Open(c.Path)
	if err != nil {
		return nil, fmt.Errorf("gitsource: open context: %w", err)
	}
	return f, nil
}

// Remove deletes the packed context's file.
func (c *Context) Remove() error {
	if err := os.Remove(c.Path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("gitsource: remove context: %w", err)
	}
	return nil
}

// Fetch resolves src for tenant, fetches the commit and packs its SubPath
// tree. Every error it returns is an *Error: either the request's own
// failure (Transient false, Reason a v1 reason word, the git server's
// words in Message) or transient trouble (Transient true, Reason "").
// Nothing is left on disk on failure; on success only Context.Path.
func (f *Fetcher) Fetch(ctx context.Context, tenant string, src Source, progress func(Progress)) (*Context, error) {
	r, err := f.newRun(tenant, src, progress)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeoutCause(ctx, r.lim.Timeout, errTimeout)
	defer cancel()

	work, err := os.MkdirTemp(f.TempDir, "buildq-git-")
	if err != nil {
		return nil, transient("create the work directory", err)
	}
	defer func() { _ = os.RemoveAll(work) }()

	out, err := r.fetch(ctx, work)
	if err != nil {
		return nil, r.classify(ctx, err)
	}
	return out, nil
}

// fetch is Fetch's work inside its work directory.
func (r *run) fetch(ctx context.Context, work string) (*Context, error) {
	if err := r.openStore(ctx, filepath.Join(work, "git")); err != nil {
		return nil, err
	}
	defer r.closeStore()

	r.emit(Progress{Step: StepResolving, Message: "resolving " + r.display})
	rp, err := r.openRepo(ctx, r.repoURL, r.sshUser)
	if err != nil {
		return nil, err
	}
	refName, commit, err := r.resolveAndFetch(ctx, rp)
	_ = rp.rem.close()
	if err != nil {
		return nil, err
	}

	dir := filepath.Join(work, "context")
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, transient("create the context directory", err)
	}
	r.emit(Progress{Step: StepPacking, Message: fmt.Sprintf("writing the tree of %s", commit)})
	if err := r.materialize(ctx, commit, dir); err != nil {
		return nil, err
	}
	out, err := r.pack(ctx, dir)
	if err != nil {
		return nil, err
	}
	out.URL, out.Ref, out.Commit, out.SubPath = r.display, refName, commit.String(), r.src.SubPath
	return out, nil
}

// pack writes dir as a normalized context into a temporary file.
func (r *run) pack(ctx context.Context, dir string) (*Context, error) {
	f, err := os.CreateTemp(r.tempDir, "buildq-git-context-*.tar.gz")
	if err != nil {
		return nil, transient("create the context file", err)
	}
	keep := false
	defer func() {
		if !keep {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	var packed int64
	res, err := contexttar.Write(ctx, dir, f, contexttar.Options{
		Dockerfile: r.src.Dockerfile,
		MaxBytes:   r.lim.MaxContextBytes,
		Progress: func(bytesRead int64, files int) {
			packed = bytesRead
			r.emitThrottled(Progress{Step: StepPacking, Bytes: bytesRead, Objects: int64(files)})
		},
	})
	if errors.Is(err, contexttar.ErrTooLarge) {
		return nil, tooLarge(fmt.Sprintf("the context's files are over MaxContextBytes=%d bytes", r.lim.MaxContextBytes), err)
	}
	if err != nil {
		return nil, fmt.Errorf("pack the context: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		return nil, transient("stat the context file", err)
	}
	if err := f.Close(); err != nil {
		return nil, transient("write the context file", err)
	}
	keep = true
	r.emit(Progress{Step: StepPacking, Bytes: packed, Objects: int64(res.Files),
		Message: fmt.Sprintf("packed %d entries into %d bytes, %s", res.Files, st.Size(), res.Digest)})
	return &Context{Digest: res.Digest, Size: st.Size(), Path: f.Name()}, nil
}
