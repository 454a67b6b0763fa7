package worker

// Git sources: the worker packs the commit's tree into its tenant's own
// S3 context and builds that, keyed by content (source.go).

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
)

const repoURL = "https://git.example.com/acme/web.git"

var webTree = map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "v1"}

// resolvedKey is the build key of req once its git source is packed as
// src: the key of the S3 request for that context.
func resolvedKey(req *v1.Request, src *v1.SourceInfo, tenant string) string {
	r := *req
	r.Source = v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: s3store.TenantContextKey(tenant, src.ContextDigest)}}
	r.ContextDigest = src.ContextDigest
	return v1.BuildKey(&r, kanikoID)
}

// A git request is built from the context the worker packed: the Job
// reads the tenant's own S3 object (never git), and the result names the
// url, the ref, the commit it resolved to and the context digest.
//
// Origin: issue 26, git sources.
func TestGitSourceBuildsItsPackedContextAndNamesTheCommit(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	commit := strings.Repeat("1", 40)
	git.push(repoURL, "main", commit, webTree)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts, c.GitSources = store, git })
	results := e.collect()
	events := e.events()

	req := gitRequest("acme", repoURL, "main")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	digest, _ := packDir(t, webTree)
	src := &v1.SourceInfo{ContextDigest: digest}
	key := resolvedKey(req, src, "acme")
	job := e.waitJob(kaniko.JobName(key))
	args := strings.Join(job.Spec.Template.Spec.Containers[0].Args, " ")
	if strings.Contains(args, "git") || !strings.Contains(args, s3store.TenantContextKey("acme", digest)) {
		t.Fatalf("the Job does not build the packed context: %s", args)
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	r := oneResult(t, results, req.RequestID)
	want := v1.SourceInfo{GitURL: repoURL, Ref: "main", Commit: commit, ContextDigest: digest}
	if r.Data.Status != v1.StatusSucceeded || r.Data.Key != key || r.Data.Source == nil || *r.Data.Source != want {
		t.Fatalf("result %s, want succeeded with key %s and source %+v", mustJSON(t, r), key, want)
	}
	eventually(t, 5*time.Second, "a source progress event naming the commit", func() bool {
		for _, ev := range events.decoded() {
			if ev.RequestID == req.RequestID && ev.Phase == v1.PhaseJobCreated && ev.Source != nil && ev.Source.Commit == commit {
				return true
			}
		}
		return false
	})
	if !events.has(req.RequestID, v1.PhaseSource) {
		t.Error("no progress event of the source step")
	}
}

// The key is the content: two repositories and refs whose packed trees
// are the same build once; the second is answered from the first's image
// with a result naming its own url, ref and commit.
//
// Origin: issue 26, "two commits, refs or repositories whose packed
// context is identical dedupe to one build".
func TestIdenticalTreesFromTwoRepositoriesBuildOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	forkURL := "https://git.example.com/acme/web-fork.git"
	git.push(repoURL, "main", strings.Repeat("1", 40), webTree)
	git.push(forkURL, "refs/tags/v1", strings.Repeat("2", 40), webTree)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts, c.GitSources = store, git })
	results := e.collect()

	first := gitRequest("acme", repoURL, "main")
	if _, err := e.pub.Publish(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	digest, _ := packDir(t, webTree)
	job := e.waitJob(kaniko.JobName(resolvedKey(first, &v1.SourceInfo{ContextDigest: digest}, "acme")))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	a := oneResult(t, results, first.RequestID)

	second := gitRequest("acme", forkURL, "refs/tags/v1")
	if _, err := e.pub.Publish(context.Background(), second); err != nil {
		t.Fatal(err)
	}
	b := oneResult(t, results, second.RequestID)
	if b.Data.Status != v1.StatusSucceeded || b.Data.Origin != v1.OriginCache || b.Data.Digest != a.Data.Digest || b.Data.Key != a.Data.Key {
		t.Fatalf("second result %s, want acme's first image from the cache (%s)", mustJSON(t, b), mustJSON(t, a))
	}
	if s := b.Data.Source; s == nil || s.GitURL != forkURL || s.Ref != "refs/tags/v1" || s.Commit != strings.Repeat("2", 40) || s.ContextDigest != digest {
		t.Fatalf("second result's source %+v, want its own url, ref and commit", b.Data.Source)
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d Jobs created, want 1", n)
	}
}

