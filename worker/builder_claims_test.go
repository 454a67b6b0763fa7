package worker

// Builder (build.go, own.go) over runs (worker/internal/runs): one claim
// per key. Concurrent requests of a key build once; a request answered
// elsewhere claims nothing; a live owner keeps its claim through a lost
// reply; a run ends only by a compare-and-swap on the revision its holder
// read (docs/design.md §2 step 4-5, §2a).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker/internal/runs"
)

// Origin: dedupe end to end (d7f9faf).
func TestConcurrentIdenticalRequestsBuildOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		e.startWorker(id, withRegistry(tr))
	}
	results := e.collect()

	const n = 50
	var key string
	for i := range n {
		r := request("same-content")
		r.Name = fmt.Sprintf("svc-%d", i%5) // who asks does not change the build
		key = v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage)
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	job := e.waitJob(kaniko.JobName(key))
	// Let every worker take its share before the build ends.
	time.Sleep(500 * time.Millisecond)
	shared := tr.push(t, destination(job))
	e.kubelet(job, 0, shared)

	got := results.waitFor(t, n, 30*time.Second)
	origins := map[v1.Origin]int{}
	ids := map[string]bool{}
	for _, r := range got {
		origins[r.Data.Origin]++
		ids[r.ID] = true
		// Five names, five repositories: the image is copied, not rebuilt.
		if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != shared || r.Data.Key != key ||
			r.Data.ImageRef != tr.host+"/acme/"+r.Data.Name+"@"+shared {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	if len(ids) != n {
		t.Errorf("%d distinct request ids in %d results", len(ids), len(got))
	}
	if origins[v1.OriginBuild] != 1 {
		t.Errorf("origins %v: want exactly one build", origins)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
	time.Sleep(300 * time.Millisecond)
	if len(results.snapshot()) != n {
		t.Errorf("%d results, want %d", len(results.snapshot()), n)
	}
	eventually(t, 5*time.Second, "all acked", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// A handler that reaches the build step of a request another handler of
// the same message already answered (it stalled while the redelivered copy
// was decided elsewhere) starts nothing: no claim, no Job. The mutant
// "answered-check-off" broke this rule.
//
// Origin: issue 24, mutation testing: a unit test for the mutant answered-check-off (85ff387).
func TestAnsweredRequestStartsNoBuild(t *testing.T) {
	t.Parallel()
	if err := buildOfAnAnsweredRequest(t, "answered-elsewhere", nil); !errors.Is(err, errAnswered) {
		t.Fatalf("build of an answered request: %v, want errAnswered", err)
	}
}

// The same check, when the ledger cannot be read (right after a NATS
// outage, the stall the check is for): it fails closed. The request is
// tried again later; nothing is claimed and no build starts on a guess
// that it is unanswered.
//
// Origin: the fault simulation, seed 173 (job-after-quiet): a handler cut
// off NATS while the redelivered copy of its request was answered
// elsewhere created a Job for it once back.
func TestAnUnreadableLedgerStartsNoBuild(t *testing.T) {
	t.Parallel()
	err := buildOfAnAnsweredRequest(t, "ledger-unreadable", func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onGet: func(context.Context, string) error { return nats.ErrTimeout }})
	})
	if !IsTransient(err) {
		t.Fatalf("build with the ledger unreadable: %v, want a transient error", err)
	}
}

// buildOfAnAnsweredRequest runs the build step of a request whose ledger
// entry holds its decision (answered by another handler of its message),
// once prepare (nil: nothing) has had the worker, and returns the build's
// error. It fails t if the request claimed its key or started a build.
func buildOfAnAnsweredRequest(t *testing.T, name string, prepare func(*Worker)) error {
	t.Helper()
	e := setup(t)
	b := countingBackend{runs: make(chan Build, 1)}
	w := ruleWorker(t, e, b)
	ctx := context.Background()

	req := request(name)
	const seq = 7
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, State: string(v1.StatusSucceeded),
		Seq: seq, UpdatedAt: time.Now().UTC(),
		Result: &v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Status: v1.StatusSucceeded, Digest: digestOf(name)}}
	raw, _ := json.Marshal(entry)
	if _, err := w.ledger.Bucket().Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw); err != nil {
		t.Fatal(err)
	}
	if prepare != nil {
		prepare(w)
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
	if cur, _, gerr := w.runs.Get(ctx, key); gerr != nil || cur != nil {
		t.Fatalf("an answered request claimed its key: %+v (%v); the build said %v", cur, gerr, err)
	}
	select {
	case bd := <-b.runs:
		t.Fatalf("an answered request started a build: run %s; the build said %v", bd.Run, err)
	default:
	}
	return err
}

