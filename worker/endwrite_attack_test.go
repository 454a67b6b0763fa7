package worker

// Attacks on commit 68f7298: an end write outside endAhead that fails (or
// lands with its reply lost) lets the claim go at once; a claimer that
// finds its own run ended TagTaken deletes that run's Job from the
// informer cache (refusedJobGone). Each test checks that every request is
// answered exactly once, that no Job of a live run is deleted, and that
// the key's record never names an image buildq did not build.

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// attackKV wraps a bucket's Update and Get with hooks that can act before
// or after the real call.
type attackKV struct {
	jetstream.KeyValue
	update func(key string, value []byte, next func() (uint64, error)) (uint64, error)
	get    func(key string, next func() (jetstream.KeyValueEntry, error)) (jetstream.KeyValueEntry, error)
}

func (a *attackKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	next := func() (uint64, error) { return a.KeyValue.Update(ctx, key, value, rev) }
	if a.update == nil {
		return next()
	}
	return a.update(key, value, next)
}

func (a *attackKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	next := func() (jetstream.KeyValueEntry, error) { return a.KeyValue.Get(ctx, key) }
	if a.get == nil {
		return next()
	}
	return a.get(key, next)
}

// cancelAsync asks the tenant API to cancel request id and waits up to
// wait for the reply (a cancel that waits for the handler, blocked in a
// hook, must not deadlock the test).
func cancelAsync(e *env, tenant, id string, wait time.Duration, got *atomic.Pointer[v1.CancelReply]) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		subj := v1.APICancelSubject(tenant)
		m, err := tenantAPIRequest(e.nc, subjectTenant(subj), subj, id, 10*time.Second)
		if err != nil {
			return
		}
		var rep v1.CancelReply
		if json.Unmarshal(m.Data, &rep) == nil {
			got.Store(&rep)
		}
	}()
	select {
	case <-done:
	case <-time.After(wait):
	}
}

// Attack 1: the podless run's end (TagTaken) is lost while the tenant
// cancels the request — the cancel sent in the middle of the lost write
// (before the release), or right after the release lands. The request is
// answered exactly once (canceled when the cancel said so), the Job goes,
// and no record stays building or names the hand-pushed image.
func TestEndWriteAttackCancelRacesLostEnd(t *testing.T) {
	t.Parallel()
	for _, when := range []string{"during-lost-end", "after-release"} {
		t.Run(when, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			req := request("end-write-attack-cancel-" + when)
			key := v1.BuildKey(req, kanikoID)
			var lost, canceled atomic.Bool
			var rep atomic.Pointer[v1.CancelReply]
			e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
				withRegistry(tr)(c)
				c.Lease = time.Minute
			}, nil, podlessWorker(300*time.Millisecond, func(w *Worker) {
				w.runs.UseBucket(&attackKV{KeyValue: w.runs.Bucket(), update: func(k string, value []byte, next func() (uint64, error)) (uint64, error) {
					var r v1.BuildRecord
					if k != key || json.Unmarshal(value, &r) != nil {
						return next()
					}
					if r.Reason == v1.ReasonTagTaken && lost.CompareAndSwap(false, true) {
						if when == "during-lost-end" && canceled.CompareAndSwap(false, true) {
							cancelAsync(e, req.Tenant, req.RequestID, 3*time.Second, &rep)
						}
						return 0, context.DeadlineExceeded // lost
					}
					if lost.Load() && r.State == v1.StateBuilding && r.Owner == "" && when == "after-release" && canceled.CompareAndSwap(false, true) {
						nrev, err := next()
						cancelAsync(e, req.Tenant, req.RequestID, 3*time.Second, &rep)
						return nrev, err
					}
					return next()
				}})
			}))
			results := e.collect()
			_, hist, job := publishWatched(t, e, req)
			_, hand := e.losePod(tr, job)
			eventually(t, 30*time.Second, "the request answered", func() bool { return len(resultFor(results, req.RequestID)) > 0 })
			time.Sleep(2 * time.Second) // a second answer, if any
			r := oneResult(t, results, req.RequestID)
			if !lost.Load() {
				t.Fatal("the run's end was never written")
			}
			cr := rep.Load()
			t.Logf("cancel fired=%v reply=%+v result=%s", canceled.Load(), cr, mustJSON(t, r.Data))
			if cr != nil && cr.Canceled && r.Data.Status != v1.StatusCanceled {
				t.Errorf("the cancel said canceled (%+v) but the request was answered %s", cr, mustJSON(t, r.Data))
			}
			if r.Data.Status == v1.StatusSucceeded && r.Data.Digest != hand {
				t.Errorf("succeeded with %s, want the image at its tag %s", r.Data.Digest, hand)
			}
			eventually(t, 20*time.Second, "the Job gone", e.jobGone(job.Name))
			hist.never(t, hand, "pushed by hand over the run's tag")
			eventually(t, 10*time.Second, "the key's record final", func() bool {
				rec := e.claim(key)
				return rec == nil || rec.Final()
			})
		})
	}
}