// A source that cannot be built fails at once with its own reason —
// never retried, never a Job: a tenant without access, an unknown ref, a
// worker without git sources.
//
// Origin: issue 26, "each fail at once with a reason of their own".
func TestGitFailuresFailAtOnceWithTheirReason(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	git.push(repoURL, "main", strings.Repeat("1", 40), webTree)
	git.deny("mallory", repoURL)
	e.startWorker("w1", func(c *Config) { c.Contexts, c.GitSources = store, git })
	results := e.collect()

	denied := gitRequest("mallory", repoURL, "main")
	unknown := gitRequest("acme", repoURL, "no-such-branch")
	for _, r := range []*v1.Request{denied, unknown} {
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	for id, reason := range map[string]string{denied.RequestID: v1.ReasonGitAuthFailed, unknown.RequestID: v1.ReasonGitRefNotFound} {
		r := oneResult(t, results, id)
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != reason || r.Data.Attempts != 1 || r.Data.Digest != "" {
			t.Errorf("%s: %s, want failed %s on the first attempt", id, mustJSON(t, r), reason)
		}
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created for sources that cannot be built", n)
	}
	// A result is published before its message is acked: settling follows.
	eventually(t, 10*time.Second, "the failures settled (no message pending)", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

func TestGitSourceOnAWorkerWithoutGitIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	req := gitRequest("acme", repoURL, "main")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	r := oneResult(t, results, req.RequestID)
	if r.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(r.Data.Message, "--allowed-git-host") {
		t.Fatalf("%s, want InvalidRequest naming --allowed-git-host", mustJSON(t, r))
	}
}

// Trouble reaching the git server is transient: retried, and built once
// it clears.
func TestGitTroubleIsRetried(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	git.push(repoURL, "main", strings.Repeat("1", 40), webTree)
	flaky := &flakyGit{gitRepos: git}
	flaky.failures.Store(1)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts, c.GitSources = store, flaky })
	results := e.collect()
	req := gitRequest("acme", repoURL, "main")
	digest, _ := packDir(t, webTree)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(resolvedKey(req, &v1.SourceInfo{ContextDigest: digest}, "acme")))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
		t.Fatalf("%s, want success on the second attempt", mustJSON(t, r))
	}
}

// flakyGit fails its first Packs with a connection error.
type flakyGit struct {
	*gitRepos
	failures atomic.Int32
}

func (f *flakyGit) Pack(ctx context.Context, tenant string, src v1.GitSource, dockerfile string, progress func(string)) (*v1.ResolvedSource, error) {
	if f.failures.Add(-1) >= 0 {
		return nil, errors.New("dial tcp 10.0.0.1:443: connect: connection refused")
	}
	return f.gitRepos.Pack(ctx, tenant, src, dockerfile, progress)
}

// A delivery after a crash builds the commit the first one packed, even
// when the branch moved meanwhile: the request asked for what its ref
// named when it was first taken, and one request never becomes two
// builds.
//
// Origin: issue 26, the resolved commit recorded in the ledger.
func TestRedeliveryBuildsTheRecordedCommitNotTheMovedRef(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	first := strings.Repeat("1", 40)
	git.push(repoURL, "main", first, webTree)
	withGit := func(c *Config) {
		withRegistry(tr)(c)
		c.Contexts, c.GitSources = store, git
		c.AckWait = 2 * time.Second
	}
	w1 := e.startWorker("w1", withGit)
	results := e.collect()
	req := gitRequest("acme", repoURL, "main")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	digest, _ := packDir(t, webTree)
	key := resolvedKey(req, &v1.SourceInfo{ContextDigest: digest}, "acme")
	job := e.waitJob(kaniko.JobName(key))
	w1.stop(t)
	git.push(repoURL, "main", strings.Repeat("2", 40), map[string]string{"Dockerfile": "FROM scratch\n", "app": "v2"})

	e.startWorker("w2", withGit)
	e.kubelet(job, 0, tr.push(t, destination(job)))
	r := oneResult(t, results, req.RequestID)
	if r.Data.Status != v1.StatusSucceeded || r.Data.Key != key || r.Data.Source == nil || r.Data.Source.Commit != first {
		t.Fatalf("%s, want the first commit's build (key %s)", mustJSON(t, r), key)
	}
	if n := git.packCount("acme"); n != 1 {
		t.Fatalf("packed %d times, want once (the redelivery reuses the recorded context)", n)
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d Jobs created, want 1", n)
	}
}

// Canceling a request while its source is fetched ends the fetch: the
// request is answered canceled and nothing is built.
func TestCancelWhileFetchingEndsTheFetch(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	git.push(repoURL, "main", strings.Repeat("1", 40), webTree)
	git.hold()
	e.startWorker("w1", func(c *Config) { c.Contexts, c.GitSources = store, git })
	results := e.collect()
	req := gitRequest("acme", repoURL, "main")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	select {
	case <-git.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the source was never fetched")
	}
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), req.RequestID)
	if !rep.Canceled || rep.Requests != 1 {
		t.Fatalf("cancel reply %+v, want one request canceled", rep)
	}
	r := oneResult(t, results, req.RequestID)
	if r.Data.Status != v1.StatusCanceled {
		t.Fatalf("%s, want canceled", mustJSON(t, r))
	}
	git.release()
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created for a canceled request", n)
	}
}

func TestShownURLKeepsAnSSHUserAndDropsSecrets(t *testing.T) {
	for asked, want := range map[string]string{
		"ssh://git@git.example.com/acme/web.git":    "ssh://git@git.example.com/acme/web.git",
		"ssh://git:pw@git.example.com/acme/web.git": "ssh://git@git.example.com/acme/web.git",
		"https://TOKEN@github.com/acme/web.git":     "https://github.com/acme/web.git",
		"https://user:pass@github.com/acme/web.git": "https://github.com/acme/web.git",
		"https://github.com/acme/web.git":           "https://github.com/acme/web.git",
	} {
		u, _ := url.Parse(asked)
		u.User = nil // what the fetcher reports
		if got := shownURL(asked, u.String()); got != want {
			t.Errorf("shownURL(%s) = %s, want %s", asked, got, want)
		}
	}
}