// The renewer treats any error as "try again with the revision I hold".
// When the renewal was stored and only its reply was lost, the next
// renewal's CAS fails on the owner's own write, the owner cancels its
// build as if the claim were taken over, follows the record, finds itself
// named as owner, joins its own run and waits the full lapse (1.5 leases)
// before taking it back. Meanwhile nobody renews the claim: any worker may
// take the live build over; the local backend's build is canceled and
// restarted from scratch.
//
// Breaks the lease contract (a live owner renews every lease/3): one lost
// reply makes a live owner abandon its claim for > 1.5 leases.
//
// Origin: adversarial review of the issue-9 claim protocol, attack 8; failed on fa71058.
func TestRenewalThatLandedKeepsTheOwnersClaim(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var armed, fired atomic.Bool
	e.startWorkerHooked("w1", nil, nil, func(w *Worker) {
		w.runs.UseBucket(&faultyKV{KeyValue: w.runs.Bucket(), onUpdate: func(_ string, value []byte) string {
			var r v1.BuildRecord
			if armed.Load() && json.Unmarshal(value, &r) == nil && r.State == v1.StateBuilding && r.Owner == "w1" && fired.CompareAndSwap(false, true) {
				return writeLanded
			}
			return writePasses
		}})
	})
	events := e.events()
	req := request("renew-landed")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	e.waitJob(kaniko.JobName(key))
	kv, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	eventually(t, 5*time.Second, "the renewal to land with a lost reply", fired.Load)
	// A live owner renews every lease/3 (0.67 s); watch for a whole lease
	// and a half without one.
	lease := testConfig("").Lease
	var lastRev uint64
	lastChange := time.Now()
	end := time.Now().Add(2 * lease)
	for time.Now().Before(end) {
		ent, err := kv.Get(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		if ent.Revision() != lastRev {
			lastRev, lastChange = ent.Revision(), time.Now()
		}
		if gap := time.Since(lastChange); gap > lease {
			t.Fatalf("the live owner stopped renewing its claim for %s (> lease %s) after one lost renewal reply; joined its own run: %v",
				gap.Round(10*time.Millisecond), lease, events.has(req.RequestID, v1.PhaseWaiting))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// An owner that finishes after its run was canceled and the key claimed by
// a newer run must not overwrite the newer claim with its outcome.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestFinishingRunNeverOverwritesANewerClaim(t *testing.T) {
	t.Parallel()
	e := setup(t)
	release := make(chan struct{})
	var paused atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) { c.KeepJobs = true }, nil, func(w *Worker) {
		w.faults = &faultHooks{beforeFinalize: func(string) {
			if paused.CompareAndSwap(false, true) {
				<-release
			}
		}}
	})
	results := e.collect()

	r1 := request("overwrite")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r1, kanikoID)
	name := kaniko.JobName(key)
	e.kubelet(e.waitJob(name), 0, digestOf("first run"))
	eventually(t, 10*time.Second, "the owner to pause before its final write", paused.Load)
	if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), key); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	r3 := request("overwrite")
	if _, err := e.pub.Publish(context.Background(), r3); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "R3's claim", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateBuilding && rec.RequestID == r3.RequestID
	})
	close(release) // the first owner writes its outcome now
	// R3's run is still building: the stale outcome must not have ended it.
	time.Sleep(300 * time.Millisecond)
	if rec := e.claim(key); rec.State != v1.StateBuilding || rec.RequestID != r3.RequestID {
		t.Fatalf("the newer claim was overwritten: %+v", rec)
	}
	eventually(t, 10*time.Second, "R3's job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && j.Annotations[kaniko.AnnotationRequestID] == r3.RequestID
	})
	e.kubelet(e.waitJob(name), 0, digestOf("second run"))
	got := byID(results.waitFor(t, 2, 20*time.Second))
	if d := got[r3.RequestID][0].Data; d.Status != v1.StatusSucceeded || d.Digest != digestOf("second run") || d.Origin != v1.OriginBuild {
		t.Fatalf("R3 got %s", mustJSON(t, d))
	}
}

