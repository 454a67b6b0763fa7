package tenantapi

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/runs"
)

// onGetKV is a build-records bucket that runs before, once, ahead of the
// n-th read of a key.
type onGetKV struct {
	jetstream.KeyValue
	n      int32
	reads  atomic.Int32
	before func()
}

func (k *onGetKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.reads.Add(1) == k.n {
		k.before()
	}
	return k.KeyValue.Get(ctx, key)
}

// Found by the fault simulation (frozen scenario concurrency-limit-173,
// one run in four): a canceled image index's handler stops its
// platforms' builds that nobody else waits on. It counted the waiters of
// a platform's run; that run ended (the cancel's own stop), a request of
// the same tenant that waited on it looked again and claimed the key;
// then the stop ended the key's current run — the new one, under the
// request that ran it, which was answered Canceled without any cancel of
// it. Only the run whose waiters were counted may be stopped.
func TestAStopOfAnUnwaitedBuildSparesARunBegunAfterItsWaitersWereCounted(t *testing.T) {
	key := strings.Repeat("a", 64)
	platformRun := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-of-the-index", Owner: "w1",
		Tenant: "acme", Name: "api", RequestID: "index", Holder: ledger.Key("acme", "index")}
	newRun := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-of-the-joiner", Owner: "w2",
		Tenant: "acme", Name: "api", RequestID: "joiner", Holder: ledger.Key("acme", "joiner")}
	// The waiters are counted on the first read of the record; before the
	// stop's read, the counted run is over and the joiner's has begun.
	w := newStopWorld(t, 2, func(w *stopWorld) { w.put(t, newRun) })
	ctx := t.Context()
	w.put(t, platformRun)

	stopped, err := w.svc.StopUnwaited(ctx, "acme", "index", key)
	if err != nil {
		t.Fatal(err)
	}
	if w.kv.reads.Load() < 2 {
		t.Fatalf("premise: the record was read %d time(s), want the count's read and the stop's", w.kv.reads.Load())
	}
	cur, _, err := w.rs.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if stopped || w.jobs.Load() != 0 || cur.Run != newRun.Run || cur.State != v1.StateBuilding {
		t.Fatalf("stopped %v, Jobs stopped %d, record %s %s (%s); want the joiner's run building, untouched",
			stopped, w.jobs.Load(), cur.Run, cur.State, cur.Reason)
	}
}

// A take-over keeps the run's id and names its taker the holder
// (worker/build.go, takeOver). A canceled index's platform run, let go by
// its stopping worker, is counted with no waiter; before the stop,
// another tenant's request of the same content indexes itself as a
// waiter and takes the run over. The stop must spare it: its holder is a
// request nobody counted (found by an attack on the run check).
func TestAStopSparesARunTakenOverAfterItsWaitersWereCounted(t *testing.T) {
	key := strings.Repeat("b", 64)
	// The index's platform run, released by its owner (the worker stopped).
	released := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-of-the-platform", Owner: "",
		Tenant: "acme", Name: "api", RequestID: "index", Holder: ledger.Key("acme", "index")}
	// globex's request of the same content: waits on the key, then takes
	// the released run over — same run id, its own Holder and Owner.
	taken := *released
	taken.Owner, taken.Holder = "w2", ledger.Key("globex", "joiner")
	w := newStopWorld(t, 2, func(w *stopWorld) {
		w.l.AddWaiter(context.Background(), key, "globex", "joiner")
		w.put(t, &taken)
	})
	ctx := t.Context()
	w.put(t, released)
	if _, _, err := w.l.Open(ctx, "globex", "web", "joiner", key, 7, time.Now()); err != nil {
		t.Fatal(err)
	}

	// The canceled index's handler stops its platform's build nobody else
	// waits on (worker/platforms.go).
	stopped, err := w.svc.StopUnwaited(ctx, "acme", "index", key)
	if err != nil {
		t.Fatal(err)
	}
	if w.kv.reads.Load() < 2 {
		t.Fatalf("premise: the record was read %d time(s)", w.kv.reads.Load())
	}
	ws, _ := w.l.Waiters(ctx, key)
	cur, _, _ := w.rs.Get(ctx, key)
	if stopped || w.jobs.Load() != 0 || cur.State != v1.StateBuilding {
		t.Errorf("acme's stop ended a run held by globex's request (taken over after the count; waiters now: %d): stopped %v, Jobs stopped %d, record %s %s (%s) holder %s",
			len(ws), stopped, w.jobs.Load(), cur.Run, cur.State, cur.Reason, cur.Holder)
	}
}

