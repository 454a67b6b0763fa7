package worker

// Intake's looks served from the records' watch (intakehold.go,
// watchedRecord): a key whose record the watch showed is looked at
// without a read, and only while the watch that showed it runs.

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// A cache hit on a record the watch showed is answered at intake with no
// read of the record, and answered right: from the cache, with the
// build's image.
func TestAHitOnAWatchedRecordIsAnsweredAtIntakeWithoutARead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", patientLookups(func(c *Config) {
		withRegistry(tr)(c)
		c.HoldAtIntake = 2 * time.Minute
	}))
	results := e.collect()
	first := request("watched-hit")
	e.publishOrFail(t, first)
	job := e.waitJob(e.jobOf(first))
	e.succeed(t, tr, job)
	built := results.waitFor(t, 1, 10*time.Second)[0]
	if built.Data.Status != v1.StatusSucceeded || built.Data.Digest == "" {
		t.Fatalf("the build's result: %s", mustJSON(t, built))
	}
	// The build's handler is done with its record once its Job is gone
	// (its result goes out first): only the hit's reads are counted.
	eventually(t, 10*time.Second, "the build's Job deleted", e.jobGone(job.Name))
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
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 7, op: jetstream.KeyValuePut}, true)
	got, rev, ok := r.watchedRecord("k1")
	if !ok || rev != 7 || got.State != v1.StateSucceeded {
		t.Fatalf("watchedRecord = %+v, %d, %v; want the succeeded record at 7", got, rev, ok)
	}
	r.updatedKey(watchEntry{key: "k2", rev: 8, op: jetstream.KeyValueDelete}, true)
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
	// A read's record (a held key read again) is not the watch's: it
	// may be older than what the watch shows next.
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 9, op: jetstream.KeyValuePut}, false)
	if _, _, ok := r.watchedRecord("k1"); ok {
		t.Error("a record read, not watched, is served to intake's looks")
	}
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 10, op: jetstream.KeyValuePut}, true)
	if _, rev, ok := r.watchedRecord("k1"); !ok || rev != 10 {
		t.Errorf("after the new watch showed it: %d, %v; want the record at 10", rev, ok)
	}
}

// The records kept are bounded: past maxWatchedRecords only revisions
// are kept, however often each key changes.
func TestWatchedRecordsAreBounded(t *testing.T) {
	r := newIntakeRoom(&Worker{})
	r.mu.Lock()
	r.open = true
	r.mu.Unlock()
	rec := []byte(`{"state":"building"}`)
	n := maxWatchedRecords + 1000
	for rev := range 2 {
		for i := range n {
			r.updatedKey(watchEntry{key: fmt.Sprintf("k%d", i), val: rec, rev: uint64(1 + rev), op: jetstream.KeyValuePut}, true)
		}
	}
	r.mu.Lock()
	vals := 0
	for _, sr := range r.seen {
		if sr.val != nil {
			vals++
		}
	}
	kept, seen := r.kept, len(r.seen)
	r.mu.Unlock()
	if vals > maxWatchedRecords || kept != vals {
		t.Fatalf("%d records kept (counted %d) after two updates of %d keys; want at most %d", vals, kept, n, maxWatchedRecords)
	}
	if seen != n {
		t.Fatalf("%d revisions kept, want every key's (%d)", seen, n)
	}
}

// A connection that broke may have missed changes the watch shows late:
// the records kept before are not served after it.
func TestWatchedRecordsAreForgottenWhenTheConnectionBreaks(t *testing.T) {
	srv := testnats.Start(t, testnats.Config{NoJetStream: true})
	nc := srv.Connect(t, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	r := newIntakeRoom(&Worker{nc: nc})
	r.mu.Lock()
	r.watchStarted()
	r.open = true
	r.mu.Unlock()
	rec := []byte(`{"state":"succeeded"}`)
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 3, op: jetstream.KeyValuePut}, true)
	if _, _, ok := r.watchedRecord("k1"); !ok {
		t.Fatal("the watched record is not served")
	}
	srv.Stop()
	eventually(t, 10*time.Second, "the connection down", func() bool { return !nc.IsConnected() })
	// An update the watch had received before the break, handled while
	// the connection is down: as old as the outage, it is not kept.
	r.updatedKey(watchEntry{key: "k2", val: rec, rev: 4, op: jetstream.KeyValuePut}, true)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the connection back", func() bool { return nc.IsConnected() && nc.Stats().Reconnects > 0 })
	for _, k := range []string{"k1", "k2"} {
		if _, _, ok := r.watchedRecord(k); ok {
			t.Fatalf("%s: a record kept before the connection broke, or while it was down, is served after it", k)
		}
	}
	r.updatedKey(watchEntry{key: "k1", val: rec, rev: 5, op: jetstream.KeyValuePut}, true)
	if _, rev, ok := r.watchedRecord("k1"); !ok || rev != 5 {
		t.Fatalf("a record the watch showed after the reconnect: %d, %v; want it served", rev, ok)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.kept != 1 {
		t.Fatalf("%d records counted kept, want 1", r.kept)
	}
}