// A cancel stops a run only when it finds no other request waiting on
// it, and the waiter index is best effort: a claimer killed between its
// claim and its index entry has none. Its redelivery then finds its own
// run ended as Canceled although nobody canceled it. It builds again (a
// new run) instead of answering "canceled". The mutant
// "claimer-takes-others-cancel" broke this rule.
//
// Origin: the fault simulation, seed 77 under load: request s77-r04 was
// answered canceled by another request's cancel.
func TestClaimerNotCanceledBuildsAgainAfterAnotherRequestsCancel(t *testing.T) {
	t.Parallel()
	e := setup(t)
	b := countingBackend{runs: make(chan Build, 1)}
	w := ruleWorker(t, e, b)
	ctx := context.Background()

	req := request("claimer-of-a-canceled-run")
	const seq = 7
	key := w.builds.keyOf(req)
	repo, err := w.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	dests := naming.Destinations(repo, key, req.Tags)
	// The request's ledger entry: undecided, not canceled.
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key, State: "building",
		Seq: seq, UpdatedAt: time.Now().UTC()}
	raw, _ := json.Marshal(entry)
	if _, err := w.ledger.Bucket().Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw); err != nil {
		t.Fatal(err)
	}
	// Its run, claimed by it and ended by a cancel of another request.
	claim := w.builds.newClaim(req, key, repo, dests, seq)
	rev, ok, err := w.runs.Claim(ctx, claim)
	if err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if ok, err := w.runs.EndAt(ctx, runs.Canceled(claim, time.Now()), rev); err != nil || !ok {
		t.Fatalf("cancel the run: %v %v", ok, err)
	}

	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	done := make(chan error, 1)
	var rec *v1.BuildRecord
	go func() {
		var err error
		rec, _, _, err = w.builds.build(bctx, req, key, repo, dests, seq, nil)
		done <- err
	}()
	select {
	case bd := <-b.runs:
		if bd.Run == claim.Run {
			t.Fatalf("the canceled run %s was run again; want a new run", bd.Run)
		}
	case err := <-done:
		t.Fatalf("the claimer was answered from the run another request's cancel ended: %+v (%v)", rec, err)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("the new run, stopped: %v, want context.Canceled", err)
	}

	// Canceled itself, the claimer is answered canceled by its run.
	req2 := request("claimer-canceled-itself")
	key2 := w.builds.keyOf(req2)
	repo2, _ := w.cfg.Naming.Repository(req2)
	dests2 := naming.Destinations(repo2, key2, req2.Tags)
	entry2 := v1.RequestEntry{RequestID: req2.RequestID, Tenant: req2.Tenant, Name: req2.Name, Key: key2, State: "building",
		Seq: seq, UpdatedAt: time.Now().UTC(), Canceled: true}
	raw2, _ := json.Marshal(entry2)
	if _, err := w.ledger.Bucket().Put(ctx, RequestIndexKey(req2.Tenant, req2.RequestID), raw2); err != nil {
		t.Fatal(err)
	}
	claim2 := w.builds.newClaim(req2, key2, repo2, dests2, seq)
	rev2, ok, err := w.runs.Claim(ctx, claim2)
	if err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if ok, err := w.runs.EndAt(ctx, runs.Canceled(claim2, time.Now()), rev2); err != nil || !ok {
		t.Fatalf("cancel the run: %v %v", ok, err)
	}
	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	got, origin, _, err := w.builds.build(cctx, req2, key2, repo2, dests2, seq, nil)
	if err != nil || got == nil || got.Reason != v1.ReasonCanceled || origin != v1.OriginBuild {
		t.Fatalf("a claimer canceled itself: %+v %s %v, want its canceled run", got, origin, err)
	}
}

// A claimer whose run another request's cancel ended, and whose own
// ledger entry cannot be read at that moment, is not answered "canceled"
// on a guess: the build reports a transient error (the handler tries the
// request again) and starts nothing.
func TestClaimerOfACanceledRunWithAnUnreadableEntryTriesAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	b := countingBackend{runs: make(chan Build, 1)}
	w := ruleWorker(t, e, b)
	ctx := context.Background()

	req := request("claimer-entry-unreadable")
	const seq = 7
	key := w.builds.keyOf(req)
	repo, err := w.cfg.Naming.Repository(req)
	if err != nil {
		t.Fatal(err)
	}
	dests := naming.Destinations(repo, key, req.Tags)
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key, State: "building",
		Seq: seq, UpdatedAt: time.Now().UTC()}
	raw, _ := json.Marshal(entry)
	lk := RequestIndexKey(req.Tenant, req.RequestID)
	if _, err := w.ledger.Bucket().Put(ctx, lk, raw); err != nil {
		t.Fatal(err)
	}
	claim := w.builds.newClaim(req, key, repo, dests, seq)
	rev, ok, err := w.runs.Claim(ctx, claim)
	if err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if ok, err := w.runs.EndAt(ctx, runs.Canceled(claim, time.Now()), rev); err != nil || !ok {
		t.Fatalf("cancel the run: %v %v", ok, err)
	}
	w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onGet: func(_ context.Context, k string) error {
		if k == lk {
			return errors.New("the ledger is unreachable")
		}
		return nil
	}})

	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rec, _, _, err := w.builds.build(bctx, req, key, repo, dests, seq, nil)
	if !IsTransient(err) {
		t.Fatalf("build: %+v, %v; want a transient error, not an answer", rec, err)
	}
	select {
	case bd := <-b.runs:
		t.Fatalf("a build %s was started while the claimer's entry could not be read", bd.Run)
	default:
	}
}
