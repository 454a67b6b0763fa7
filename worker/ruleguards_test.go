package worker

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// ruleWorker is a worker set up (buckets and streams) but not running,
// over backend b, for driving one protocol step directly.
func ruleWorker(t *testing.T, e *env, b Backend) *Worker {
	t.Helper()
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	w, err := New(e.nc, b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(context.Background()); err != nil {
		t.Fatal(err)
	}
	return w
}

// countingBackend counts the builds it is asked to run, and runs none.
type countingBackend struct{ runs chan Build }

func (countingBackend) Identity() string { return "counting" }
func (b countingBackend) Run(ctx context.Context, bd Build, _ Started) (Outcome, error) {
	select {
	case b.runs <- bd:
	default:
	}
	<-ctx.Done()
	return Outcome{}, ctx.Err()
}
func (countingBackend) Cleanup(context.Context, string, string) error { return nil }

// A handler that reaches the build step of a request another handler of
// the same message already answered (it stalled while the redelivered copy
// was decided elsewhere) starts nothing: no claim, no Job. The mutant
// "answered-check-off" broke this rule.
func TestAnsweredRequestStartsNoBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	b := countingBackend{runs: make(chan Build, 1)}
	w := ruleWorker(t, e, b)
	ctx := context.Background()

	req := request("answered-elsewhere")
	const seq = 7
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, State: string(v1.StatusSucceeded),
		Seq: seq, UpdatedAt: time.Now().UTC(),
		Result: &v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Status: v1.StatusSucceeded, Digest: digestOf("answered-elsewhere")}}
	raw, _ := json.Marshal(entry)
	if _, err := w.ledger.Bucket().Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw); err != nil {
		t.Fatal(err)
	}
	key := w.builds.keyOf(req)
	repo, err := w.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	// Bounded: a build started by mistake would wait on the backend.
	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, _, _, err = w.builds.build(bctx, req, key, repo, naming.Destinations(repo, key, req.Tags), seq, nil)
	if !errors.Is(err, errAnswered) {
		t.Fatalf("build of an answered request: %v, want errAnswered", err)
	}
	if cur, _, err := w.runs.Get(ctx, key); err != nil || cur != nil {
		t.Fatalf("an answered request claimed its key: %+v (%v)", cur, err)
	}
	select {
	case bd := <-b.runs:
		t.Fatalf("an answered request started a build: run %s", bd.Run)
	default:
	}
}

// The reconciler stores a finished Job's outcome only on the run that Job
// was made for: a Job of an earlier run of the key (left behind, or
// finishing late) never ends the run building now. The mutant
// "reconcile-any-run" broke this rule.
func TestReconcilerEndsOnlyTheJobsOwnRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	ctx := context.Background()

	key := "reconcile-own-run"
	current := v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "current-run", Owner: "", LeaseMs: 2000,
		RequestID: "r1", Seq: 1, Tenant: "acme", Name: "api", StartedAt: time.Now().UTC()}
	raw, _ := json.Marshal(current)
	if _, err := w.runs.Bucket().Put(ctx, key, raw); err != nil {
		t.Fatal(err)
	}
	// A failed Job of an earlier run, its owner gone.
	if again := w.builds.finishOrphan(ctx, key, Outcome{Run: "earlier-run", Reason: v1.ReasonBuildFailed, Message: "RUN make: exit status 2"}); again != 0 {
		t.Fatalf("finishOrphan asked to look again in %s at another run's Job", again)
	}
	got, _, err := w.runs.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != v1.StateBuilding || got.Run != "current-run" {
		t.Fatalf("the run building now was ended with another run's Job outcome: %+v", got)
	}
	// Its own Job's outcome ends it (the claim was released: no wait).
	if again := w.builds.finishOrphan(ctx, key, Outcome{Run: "current-run", Reason: v1.ReasonBuildFailed, Message: "RUN make: exit status 2"}); again != 0 {
		t.Fatalf("finishOrphan of the run's own Job asked to look again in %s", again)
	}
	if got, _, err = w.runs.Get(ctx, key); err != nil || got.State != v1.StateFailed || got.Run != "current-run" {
		t.Fatalf("the run's own Job outcome did not end it: %+v (%v)", got, err)
	}
}

// Another worker's decision that is not marked published yet is that
// worker's to publish: a worker that reads it publishes nothing at once
// (the decider may only be slow), and takes it over only after it stayed
// unchanged for the grace. The mutant "publish-unmarked-at-once" broke
// this rule.
func TestAnotherWorkersUnmarkedDecisionIsNotPublishedAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	ctx := context.Background()

	req := request("unmarked-elsewhere")
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, State: string(v1.StatusSucceeded),
		Seq: 3, Worker: "w2", UpdatedAt: time.Now().UTC(),
		Result: &v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Status: v1.StatusSucceeded, Digest: digestOf("unmarked-elsewhere")}}
	raw, _ := json.Marshal(entry)
	rev, err := w.ledger.Bucket().Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw)
	if err != nil {
		t.Fatal(err)
	}
	le := &ledger.Entry{E: entry, Rev: rev}
	published := 0
	res, err := w.ledger.Deliver(ctx, le, ledger.DecisionOf(entry), ledger.Delivery{Publish: func(context.Context, ledger.Decision) error {
		published++
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != ledger.Later || published != 0 {
		t.Fatalf("w1 delivered w2's unmarked decision at once (status %d, %d publishes), want later and none", res.Status, published)
	}
	got, err := w.ledger.Get(ctx, req.Tenant, req.RequestID)
	if err != nil || got == nil || got.E.Worker != "w2" {
		t.Fatalf("the decision changed hands at the first look: %+v (%v)", got, err)
	}
}
