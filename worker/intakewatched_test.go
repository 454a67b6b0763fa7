package worker

// Intake's looks served from the records' watch (intakehold.go,
// watchedRecord): a key whose record the watch showed is looked at
// without a read, and only while the watch that showed it runs.

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// A cache hit on a record the watch showed is answered at intake with no
// read of the record, and answered right: from the cache, with the
// build's image.
func TestAHitOnAWatchedRecordIsAnsweredAtIntakeWithoutARead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.HoldAtIntake = 2 * time.Minute
	})
	results := e.collect()
	first := request("watched-hit")
	e.publishOrFail(t, first)
	e.succeed(t, tr, e.waitJob(e.jobOf(first)))
	built := results.waitFor(t, 1, 10*time.Second)[0]
	if built.Data.Status != v1.StatusSucceeded || built.Data.Digest == "" {
		t.Fatalf("the build's result: %s", mustJSON(t, built))
	}
	key := v1.BuildKey(first, "kaniko@"+testKaniko.ExecutorImage)
	eventually(t, 5*time.Second, "the watch showing the succeeded record", func() bool {
		rec, _, ok := w1.w.room.watchedRecord(key)
		return ok && rec.State == v1.StateSucceeded
	})

	var reads atomic.Int64
	w1.w.runs.UseBucket(&hookedKV{KeyValue: w1.w.runs.Bucket(), onGet: func(_ context.Context, k string) error {
		if k == key {
			reads.Add(1)
		}
		return nil
	}})
	mark := e.markIntake(t, w1)
	hit := request("watched-hit")
	e.publishOrFail(t, hit)
	eventually(t, 10*time.Second, "the hit answered", func() bool { _, ok := resultOf(results, hit.RequestID); return ok })
	r, _ := resultOf(results, hit.RequestID)
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != built.Data.Digest {
		t.Fatalf("the hit's result %s: want succeeded from the cache with %s", mustJSON(t, r), built.Data.Digest)
	}
	if n := mark.handedOn(t); n != 0 {
		t.Errorf("%d requests handed on; want the hit answered at intake", n)
	}
	if n := reads.Load(); n != 0 {
		t.Errorf("the key's record was read %d times; want none: the watch showed it", n)
	}
}

// watchEntry is a record's update as a watch shows it.
type watchEntry struct {
	key string
	val []byte
	rev uint64
	op  jetstream.KeyValueOp
}

func (e watchEntry) Bucket() string                  { return v1.BuildsBucket }
func (e watchEntry) Key() string                     { return e.key }
func (e watchEntry) Value() []byte                   { return e.val }
func (e watchEntry) Revision() uint64                { return e.rev }
func (e watchEntry) Created() time.Time              { return time.Now() }
func (e watchEntry) Delta() uint64                   { return 0 }
func (e watchEntry) Operation() jetstream.KeyValueOp { return e.op }

// What a watch showed stands only while it runs: one (re)started shows
// only later changes, so the records kept before it are forgotten (their
// revisions stay, for the hold's check of looks behind them), and none is
// served while no watch runs. A delete keeps no record.
func TestWatchedRecordsStandOnlyWhileTheWatchThatShowedThemRuns(t *testing.T) {
	r := newIntakeRoom(&Worker{})
	rec := []byte(`{"key":"k1","state":"succeeded","digest":"sha256:` + strings.Repeat("a", 64) + `"}`)
	r.mu.Lock()
	r.open = true
	r.mu.Unlock()
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 7, op: jetstream.KeyValuePut})
	got, rev, ok := r.watchedRecord("k1")
	if !ok || rev != 7 || got.State != v1.StateSucceeded {
		t.Fatalf("watchedRecord = %+v, %d, %v; want the succeeded record at 7", got, rev, ok)
	}
	r.updatedKey(watchEntry{key: "k2", rev: 8, op: jetstream.KeyValueDelete})
	if _, _, ok := r.watchedRecord("k2"); ok {
		t.Error("a deleted record is served; want a read")
	}

	r.mu.Lock()
	r.open = false
	r.mu.Unlock()
	if _, _, ok := r.watchedRecord("k1"); ok {
		t.Error("a record is served while no watch runs")
	}
	r.mu.Lock()
	r.watchStarted()
	r.open = true
	sr := r.seen["k1"]
	r.mu.Unlock()
	if _, _, ok := r.watchedRecord("k1"); ok {
		t.Error("a record the last watch showed is served by the next one; want it forgotten")
	}
	if sr.rev != 7 {
		t.Errorf("the revision the last watch showed is %d after a restart, want 7 kept", sr.rev)
	}
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 9, op: jetstream.KeyValuePut})
	if _, rev, ok := r.watchedRecord("k1"); !ok || rev != 9 {
		t.Errorf("after the new watch showed it: %d, %v; want the record at 9", rev, ok)
	}
}