// Attack 2: the end's write is lost (or lands with its reply lost) while
// a second request of the key waits on the run on another worker: after
// the release, either request may take the run over. Both are answered
// exactly once with the image at their tag, the Job goes, and no record
// names the hand-pushed image or stays building.
func TestEndWriteAttackTakeOverByAnotherWorker(t *testing.T) {
	t.Parallel()
	for _, fate := range []string{writeLost, writeLanded} {
		t.Run(fate, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			req := request("end-write-attack-takeover-" + fate)
			key := v1.BuildKey(req, kanikoID)
			var tries atomic.Int32
			hook := podlessWorker(300*time.Millisecond, firstRefusedEnd(key, fate, &tries))
			mut := func(c *Config) { withRegistry(tr)(c); c.Lease = time.Minute }
			e.startWorkerFull("w1", fetchKaniko(), mut, nil, hook)
			results := e.collect()
			_, hist, job := publishWatched(t, e, req)
			e.startWorkerFull("w2", fetchKaniko(), mut, nil, hook)
			second := request("end-write-attack-takeover-" + fate)
			second.RequestID = "second-" + fate
			if _, err := e.pub.Publish(context.Background(), second); err != nil {
				t.Fatal(err)
			}
			time.Sleep(500 * time.Millisecond) // the second waits on the run
			_, hand := e.losePod(tr, job)
			for _, id := range []string{req.RequestID, second.RequestID} {
				eventually(t, 30*time.Second, "the answer of "+id, func() bool { return len(resultFor(results, id)) > 0 })
			}
			time.Sleep(2 * time.Second)
			for _, id := range []string{req.RequestID, second.RequestID} {
				r := oneResult(t, results, id)
				if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != hand {
					t.Errorf("%s answered %s, want the image at its tag %s", id, mustJSON(t, r.Data), hand)
				}
			}
			eventually(t, 20*time.Second, "the Job gone", e.jobGone(job.Name))
			hist.never(t, hand, "pushed by hand over the run's tag")
			if rec := e.claim(key); rec == nil || !rec.Final() {
				t.Fatalf("the key's record %+v", rec)
			}
		})
	}
}

