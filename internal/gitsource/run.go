package gitsource

import (
	"context"
	"crypto/x509"
	"fmt"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-git/go-billy/v5/osfs"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/cache"
	"github.com/go-git/go-git/v5/storage/filesystem"

	v1 "github.com/buildq/buildq/api/v1"
)

// progressInterval is the least time between two throttled progress
// callbacks: a few per second.
const progressInterval = 250 * time.Millisecond

// minSecretLen is the shortest credential scrubbed from messages: a
// shorter one would mangle every message and protects nothing anyway.
const minSecretLen = 4

// run is one Fetch: its inputs, once checked, and its running state.
type run struct {
	lim      Limits
	pol      *policy
	creds    *Credentials
	src      Source
	repoURL  *url.URL // the source's URL, without userinfo
	display  string   // repoURL as text
	sshUser  string   // the ssh:// URL's user name ("git" when none)
	tempDir  string
	rootCAs  *x509.CertPool
	progress func(Progress)
	now      func() time.Time
	secrets  []string

	// received counts bytes read from git servers (by the dialer's
	// connections, which may be read by net/http's goroutines); failure
	// is the first limit or policy refusal, recorded where it happened.
	received atomic.Int64
	failure  atomic.Pointer[Error]

	// The rest is touched only by the Fetch's own goroutine.
	st       *filesystem.Storage
	objects  int64                  // objects announced by the packs so far
	expanded int64                  // what indexing those objects may inflate and rebuild
	opened   int                    // submodule repositories opened
	lastEmit time.Time              // last throttled progress callback
	complete map[plumbing.Hash]bool // commits whose whole tree is stored
}

// newRun checks src and the Fetcher's settings and gathers the tenant's
// credentials.
func (f *Fetcher) newRun(tenant string, src Source, progress func(Progress)) (*run, error) {
	pol, err := compilePolicy(f.Policy)
	if err != nil {
		return nil, &Error{Message: "gitsource: " + err.Error(), Transient: true, Err: err}
	}
	if len(f.Policy.AllowedHosts) == 0 {
		return nil, refuse(v1.ReasonGitHostRefused, "git sources are not enabled on this worker: --allowed-git-host is empty", nil)
	}
	u, user, err := parseRepoURL(src.URL)
	if err != nil {
		return nil, err
	}
	if err := checkSource(src); err != nil {
		return nil, err
	}
	r := &run{
		lim:      f.Limits.withDefaults(),
		pol:      pol,
		src:      src,
		repoURL:  u,
		display:  u.String(),
		sshUser:  user,
		tempDir:  f.TempDir,
		rootCAs:  f.RootCAs,
		progress: progress,
		now:      time.Now,
		complete: map[plumbing.Hash]bool{},
	}
	if r.tempDir == "" {
		r.tempDir = os.TempDir()
	}
	if raw, perr := url.Parse(src.URL); perr == nil && raw.User != nil {
		if p, ok := raw.User.Password(); ok && len(p) >= minSecretLen {
			r.secrets = append(r.secrets, p)
		}
	}
	if f.Credentials != nil {
		c, err := f.Credentials(tenant)
		if err != nil {
			return nil, transient("get the tenant's git credentials", err)
		}
		if c != nil {
			cc := *c
			r.creds = &cc
			if len(cc.Password) >= minSecretLen {
				r.secrets = append(r.secrets, cc.Password)
			}
		}
	}
	return r, nil
}

// parseRepoURL checks a repository URL and returns it without userinfo,
// with the ssh user name apart. Messages never echo the raw URL, which
// may hold a password.
func parseRepoURL(raw string) (*url.URL, string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, "", invalid("the git URL is not a valid URL")
	}
	u.Scheme = strings.ToLower(u.Scheme)
	switch {
	case u.Scheme != "https" && u.Scheme != "http" && u.Scheme != "ssh":
		return nil, "", invalid("the git URL must be an https://, http:// or ssh:// URL")
	case u.Opaque != "" || u.Host == "" || u.Hostname() == "":
		return nil, "", invalid("the git URL has no host")
	case u.RawQuery != "" || u.Fragment != "" || u.ForceQuery:
		return nil, "", invalid("the git URL must not have a query or a fragment")
	case strings.ContainsAny(u.Path, "\x00\r\n"):
		return nil, "", invalid("the git URL's path holds a control character")
	}
	user := "git"
	if u.User != nil && u.User.Username() != "" {
		user = u.User.Username()
	}
	u.User = nil
	return u, user, nil
}

// checkSource checks the parts of src other than the URL, as v1's
// validation does: Fetch does not trust that it ran.
func checkSource(src Source) error {
	if src.Ref == "" && src.Commit == "" {
		return invalid("a git source needs a ref (branch, tag or full ref), a commit, or both")
	}
	if src.Ref != "" {
		if msg := v1.GitRefProblem(src.Ref); msg != "" {
			return invalid("the git ref " + msg)
		}
	}
	if src.Commit != "" {
		switch {
		case len(src.Commit) == 64 && isLowerHex(src.Commit):
			return invalid("SHA-256 repositories are not supported: the commit must be a 40-digit SHA-1")
		case len(src.Commit) != 40 || !isLowerHex(src.Commit):
			return invalid("the commit must be a full commit hash (40 lowercase hex digits)")
		}
	}
	if p := src.SubPath; p != "" {
		if strings.HasPrefix(p, "/") || strings.ContainsAny(p, "\x00\r\n\\") || path.Clean(p) != p || p == "." || p == ".." || strings.HasPrefix(p, "../") {
			return invalid(fmt.Sprintf("the subPath %q must be a clean relative path without '..'", truncate(p, 80)))
		}
	}
	if d := src.Dockerfile; d != "" && (!filepath.IsLocal(d) || strings.ContainsAny(d, "\x00\\")) {
		return invalid(fmt.Sprintf("the Dockerfile path %q must be a relative path inside the context", truncate(d, 80)))
	}
	return nil
}

func isLowerHex(s string) bool {
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// emit reports p.
func (r *run) emit(p Progress) {
	if r.progress != nil {
		r.lastEmit = r.now()
		r.progress(p)
	}
}

// emitThrottled reports p unless a report went out less than
// progressInterval ago.
func (r *run) emitThrottled(p Progress) {
	if r.progress != nil && r.now().Sub(r.lastEmit) >= progressInterval {
		r.emit(p)
	}
}

// openStore makes the run's object store in dir: go-git's on-disk
// storage, so that fetched packs stay compressed on disk rather than
// expanded in memory, with large objects streamed instead of cached. Its
// files stop working when ctx ends (ctxFS).
func (r *run) openStore(ctx context.Context, dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return transient("create the object store", err)
	}
	fs := ctxFS{Filesystem: osfs.New(dir), ctx: ctx}
	st := filesystem.NewStorageWithOptions(fs, cache.NewObjectLRU(32*cache.MiByte), filesystem.Options{
		ExclusiveAccess:      true,
		KeepDescriptors:      true, // closed by closeStore; reopening a pack per object is slow
		LargeObjectThreshold: 1 << 20,
	})
	if err := st.Init(); err != nil {
		return transient("create the object store", err)
	}
	r.st = st
	return nil
}

// closeStore releases the store's open files.
func (r *run) closeStore() {
	if r.st != nil {
		_ = r.st.Close()
	}
}
