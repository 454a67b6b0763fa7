package worker

// Who deletes a run's Job once the run ended, when storing the end is
// slow (endedjob.go, handle.go). From a hostile review of 2fbbb42..9e357ec.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	batchv1client "k8s.io/client-go/kubernetes/typed/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// A handler ends its run with the end stored ahead (own.go, endAhead),
// and another message of the same request decided it first on another
// worker, not published yet: the handler's action is Later. The run's
// end takes longer than endedJobWait to store — its first writes fail (a
// NATS hiccup; with the default 30 s lease the first retry alone comes
// 3.75 s later) — so the Later's After gave up on the Job after
// endedJobWait, and the redelivery reads the other message's decision back
// from the ledger, which names no run: nobody but the janitor deleted the
// Job. The wait now goes on in the background past endedJobWait.
func TestALaterWhoseRunsEndIsSlowStillDeletesTheJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("attack-ended-job-later-slow-end")
	req.RequestID = "attack-ended-job-later-slow-end"
	key := v1.BuildKey(req, kanikoID)
	var digest atomic.Value
	var decided atomic.Bool
	var endFails atomic.Int32
	var endStoredAt atomic.Value // time.Time
	hook := func(w *Worker) {
		w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(), onUpdate: func(k string, value []byte) error {
			var r v1.BuildRecord
			if k != key || json.Unmarshal(value, &r) != nil || !r.Final() {
				return nil //nolint:nilerr // not the run's end: written as it is
			}
			if endFails.Add(1) <= 3 {
				return nats.ErrTimeout // the run's end: its first three writes fail
			}
			endStoredAt.Store(time.Now())
			return nil
		}})
		w.faults = &faultHooks{beforeFinalize: func(string) {
			if decideElsewhere(t, w, req, key, digest.Load().(string), false) {
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
	eventually(t, 10*time.Second, "the run's end stored", func() bool {
		rec := e.claim(key)
		return rec != nil && rec.State == v1.StateSucceeded
	})
	if !decided.Load() {
		t.Fatal("the other message's decision was not written")
	}
	if logs.FilterMessage("the request's result was decided by another worker and is not marked published yet; looking again later").Len() == 0 {
		t.Fatal("the handler's action was not Later")
	}
	// The request is answered once, with the other message's decision,
	// past the grace (two leases); the Job was to go long before.
	results.waitFor(t, 1, 20*time.Second)
	eventually(t, 10*time.Second, "the run's Job deleted", e.jobGone(job.Name))
	if n := logs.FilterMessage("janitor: deleted a Job left behind").Len(); n != 0 {
		stored, _ := endStoredAt.Load().(time.Time)
		t.Fatalf("the janitor deleted the Job of a run whose end was stored at %s; the handler that ended the run was to delete it", stored.Format("15:04:05.000"))
	}
}

// A handler ends its run with the end stored ahead and its decision names
// that run, so endedJobGone leaves the deletion to the Settle's own After
// (cleansOwn). That After deleted with actx, the context made (15 s) as
// the handler's decide began, before the end was stored — not a context
// of its own as endedJobGone's deletion has. With the default 30 s lease,
// an end whose first write times out (5 s, boundedKV) and whose retry
// 3.75 s later is slow too is stored some 13.6 s in; the publish, which
// waits for the end, and the mark (slow as well: the same NATS trouble)
// bring the After past actx's deadline, and the deletion failed at once:
// the Job was left for the janitor (a lease later, or two). The cleanup
// now has a context of its own.
func TestAnOwnCleanupAfterASlowEndHasTimeOfItsOwn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("attack-ended-job-slow-end-actx")
	req.RequestID = "attack-ended-job-slow-end-actx"
	key := v1.BuildKey(req, kanikoID)
	var endTries atomic.Int32
	var endStoredAt atomic.Value // time.Time
	sleep := func(ctx context.Context, d time.Duration) {
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
	}
	hook := func(w *Worker) {
		inner := w.runs.Bucket()
		w.runs.UseBucket(&slowKV{KeyValue: inner, update: func(ctx context.Context, k string, value []byte) error {
			var r v1.BuildRecord
			if k != key || json.Unmarshal(value, &r) != nil || !r.Final() {
				return nil //nolint:nilerr // not the run's end: written as it is
			}
			// Each request is bounded at 5 s in production (boundedKV).
			sleep(ctx, 4900*time.Millisecond)
			if endTries.Add(1) == 1 {
				return nats.ErrTimeout // the first write of the end: lost
			}
			endStoredAt.Store(time.Now())
			return nil
		}})
		linner := w.ledger.Bucket()
		w.ledger.UseBucket(&slowKV{KeyValue: linner, update: func(ctx context.Context, k string, value []byte) error {
			var le v1.RequestEntry
			if k != RequestIndexKey(req.Tenant, req.RequestID) || json.Unmarshal(value, &le) != nil || !le.Published {
				return nil //nolint:nilerr // not the request's mark: written as it is
			}
			sleep(ctx, 2*time.Second) // the mark: slow as well
			return nil
		}})
	}
	core, logs := observer.New(zapcore.InfoLevel)
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.RecordFirst = true
		c.Lease = 30 * time.Second
		c.IndexTTL = 0
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), core))
	}, ctxKube{e.kube}, hook)
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	digest := tr.push(t, destination(job))
	e.kubelet(job, 0, digest)
	got := results.waitFor(t, 1, 40*time.Second)[0]
	if got.Data.Digest != digest {
		t.Fatalf("the answer %s, want the build's", mustJSON(t, got))
	}
	if rec := e.claim(key); rec == nil || rec.State != v1.StateSucceeded {
		t.Fatalf("the run's record %+v, want its end stored", rec)
	}
	stored, _ := endStoredAt.Load().(time.Time)
	eventually(t, 10*time.Second, "the request settled", func() bool { return logs.FilterMessage("request done").Len() > 0 })
	deadline := time.Now().Add(5 * time.Second)
	for !e.jobGone(job.Name)() {
		if time.Now().After(deadline) {
			var why []string
			for _, l := range logs.FilterMessage("cleanup failed; ttlSecondsAfterFinished will remove the job").All() {
				for _, f := range l.Context {
					if f.Key == "error" {
						why = append(why, f.Interface.(error).Error())
					}
				}
			}
			t.Fatalf("the Job of a run whose end was stored at %s (handled by this worker) is still there 5 s after its request settled; the handler's cleanup failed: %v",
				stored.Format("15:04:05.000"), why)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// slowKV delays (or fails) one bucket's updates, respecting the caller's
// context as a request on the wire would.
type slowKV struct {
	jetstream.KeyValue
	update func(ctx context.Context, key string, value []byte) error
}

func (k *slowKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if err := k.update(ctx, key, value); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	return k.KeyValue.Update(ctx, key, value, rev)
}

// ctxKube is the fake cluster's client whose Job deletes honor their
// context, as client-go's HTTP requests do: one made on an expired
// context fails at once.
type ctxKube struct{ kubernetes.Interface }

func (c ctxKube) BatchV1() batchv1client.BatchV1Interface { return ctxBatch{c.Interface.BatchV1()} }

type ctxBatch struct{ batchv1client.BatchV1Interface }

func (b ctxBatch) Jobs(ns string) batchv1client.JobInterface {
	return ctxJobs{b.BatchV1Interface.Jobs(ns)}
}

type ctxJobs struct{ batchv1client.JobInterface }

func (j ctxJobs) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return j.JobInterface.Delete(ctx, name, opts)
}
