package worker

// Attacks on git sources in the worker: a cancel racing the moment a
// git request gets its build key (Ledger.SetSource). A failing test is a
// break; its message says what went wrong.

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// staleGetKV is a KV bucket whose Get can be held after it has read:
// the caller goes on with a value that is stale by the time it uses it.
type staleGetKV struct {
	jetstream.KeyValue
	afterGet func(ctx context.Context, key string)
}

func (k *staleGetKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	e, err := k.KeyValue.Get(ctx, key)
	if k.afterGet != nil {
		k.afterGet(ctx, key)
	}
	return e, err
}

// A cancel reads a git request's ledger entry while its source is being
// fetched (no build key yet: the cancel takes the "unkeyed" path), and
// before it marks the entry canceled the handler records the packed
// source (SetSource gives the entry its key), claims the key and creates
// the Job. cancelUnkeyed's MarkCanceled retries on the changed entry and
// succeeds; the handler's context ends; the request is answered
// "canceled" — but the build it started is never stopped: its run is
// only released, the Job runs on and pushes an image for a request its
// tenant canceled, and the cancel's reply says "canceled 1 request(s)
// before its build started".
//
// BROKEN at e35fe61 (the reply says Stopped: false, the Job is left, its
// run "building" with no owner). The uncommitted change in the working
// tree (Ledger.MarkCanceledUnkeyed reporting "keyed", the cancel then
// going on as a keyed one; SetSource refusing an entry marked Canceled)
// fixes it: this test passes on it.
func TestAttack_CancelRacingSetSourceStopsTheBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	git.push(repoURL, "main", strings.Repeat("1", 40), webTree)
	git.hold()
	req := gitRequest("acme", repoURL, "main")
	var lk atomic.Value // the request's ledger key, once it is published with its id
	lk.Store("")
	digest, _ := packDir(t, webTree)
	key := resolvedKey(req, &v1.SourceInfo{ContextDigest: digest}, "acme")

	read, proceed := make(chan struct{}), make(chan struct{})
	var once atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) { c.Contexts, c.GitSources = store, git }, nil, func(w *Worker) {
		w.ledger.UseBucket(&staleGetKV{KeyValue: w.ledger.Bucket(), afterGet: func(ctx context.Context, k string) {
			if k == lk.Load().(string) && calledFrom(".(*Service).cancel") && once.CompareAndSwap(false, true) {
				close(read)
				select {
				case <-proceed:
				case <-ctx.Done():
				}
			}
		}})
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	lk.Store(ledger.Key("acme", req.RequestID))
	select {
	case <-git.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the source was never fetched")
	}

	type answer struct {
		rep v1.CancelReply
		err error
	}
	answers := make(chan answer, 1)
	go func() {
		for {
			m, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), req.RequestID, 20*time.Second)
			if errors.Is(err, nats.ErrNoResponders) {
				continue
			}
			var a answer
			if a.err = err; err == nil {
				a.err = json.Unmarshal(m.Data, &a.rep)
			}
			answers <- a
			return
		}
	}()
	select {
	case <-read:
	case <-time.After(10 * time.Second):
		t.Fatal("the cancel never read the request's entry")
	}
	// The cancel holds an entry without a key. Now the fetch ends, the
	// source is recorded and the build starts.
	git.release()
	job := e.waitJob(kaniko.JobName(key))
	close(proceed)

	a := <-answers
	if a.err != nil {
		t.Fatal(a.err)
	}
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s, want canceled", mustJSON(t, r))
	}
	if !a.rep.Canceled || !a.rep.Stopped {
		state := "none"
		if rec := e.claim(key); rec != nil {
			state = rec.State + " (owner " + rec.Owner + ")"
		}
		t.Fatalf("cancel reply %+v: the request is canceled but the build it started is not stopped "+
			"(job %s deleted: %v; its run: %s)", a.rep, job.Name, e.jobGone(job.Name)(), state)
	}
	eventually(t, 10*time.Second, "job "+job.Name+" deleted", e.jobGone(job.Name))
}

// A git request that parks on another run of its key (here a run whose
// owner is dead) is requeued by the waiter sweep as a new message; its
// handler finds the entry by the requeue token and builds the source the
// entry records — it does not fetch again, and a branch that moved
// meanwhile does not make the one request a second, different build.
// (Refused: the existing tests cover a redelivery, not a requeue.)
func TestAttack_RequeuedGitRequestBuildsItsRecordedSourceOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	first := strings.Repeat("1", 40)
	git.push(repoURL, "main", first, webTree)
	r := e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts, c.GitSources = store, git })
	results := e.collect()
	req := gitRequest("acme", repoURL, "main")
	digest, _ := packDir(t, webTree)
	key := resolvedKey(req, &v1.SourceInfo{ContextDigest: digest}, "acme")
	putDeadRun(t, r.w, tr, key)

	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	waitParked(t, r.w, key, req.RequestID)
	git.push(repoURL, "main", strings.Repeat("2", 40), map[string]string{"Dockerfile": "FROM scratch\n", "app": "v2"})

	res := playUntilAnswered(t, e, tr, results, key, req.RequestID, 30*time.Second)
	if d := res.Data; d.Status != v1.StatusSucceeded || d.Key != key || d.Source == nil || d.Source.Commit != first {
		t.Fatalf("requeued request answered %s, want the recorded commit's build (key %s)", mustJSON(t, res), key)
	}
	if n := git.packCount("acme"); n != 1 {
		t.Fatalf("the request's source was packed %d times, want once", n)
	}
	if rs := storedOf(results, "acme", req.RequestID); len(rs) != 1 {
		t.Fatalf("%d results stored for one request", len(rs))
	}
}

// The tenant's cancel marks the entry of a request whose source is being
// fetched, and the note that would end the fetch (published on core NATS,
// fire-and-forget, to the worker holding the request) is lost. The fetch
// finishes; recording its source must see the cancel: the request is
// answered canceled and nothing is built. Before, SetSource keyed the
// canceled entry, the handler claimed the key and created a Job nobody
// stopped; only the recorded decision said "canceled". BROKEN at
// e35fe61 (a Job is created); passes with the working tree's SetSource
// (ErrCanceled for an entry marked Canceled).
func TestAttack_CanceledWhileFetchingWithTheNoteLostBuildsNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newObjectStore()
	git := newGitRepos(t, store)
	git.push(repoURL, "main", strings.Repeat("1", 40), webTree)
	git.hold()
	r := e.startWorker("w1", func(c *Config) { c.Contexts, c.GitSources = store, git })
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
	// What cancelUnkeyed writes, without its note to the handler.
	ctx := context.Background()
	le, err := r.w.ledger.Get(ctx, "acme", req.RequestID)
	if err != nil || le == nil {
		t.Fatalf("entry: %v %v", le, err)
	}
	if ok, err := r.w.ledger.MarkCanceled(ctx, le); !ok || err != nil {
		t.Fatalf("mark canceled: %v %v", ok, err)
	}
	git.release()
	eventually(t, 15*time.Second, "a result or a Job", func() bool {
		return len(byID(results.snapshot())[req.RequestID]) > 0 || e.creates.total() > 0
	})
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Job(s) created for a request canceled before its source was recorded", n)
	}
	if res := oneResult(t, results, req.RequestID); res.Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s, want canceled", mustJSON(t, res))
	}
}
