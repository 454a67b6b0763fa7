package worker

import (
	"context"
	"fmt"
	"sync"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/s3store"
)

// gitRepos is a GitSources over repositories a test defines: each
// url#ref (or url#commit) is a tree of files, packed with packDir into the
// tenant's own area of an objectStore, as the real one stores it in S3.
// A tenant without access to a URL gets GitAuthFailed.
type gitRepos struct {
	t     *testing.T
	store *objectStore

	mu      sync.Mutex
	refs    map[string]string            // url#ref → commit
	trees   map[string]map[string]string // url#commit → files
	denied  map[string]bool              // tenant#url
	packs   map[string]int               // tenant → Pack calls
	gate    chan struct{}                // nil: Pack runs at once
	entered chan struct{}                // closed when a gated Pack starts
}

func newGitRepos(t *testing.T, store *objectStore) *gitRepos {
	return &gitRepos{t: t, store: store, refs: map[string]string{}, trees: map[string]map[string]string{},
		denied: map[string]bool{}, packs: map[string]int{}}
}

// push makes ref of url point at commit, whose tree is files.
func (g *gitRepos) push(url, ref, commit string, files map[string]string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.refs[url+"#"+ref] = commit
	g.trees[url+"#"+commit] = files
}

func (g *gitRepos) deny(tenant, url string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.denied[tenant+"#"+url] = true
}

// hold makes the next Packs wait until release (or their context ends).
func (g *gitRepos) hold() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.gate, g.entered = make(chan struct{}), make(chan struct{})
}

func (g *gitRepos) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	close(g.gate)
	g.gate = nil
}

func (g *gitRepos) packCount(tenant string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.packs[tenant]
}

func (g *gitRepos) Pack(ctx context.Context, tenant string, src v1.GitSource, _ string, progress func(string)) (*v1.ResolvedSource, error) {
	g.mu.Lock()
	g.packs[tenant]++
	gate, entered := g.gate, g.entered
	g.mu.Unlock()
	if gate != nil {
		select {
		case <-entered:
		default:
			close(entered)
		}
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	progress("resolving " + src.Ref)
	g.mu.Lock()
	denied := g.denied[tenant+"#"+src.URL]
	commit := src.Commit
	if commit == "" {
		commit = g.refs[src.URL+"#"+src.Ref]
	}
	files, ok := g.trees[src.URL+"#"+commit]
	g.mu.Unlock()
	switch {
	case denied:
		return nil, &SourceError{Reason: v1.ReasonGitAuthFailed, Message: "git: authentication required: " + src.URL}
	case commit == "":
		return nil, &SourceError{Reason: v1.ReasonGitRefNotFound, Message: fmt.Sprintf("git: no ref %q in %s", src.Ref, src.URL)}
	case !ok:
		return nil, &SourceError{Reason: v1.ReasonGitCommitNotFound, Message: "git: no commit " + commit}
	}
	digest, archive := packDir(g.t, files)
	key := s3store.TenantContextKey(tenant, digest)
	g.store.put(key, archive)
	return &v1.ResolvedSource{
		SourceInfo: v1.SourceInfo{GitURL: src.URL, Ref: src.Ref, Commit: commit, SubPath: src.SubPath, ContextDigest: digest},
		S3:         v1.S3Source{Bucket: "buildq", Key: key},
	}, nil
}

// gitRequest is tenant's request for ref of url.
func gitRequest(tenant, url, ref string) *v1.Request {
	r := request("git")
	r.Tenant, r.ContextDigest = tenant, ""
	r.Source = v1.Source{Git: &v1.GitSource{URL: url, Ref: ref}}
	return r
}