// Cancel by build key: acme's A holds the run, acme's B waits on it. Both
// are canceled and counted, and nobody else waits. Before the stop reads
// the record again, A's handler let its claim go and B's handler, not yet
// told of its own cancel, took the run over (same run, holder B). B was
// counted and is canceled, so the run is stopped: spared, it would run on
// for nobody once B's handler let it go too (found by an attack on the
// holder check).
func TestACancelByKeyStopsARunTakenOverByARequestItCanceled(t *testing.T) {
	key := strings.Repeat("c", 64)
	held := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-1", Owner: "w1",
		Tenant: "acme", Name: "api", RequestID: "A", Holder: ledger.Key("acme", "A")}
	taken := *held
	taken.Owner, taken.Holder = "w2", ledger.Key("acme", "B")
	w := newStopWorld(t, 2, func(w *stopWorld) { w.put(t, &taken) })
	ctx := t.Context()
	for i, id := range []string{"A", "B"} {
		if _, _, err := w.l.Open(ctx, "acme", "api", id, key, uint64(10+i), time.Now()); err != nil {
			t.Fatal(err)
		}
		w.l.AddWaiter(ctx, key, "acme", id)
	}
	w.put(t, held)

	rep := w.svc.cancel(ctx, "acme", key)
	if w.kv.reads.Load() < 2 {
		t.Fatalf("premise: the record was read %d time(s)", w.kv.reads.Load())
	}
	if rep.Requests != 2 {
		t.Fatalf("premise: canceled %d request(s): %+v", rep.Requests, rep)
	}
	cur, _, _ := w.rs.Get(ctx, key)
	if !rep.Stopped || w.jobs.Load() == 0 || cur.State == v1.StateBuilding {
		t.Errorf("both requests of the key canceled, yet the run goes on: reply %+v; Jobs stopped %d; record %s %s holder %s",
			rep, w.jobs.Load(), cur.Run, cur.State, cur.Holder)
	}
}

// stopWorld is a tenant API on a ledger and a build-records bucket whose
// n-th read runs before first (onGetKV); jobs counts the Jobs stopped.
type stopWorld struct {
	l      *ledger.Ledger
	builds jetstream.KeyValue
	rs     *runs.Store
	svc    *Service
	jobs   *atomic.Int32
	kv     *onGetKV
}

// serviceBuckets is an embedded NATS server's connection, its build
// records' bucket and a ledger on its own bucket (lkv), in memory.
func serviceBuckets(t *testing.T) (nc *nats.Conn, builds, lkv jetstream.KeyValue, l *ledger.Ledger) {
	t.Helper()
	_, nc, js := testnats.JetStream(t)
	ctx := t.Context()
	builds, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: v1.BuildsBucket, History: 1, Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatal(err)
	}
	lkv, err = ledger.EnsureBucket(ctx, js, ledger.BucketConfig{Storage: jetstream.MemoryStorage, Replicas: 1})
	if err != nil {
		t.Fatal(err)
	}
	l = ledger.New(ledger.Config{Worker: "w1", Now: time.Now, Log: zap.NewNop()})
	l.UseBucket(lkv)
	return nc, builds, lkv, l
}

func newStopWorld(t *testing.T, n int32, before func(w *stopWorld)) *stopWorld {
	nc, builds, _, l := serviceBuckets(t)
	w := &stopWorld{l: l, builds: builds, jobs: &atomic.Int32{}}
	w.kv = &onGetKV{KeyValue: builds, n: n, before: func() { before(w) }}
	w.rs = runs.New()
	w.rs.UseBucket(w.kv)
	w.svc = New(Config{Ledger: l, Runs: w.rs, NC: nc, Now: time.Now, Log: zap.NewNop(),
		StopBuild:    func(context.Context, string, string) error { w.jobs.Add(1); return nil },
		AnswerParked: func(context.Context, string) {}})
	return w
}

func (w *stopWorld) put(t *testing.T, r *v1.BuildRecord) {
	b, _ := json.Marshal(r)
	if _, err := w.builds.Put(context.Background(), r.Key, b); err != nil {
		t.Error(err)
	}
}

