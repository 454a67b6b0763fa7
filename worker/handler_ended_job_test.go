package worker

// The handler that ends a run deletes the run's Job (handle.go,
// endedJobGone), whatever becomes of its own decision.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// A handler that ended its run deletes the run's Job even when its
// request was decided first by another message of the same request id (a
// parked request's requeued copy, answered from the run as it ended):
// that decision names no run to clean up. Decided by another worker and
// not published yet, the handler leaves the publish to it and looks again
// later; published already, the handler's message is settled with it.
// Either way the handler deletes the Job: it is not left for the janitor
// to come back to (nor, in the first case, for the redelivery that
// publishes the result after the other worker's grace).
//
// Origin: simulation seed 142 (late-job-cleanup): a run taken over after
// its Job had finished was ended by the taker while a requeued copy of
// the taker's own request, parked on the run, was answered first; the Job
// stayed until another worker's janitor deleted it 2 s later.
func TestAHandlerWhoseDecisionLosesStillDeletesItsRunsJob(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		published bool
	}{{"decided elsewhere, not published yet", false}, {"decided and published elsewhere", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			req := request("ended-job-" + tc.name)
			req.RequestID = "ended-job-" + map[bool]string{false: "unpublished", true: "published"}[tc.published]
			key := v1.BuildKey(req, kanikoID)
			var digest atomic.Value // the image the Job pushed
			var decided atomic.Bool
			// Another message of the request, answered from the run as it
			// ended, decided the request first: its decision is written
			// into the request's entry between the run's outcome and the
			// handler's own decision (and its result stored first when it
			// was published).
			hook := func(w *Worker) {
				w.faults = &faultHooks{beforeFinalize: func(string) {
					if decideElsewhere(t, w, req, key, digest.Load().(string), tc.published) {
						decided.Store(true)
					}
				}}
			}
			core, logs := observer.New(zapcore.InfoLevel)
			e.startWorkerHooked("w1", func(c *Config) {
				withRegistry(tr)(c)
				c.RecordFirst = true
				c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), core))
			}, nil, hook)
			results := e.collect()
			if _, err := e.pub.Publish(context.Background(), req); err != nil {
				t.Fatal(err)
			}
			job := e.waitJob(kaniko.JobName(key))
			digest.Store(tr.push(t, destination(job)))
			e.kubelet(job, 0, digest.Load().(string))
			eventually(t, 10*time.Second, "the run ended", func() bool {
				rec := e.claim(key)
				return rec != nil && rec.State == v1.StateSucceeded
			})
			if !decided.Load() {
				t.Fatal("the other message's decision was not written")
			}
			eventually(t, 10*time.Second, "the run's Job deleted", e.jobGone(job.Name))
			if n := logs.FilterMessage("janitor: deleted a Job left behind").Len(); n != 0 {
				t.Fatal("the janitor deleted the run's Job; the handler that ended the run was to")
			}
			if !tc.published {
				// The handler left the publish to w2, whose grace (two
				// leases) has not run out: the Job went before the result.
				if n := results.publishes(req.RequestID); n != 0 {
					t.Fatalf("the result was published %d times before the Job went; the Job was to go first, with the handler", n)
				}
			}
			// The request is answered, once, with the decision that stood.
			got := results.waitFor(t, 1, 20*time.Second)[0]
			if got.ID != req.RequestID || got.Data.Origin != v1.OriginInflight || got.Data.Digest != digest.Load().(string) {
				t.Fatalf("the answer %s, want the other message's decision", mustJSON(t, got))
			}
		})
	}
}