// Attack 3: refusedJobGone with a stale record. The claimer's end lands
// with its reply lost (TagTaken stored); its retry's read of the record
// is held (a slow reply) while a second request of the same key — another
// repository, so its tag is free — finds the run refused, looks again and
// claims a new run whose Job has the same name. Then the held read
// returns the old TagTaken record: the claimer's refusedJobGone must not
// delete the new run's Job. The new run builds, both requests are
// answered once.
func TestEndWriteAttackRefusedJobGoneSparesANewerRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("end-write-attack-stale")
	key := v1.BuildKey(req, kanikoID)
	var tries atomic.Int32
	var armed atomic.Bool
	blocked := make(chan struct{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	hook := podlessWorker(300*time.Millisecond, func(w *Worker) {
		w.runs.UseBucket(&attackKV{KeyValue: w.runs.Bucket(),
			update: func(k string, value []byte, next func() (uint64, error)) (uint64, error) {
				var r v1.BuildRecord
				if k == key && json.Unmarshal(value, &r) == nil && r.Reason == v1.ReasonTagTaken && tries.Add(1) == 1 {
					nrev, err := next()
					if err != nil {
						return nrev, err
					}
					armed.Store(true)
					return 0, context.DeadlineExceeded // landed, reply lost
				}
				return next()
			},
			get: func(k string, next func() (jetstream.KeyValueEntry, error)) (jetstream.KeyValueEntry, error) {
				ent, err := next()
				if err != nil || k != key || ent == nil {
					return ent, err
				}
				var r v1.BuildRecord
				if json.Unmarshal(ent.Value(), &r) == nil && r.Reason == v1.ReasonTagTaken && r.RequestID == req.RequestID && armed.CompareAndSwap(true, false) {
					close(blocked)
					select {
					case <-release:
					case <-time.After(30 * time.Second):
					}
				}
				return ent, err
			}})
	})
	mut := func(c *Config) { withRegistry(tr)(c); c.Lease = time.Minute }
	e.startWorkerFull("w1", fetchKaniko(), mut, nil, hook)
	e.startWorkerFull("w2", fetchKaniko(), mut, nil, hook)
	results := e.collect()
	_, hist, job := publishWatched(t, e, req)
	_, hand := e.losePod(tr, job)
	select {
	case <-blocked:
	case <-time.After(30 * time.Second):
		t.Fatal("no read of the refused run's record by its claimer was ever held")
	}
	// A second request of the key to another repository: its tag is free.
	second := request("end-write-attack-stale")
	second.RequestID = "stale-second"
	second.Name = "api"
	if v1.BuildKey(second, kanikoID) != key {
		t.Fatal("the second request has another key")
	}
	if _, err := e.pub.Publish(context.Background(), second); err != nil {
		t.Fatal(err)
	}
	// The new run's Job (same name, another run).
	fresh := e.jobInPlaceOf(job, "the new run's Job")
	// Let the claimer's held read return the old TagTaken record.
	releaseOnce.Do(func() { close(release) })
	time.Sleep(1500 * time.Millisecond)
	if j, ok := e.jobs()[fresh.Name]; !ok || j.UID != fresh.UID || j.DeletionTimestamp != nil {
		t.Fatalf("the new run's Job %s (run %s) was deleted under it after the claimer read its old run's end", fresh.Name, fresh.Annotations[kaniko.AnnotationRun])
	}
	built := tr.push(t, destination(fresh))
	e.kubelet(fresh, 0, built)
	for _, id := range []string{req.RequestID, second.RequestID} {
		eventually(t, 30*time.Second, "the answer of "+id, func() bool { return len(resultFor(results, id)) > 0 })
	}
	time.Sleep(2 * time.Second)
	r1 := oneResult(t, results, req.RequestID)
	r2 := oneResult(t, results, second.RequestID)
	t.Logf("claimer: %s; second: %s", mustJSON(t, r1.Data), mustJSON(t, r2.Data))
	if r1.Data.Status != v1.StatusSucceeded || r2.Data.Status != v1.StatusSucceeded {
		t.Errorf("want both succeeded: %s / %s", mustJSON(t, r1.Data), mustJSON(t, r2.Data))
	}
	if r2.Data.Digest != built {
		t.Errorf("the second answered %s, want the new run's build %s", r2.Data.Digest, built)
	}
	hist.never(t, hand, "pushed by hand over the run's tag")
	eventually(t, 20*time.Second, "the Job gone", e.jobGone(fresh.Name))
}
