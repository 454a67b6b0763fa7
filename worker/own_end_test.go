package worker

// A handler stores its own run's end while it records its request's
// decision (own.go, endAhead): the result goes out once both are stored,
// and a run whose end could not be stored keeps its Job for whoever takes
// it over.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// endAheadWorker runs w1 whose writes of a succeeded record (a run's end)
// are lost while lose says so, and builds a request through it.
func endAheadWorker(t *testing.T, e *env, tr *testRegistry, lose func(n int64) bool) (v1.Result, string, string) {
	t.Helper()
	var tries atomic.Int64
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.runs.UseBucket(&faultyKV{KeyValue: w.runs.Bucket(), onUpdate: func(_ string, value []byte) string {
			var r v1.BuildRecord
			if json.Unmarshal(value, &r) == nil && r.State == v1.StateSucceeded && lose(tries.Add(1)) {
				return writeLost
			}
			return writePasses
		}})
	})
	results := e.collect()
	req := request("end-ahead")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if got.Data.Status != v1.StatusSucceeded || got.Data.Origin != v1.OriginBuild {
		t.Fatalf("the result %s: the decision follows from the run's outcome, its end stored or not", mustJSON(t, got))
	}
	// The result goes out first (published first); the end is stored
	// beside the decision's record, a moment after.
	eventually(t, 10*time.Second, "the run's end written", func() bool { return tries.Load() > 0 })
	return got, key, job.Name
}

// A lost write of the end is tried again: the run ends with its outcome
// and its Job is cleaned up.
func TestAnEndStoredAheadIsTriedAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	got, key, job := endAheadWorker(t, e, tr, func(n int64) bool { return n <= 2 })
	eventually(t, 10*time.Second, "the run ended with its outcome", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateSucceeded && rec.Digest == got.Data.Digest
	})
	eventually(t, 10*time.Second, "the run's Job cleaned up", e.jobGone(job))
}

// A run whose end could not be stored at all keeps its Job, and its claim
// is let go: the next request of the key takes the run over at once and
// adopts the Job's outcome.
func TestAnEndStoredAheadThatFailsLeavesTheJobForTheTakeOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var healed atomic.Bool
	got, key, job := endAheadWorker(t, e, tr, func(int64) bool { return !healed.Load() })
	eventually(t, 10*time.Second, "the claim let go", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateBuilding && rec.Owner == ""
	})
	time.Sleep(300 * time.Millisecond) // the handler's cleanup comes right after
	if _, err := e.kube.BatchV1().Jobs(testKaniko.Namespace).Get(context.Background(), job, metav1.GetOptions{}); err != nil {
		t.Fatalf("the Job of a run whose end was not stored is gone: %v", err)
	}
	if rec := e.claim(key); rec.State != v1.StateBuilding {
		t.Fatalf("the record %+v", rec)
	}
	// The store works again: the next request of the key takes the run
	// over and adopts the Job's outcome — the same image, no new Job.
	healed.Store(true)
	results := e.collect()
	next := request("end-ahead")
	if _, err := e.pub.Publish(context.Background(), next); err != nil {
		t.Fatal(err)
	}
	var second v1.Result
	eventually(t, 15*time.Second, "the next request answered", func() bool {
		r := resultFor(results, next.RequestID)
		if len(r) > 0 {
			second = r[0]
		}
		return len(r) > 0
	})
	if second.Data.Status != v1.StatusSucceeded || second.Data.Digest != got.Data.Digest {
		t.Fatalf("the next request %s, want the adopted Job's image %s", mustJSON(t, second), got.Data.Digest)
	}
	jobs, err := e.kube.BatchV1().Jobs(testKaniko.Namespace).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range jobs.Items {
		if j.Name != job {
			t.Errorf("a new Job %s was created; the run's Job was to be adopted", j.Name)
		}
	}
	eventually(t, 10*time.Second, "the run ended with its outcome", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateSucceeded && rec.Digest == got.Data.Digest
	})
}

// The run's end is stored alongside the decision, and the result waits for
// it: a client that sees the result and asks again gets a cache hit.
func TestAResultComesAfterItsRunsEnd(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorkerHooked("w1", both(withRegistry(tr), recordFirst), nil, func(w *Worker) {
		w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(), onUpdate: func(_ string, value []byte) error {
			var r v1.BuildRecord
			if json.Unmarshal(value, &r) == nil && r.State == v1.StateSucceeded {
				time.Sleep(300 * time.Millisecond) // a slow end
			}
			return nil
		}})
	})
	results := e.collect()
	req := request("end-before-result")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if rec := e.claim(key); rec == nil || rec.State != v1.StateSucceeded || rec.Digest != got.Data.Digest {
		t.Fatalf("when the result arrived the run's record was %+v: the result went out before the run's end was stored", rec)
	}
}

// A cancel by key that comes while the holder's "succeeded" is recorded
// and the run's end is still on its way finds the build ended well: it
// stops nothing, and the run ends succeeded, as its result says.
func TestACancelSparesARunWhoseHolderIsDecided(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	release := make(chan struct{})
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(), onUpdate: func(_ string, value []byte) error {
			var r v1.BuildRecord
			if json.Unmarshal(value, &r) == nil && r.State == v1.StateSucceeded {
				<-release // the run's end held back
			}
			return nil
		}})
	})
	req := request("end-ahead-cancel")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	eventually(t, 10*time.Second, "the holder's decision recorded", func() bool {
		le := e.ledgerEntry("acme", req.RequestID)
		return le != nil && le.Result != nil
	})
	if rec := e.claim(key); rec == nil || rec.State != v1.StateBuilding {
		t.Fatalf("the record %+v: its end was to be held back", rec)
	}
	rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), key)
	close(release)
	if rep.Stopped {
		t.Errorf("the cancel stopped a run whose holder was decided succeeded: %+v", rep)
	}
	eventually(t, 10*time.Second, "the run ended", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.Final()
	})
	if rec := e.claim(key); rec.State != v1.StateSucceeded {
		t.Fatalf("the run ended %s (%s) under a published success", rec.State, rec.Reason)
	}
}