// A decision read back from the ledger names the run of whoever decided
// it, and that run's end may not be stored: its decider may have been
// killed while it stored the end beside the decision (own.go, endAhead),
// leaving the run building and its Job for the take-over to adopt. The
// redelivery that finds such a decision — left to its decider to publish
// at first, published by this worker once the grace is over — never
// deletes that Job.
//
// Origin: review of 91af552 (endedJobGone took any verdict's cleanup for
// the handler's own, and the settled path deleted a read-back decision's
// run without looking at its record).
func TestADecisionReadBackNeverDeletesTheJobOfARunWhoseEndIsNotStored(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)}) // the streams and buckets, nobody running
	req := request("read-back-decision")
	req.RequestID = "read-back-decision"
	key := v1.BuildKey(req, kanikoID)
	const run = "run-of-a-killed-decider"
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	msgs := e.streamMsgs(v1.RequestsStream)
	if len(msgs) != 1 {
		t.Fatalf("%d request messages, want 1", len(msgs))
	}
	msg := msgs[0]
	// The decider's run: building, its lease long, its Job finished.
	now := time.Now().UTC()
	rec := v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: run, Owner: "w2", LeaseMs: time.Hour.Milliseconds(), LeaseUntil: now.Add(time.Hour),
		RequestID: req.RequestID, Seq: msg.Sequence, Tenant: req.Tenant, Name: req.Name, StartedAt: now}
	raw, _ := json.Marshal(rec)
	builds, err := e.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := builds.Put(ctx, key, raw); err != nil {
		t.Fatal(err)
	}
	job, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Run: run, Destinations: []string{"registry.test:5000/acme/web:" + key[:12]}}, testKaniko.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Its decision, recorded and not published: it names the run.
	entry := v1.RequestEntry{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key, State: string(v1.StatusSucceeded),
		Seq: msg.Sequence, MsgTime: msg.Time.UTC(), Worker: "w2", UpdatedAt: now, CleanupKey: key, CleanupRun: run,
		Result: &v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key, Status: v1.StatusSucceeded,
			Origin: v1.OriginBuild, Digest: digestOf("read-back-decision")}}
	raw, _ = json.Marshal(entry)
	ledgerKV, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ledgerKV.Put(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw); err != nil {
		t.Fatal(err)
	}

	core, logs := observer.New(zapcore.InfoLevel)
	e.startWorkerHooked("w1", func(c *Config) { c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), core)) }, nil, nil)
	results := e.collect()
	jobStays := func(when string) {
		t.Helper()
		time.Sleep(500 * time.Millisecond) // the action's After runs right after its message is settled
		if e.jobGone(job.Name)() {
			t.Fatalf("%s: the Job of a run whose end is not stored was deleted", when)
		}
	}
	eventually(t, 10*time.Second, "the decider's decision left to it", func() bool {
		return logs.FilterMessage("the request's result was decided by another worker and is not marked published yet; looking again later").Len() > 0
	})
	jobStays("left to its decider")
	// Past the grace (two leases) w1 publishes the decision itself.
	got := results.waitFor(t, 1, 20*time.Second)[0]
	if got.Data.Digest != entry.Result.Digest {
		t.Fatalf("the answer %s, want the recorded decision", mustJSON(t, got))
	}
	eventually(t, 10*time.Second, "the request settled", func() bool { return logs.FilterMessage("request done").Len() > 0 })
	jobStays("published by the redelivery")
	if r := e.claim(key); r == nil || r.Run != run || r.State != v1.StateBuilding {
		t.Fatalf("the run's record %+v, want it untouched", r)
	}
}

// decideElsewhere writes into req's ledger entry the decision another
// message of the request made first, as worker w2 would (succeeded from
// key's run with digest, origin inflight), publishing its result first
// when published. It reports whether the decision was written.
func decideElsewhere(t *testing.T, w *Worker, req *v1.Request, key, digest string, published bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	le, err := w.ledger.Get(ctx, req.Tenant, req.RequestID)
	if err != nil || le == nil {
		t.Errorf("read the request's entry: %v (%v)", le, err)
		return false
	}
	d := ledger.Decision{Tenant: req.Tenant, Name: req.Name, Data: v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name,
		Key: key, Status: v1.StatusSucceeded, Origin: v1.OriginInflight, Digest: digest,
		Timings: v1.Timings{FinishedAt: time.Now().UTC()}}}
	if published {
		if _, err := w.publish(ctx, d); err != nil {
			t.Errorf("publish the other message's result: %v", err)
			return false
		}
	}
	e2 := le.E
	r := d.Data
	e2.Result, e2.State, e2.Origin, e2.Digest = &r, string(r.Status), r.Origin, r.Digest
	e2.Published, e2.Worker, e2.UpdatedAt = published, "w2", time.Now().UTC()
	raw, _ := json.Marshal(e2)
	if _, err := w.ledger.Bucket().Update(ctx, RequestIndexKey(req.Tenant, req.RequestID), raw, le.Rev); err != nil {
		t.Errorf("write the other message's decision: %v", err)
		return false
	}
	return true
}
