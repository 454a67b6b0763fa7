package worker

// A run's end whose write fails, or whose reply is lost, outside endAhead
// (own.go): the owner lets the claim go, a compare-and-swap at the
// revision it held, so that the request's retry takes the run over at
// once and adopts its Job, rather than waiting a lease and a half for
// the claim to lapse.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// firstRefusedEnd is a worker hook: the first write of key's end as a
// run that built nothing (TagTaken) meets fate (writeLost, writeLanded);
// tries counts those writes.
func firstRefusedEnd(key, fate string, tries *atomic.Int32) func(*Worker) {
	return func(w *Worker) {
		w.runs.UseBucket(&faultyKV{KeyValue: w.runs.Bucket(), onUpdate: func(k string, value []byte) string {
			var r v1.BuildRecord
			if k != key || json.Unmarshal(value, &r) != nil || r.Reason != v1.ReasonTagTaken {
				return writePasses
			}
			if tries.Add(1) == 1 {
				return fate
			}
			return writePasses
		}})
	}
}

// A run that built nothing (its Pod gone, podGone: an end endAhead never
// stores) whose end's first write is lost: the claim is released at
// once, the request's retry takes the run over and stores the end, and
// the request is answered once with the image at its tag. With a landed
// write whose reply was lost, the release finds the end stored and
// changes nothing, and the retry, finding its run ended so, deletes the
// run's Job before it looks again. (Mutant "failed-end-keeps-claim": no
// release, the retry waits for the claim to lapse; "refused-job-left":
// the landed end's Job waits for the janitor.)
func TestAFailedEndWriteLetsTheClaimGo(t *testing.T) {
	t.Parallel()
	for _, fate := range []string{writeLost, writeLanded} {
		t.Run(fate, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			req := request("end-write-" + fate)
			key := v1.BuildKey(req, kanikoID)
			var tries atomic.Int32
			e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
				withRegistry(tr)(c)
				// A lease the test would notice waiting out: neither the
				// retry nor the Job's delete waits for it (nor for the
				// janitor, which looks every lease).
				c.Lease = time.Minute
			}, nil, podlessWorker(300*time.Millisecond, firstRefusedEnd(key, fate, &tries)))
			results := e.collect()
			hist := watchRecords(t, e, key)
			if _, err := e.pub.Publish(context.Background(), req); err != nil {
				t.Fatal(err)
			}
			job := e.waitJob(jobOf(req))
			run := job.Annotations[kaniko.AnnotationRun]
			built, hand := e.losePod(tr, job)
			// Well within the lease (a minute) and its lapse.
			r := oneResult(t, results, req.RequestID)
			if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != hand {
				t.Fatalf("%s, want the image at its tag (%s), origin cache", mustJSON(t, r.Data), hand)
			}
			released := func() bool {
				hist.mu.Lock()
				defer hist.mu.Unlock()
				for _, rec := range hist.recs {
					if rec.Run == run && rec.State == v1.StateBuilding && rec.Owner == "" {
						return true
					}
				}
				return false
			}
			switch {
			case fate == writeLost && !released():
				t.Errorf("the claim of run %s was never let go after its end's write was lost: %+v", run, hist.recs)
			case fate == writeLanded && released():
				t.Errorf("run %s, whose end landed, was released after it: %+v", run, hist.recs)
			}
			if tries.Load() < 2 && fate == writeLost {
				t.Errorf("the end was written %d times, want it written again after the lost write", tries.Load())
			}
			eventually(t, 20*time.Second, "the Job gone", e.jobGone(job.Name))
			hist.never(t, hand, "pushed by hand over the run's tag")
			hist.never(t, built, "pushed by the podless run")
			if rec := e.claim(key); rec == nil || !rec.Final() || rec.Digest == hand {
				t.Fatalf("the key's record %+v", rec)
			}
		})
	}
}