// A request of another tenant begins waiting on a build after a cancel
// counted its waiters and before the stop: the build goes on for it,
// whether the run's holder stayed (A) or changed to a request the cancel
// counted and canceled (B, its handler not yet told). Found by an attack
// on the holder check.
func TestAStopSparesABuildARequestBeganWaitingOnAfterTheCount(t *testing.T) {
	for _, takenOver := range []bool{false, true} {
		t.Run(fmt.Sprintf("taken-over=%v", takenOver), func(t *testing.T) {
			key := strings.Repeat("d", 64)
			held := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-1", Owner: "w1",
				Tenant: "acme", Name: "api", RequestID: "A", Holder: ledger.Key("acme", "A")}
			w := newStopWorld(t, 2, func(w *stopWorld) {
				ctx := context.Background()
				if _, _, err := w.l.Open(ctx, "globex", "web", "G", key, 30, time.Now()); err != nil {
					t.Error(err)
				}
				w.l.AddWaiter(ctx, key, "globex", "G")
				if takenOver {
					taken := *held
					taken.Owner, taken.Holder = "w2", ledger.Key("acme", "B")
					w.put(t, &taken)
				}
			})
			ctx := t.Context()
			for i, id := range []string{"A", "B"} {
				if _, _, err := w.l.Open(ctx, "acme", "api", id, key, uint64(10+i), time.Now()); err != nil {
					t.Fatal(err)
				}
				w.l.AddWaiter(ctx, key, "acme", id)
			}
			w.put(t, held)
			rep := w.svc.cancel(ctx, "acme", key)
			if w.kv.reads.Load() < 2 {
				t.Fatalf("premise: the record was read %d time(s)", w.kv.reads.Load())
			}
			if rep.Requests != 2 {
				t.Fatalf("premise: canceled %d request(s): %+v", rep.Requests, rep)
			}
			cur, _, _ := w.rs.Get(ctx, key)
			if rep.Stopped || w.jobs.Load() != 0 || cur.State != v1.StateBuilding {
				t.Errorf("the build was stopped while globex's G, not canceled, waits on it: reply %+v, Jobs stopped %d, record %s %s",
					rep, w.jobs.Load(), cur.Run, cur.State)
			}
		})
	}
}

// onUpdateKV is a ledger bucket that runs before, once, ahead of its
// first compare-and-swap.
type onUpdateKV struct {
	jetstream.KeyValue
	once   atomic.Bool
	before func()
}

func (k *onUpdateKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if k.once.CompareAndSwap(false, true) {
		k.before()
	}
	return k.KeyValue.Update(ctx, key, value, rev)
}

// Found by the fault simulation (seed 15, one run in several): a request
// is decided between a cancel's read of its entry and the cancel's mark.
// The mark finds the decision and writes nothing; the cancel then counted
// no request and went on to stop the key's build — another request's —
// and answered "canceled". It must answer with the request's result,
// canceled nothing, and leave the build alone.
func TestACancelOfARequestDecidedBeforeItsMarkCancelsNothing(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	nc, builds, lkv, l := serviceBuckets(t)
	key := strings.Repeat("c", 64)
	le, _, err := l.Open(ctx, "acme", "web", "r1", key, 1, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	// The hook is on from here: the request's handler records its
	// decision just before the cancel's mark is written.
	decided := &ledger.Entry{E: le.E, Rev: le.Rev}
	l.UseBucket(&onUpdateKV{KeyValue: lkv, before: func() {
		d := ledger.Decision{Tenant: "acme", Name: "web", Data: v1.ResultData{RequestID: "r1", Key: key, Status: v1.StatusFailed, Reason: v1.ReasonBuildFailed}}
		if _, err := l.Record(ctx, decided, d); err != nil {
			t.Error(err)
		}
	}})
	rs := runs.New()
	rs.UseBucket(builds)
	// Another request of the tenant holds the key's build.
	run := &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "run-2", Owner: "w2", Tenant: "acme", Name: "web", RequestID: "r2", Holder: ledger.Key("acme", "r2"), LeaseMs: 60000, LeaseUntil: time.Now().Add(time.Minute)}
	b, _ := json.Marshal(run)
	if _, err := builds.Put(ctx, key, b); err != nil {
		t.Fatal(err)
	}
	var stops atomic.Int32
	svc := New(Config{Ledger: l, Runs: rs, NC: nc, Now: time.Now, Log: zap.NewNop(),
		StopBuild:    func(context.Context, string, string) error { stops.Add(1); return nil },
		AnswerParked: func(context.Context, string) {}})
	rep := svc.cancel(ctx, "acme", "r1")
	if rep.Canceled || rep.Stopped || rep.Requests != 0 || !strings.Contains(rep.Message, "already has its result") {
		t.Errorf("reply %+v, want nothing canceled and the request's result named", rep)
	}
	cur, _, err := rs.Get(ctx, key)
	if err != nil || cur == nil || cur.State != v1.StateBuilding || cur.Run != "run-2" {
		t.Errorf("the other request's build %+v (%v), want it still building", cur, err)
	}
	if n := stops.Load(); n != 0 {
		t.Errorf("%d Job stops, want none", n)
	}
}
