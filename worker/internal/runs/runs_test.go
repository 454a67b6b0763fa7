package runs

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// newStore returns a store on a real buildq-builds bucket of an embedded
// NATS server, the bucket itself, and the keys its "run ended" hook
// fired for.
func newStore(t *testing.T) (*Store, jetstream.KeyValue, *hook) {
	t.Helper()
	_, _, js := testnats.JetStream(t)
	kv, err := js.CreateKeyValue(t.Context(), jetstream.KeyValueConfig{Bucket: v1.BuildsBucket, History: 1, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	s := New()
	if s.Bucket() != nil {
		t.Fatal("a new store has a bucket")
	}
	s.UseBucket(kv)
	h := &hook{}
	s.OnEnded(h.fire)
	return s, kv, h
}

// hook records the keys the "run ended" hook fired for.
type hook struct {
	mu   sync.Mutex
	keys []string
}

func (h *hook) fire(_ context.Context, key string) {
	h.mu.Lock()
	h.keys = append(h.keys, key)
	h.mu.Unlock()
}

// expect fails t unless the hook fired for exactly keys since the last
// look; what says which writes that was.
func (h *hook) expect(t *testing.T, what string, keys ...string) {
	t.Helper()
	if k := h.take(); !slices.Equal(k, keys) {
		t.Fatalf("%s fired the run ended hook for %q, want %q", what, k, keys)
	}
}

func (h *hook) take() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	k := h.keys
	h.keys = nil
	return k
}

// failingKV fails every write with err.
type failingKV struct {
	jetstream.KeyValue
	err error
}

func (f failingKV) Update(context.Context, string, []byte, uint64) (uint64, error) { return 0, f.err }
func (f failingKV) Create(context.Context, string, []byte, ...jetstream.KVCreateOpt) (uint64, error) {
	return 0, f.err
}
func (f failingKV) Delete(context.Context, string, ...jetstream.KVDeleteOpt) error { return f.err }

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

func building(key, run, owner string) *v1.BuildRecord {
	return &v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: run, Owner: owner, LeaseMs: 30000,
		LeaseUntil: t0.Add(30 * time.Second), Tenant: "acme", RequestID: "r1", Destinations: []string{"reg/app:1"},
		StartedAt: t0}
}

func succeeded(r *v1.BuildRecord) *v1.BuildRecord {
	c := *r
	c.State, c.Owner, c.LeaseUntil, c.Digest, c.FinishedAt = v1.StateSucceeded, "", time.Time{}, "sha256:aa", t0.Add(time.Minute)
	return &c
}

func get(t *testing.T, s *Store, key string) (*v1.BuildRecord, uint64) {
	t.Helper()
	r, rev, err := s.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if r == nil {
		t.Fatalf("no record for %s", key)
	}
	return r, rev
}

func claim(t *testing.T, s *Store, r *v1.BuildRecord) uint64 {
	t.Helper()
	rev, ok, err := s.Claim(t.Context(), r)
	if err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	return rev
}

func TestClaimIsCreateOnly(t *testing.T) {
	s, _, h := newStore(t)
	ctx := t.Context()
	if r, rev, err := s.Get(ctx, "k"); r != nil || rev != 0 || err != nil {
		t.Fatalf("Get of an absent key = %v, %d, %v", r, rev, err)
	}
	rev := claim(t, s, building("k", "run1", "x"))
	if _, ok, err := s.Claim(ctx, building("k", "run2", "y")); ok || err != nil {
		t.Fatalf("second Claim = %v, %v; want false, nil", ok, err)
	}
	got, grev := get(t, s, "k")
	if got.Run != "run1" || got.Owner != "x" || grev != rev {
		t.Fatalf("record = %+v at %d, want the first claim at %d", got, grev, rev)
	}
	// A final record is not absent either: only Reclaim replaces it.
	if _, err := s.End(ctx, succeeded(got), grev); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := s.Claim(ctx, building("k", "run3", "y")); ok || err != nil {
		t.Fatalf("Claim over a final record = %v, %v; want false, nil", ok, err)
	}
	h.take()
	if _, ok, err := s.Claim(ctx, building("k", "run3", "y")); ok || err != nil || len(h.take()) != 0 {
		t.Fatal("a failed Claim fired the run ended hook")
	}
}

func TestRenewTakeOverAndReclaimFailWithoutAnErrorOnAStaleRevision(t *testing.T) {
	s, _, h := newStore(t)
	ctx := t.Context()
	type write func(context.Context, *v1.BuildRecord, uint64) (uint64, bool, error)
	for name, op := range map[string]write{"Renew": s.Renew, "TakeOver": s.TakeOver, "Reclaim": s.Reclaim} {
		key := "k-" + name
		r := building(key, "run1", "x")
		rev := claim(t, s, r)
		stale := rev
		rev, ok, err := op(ctx, Renewed(r, t0.Add(time.Second), time.Minute), rev)
		if err != nil || !ok || rev <= stale {
			t.Fatalf("%s at the current revision = %d, %v, %v; want written", name, rev, ok, err)
		}
		other := *r
		other.Owner = "y"
		if nrev, ok, err := op(ctx, &other, stale); ok || err != nil || nrev != 0 {
			t.Fatalf("%s at a stale revision = %d, %v, %v; want 0, false, nil", name, nrev, ok, err)
		}
		if got, grev := get(t, s, key); got.Owner != "x" || grev != rev {
			t.Fatalf("%s at a stale revision wrote %+v", name, got)
		}
	}
	h.expect(t, "Renew, TakeOver or Reclaim")
}

func TestReclaimReplacesAFailedRecordWithANewRun(t *testing.T) {
	s, _, _ := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	failed := *r
	failed.State, failed.Owner = v1.StateFailed, ""
	stored, err := s.End(ctx, &failed, rev)
	if err != nil || stored.State != v1.StateFailed {
		t.Fatalf("End = %+v, %v", stored, err)
	}
	_, frev := get(t, s, "k")
	if _, ok, err := s.Reclaim(ctx, building("k", "run2", "y"), frev); !ok || err != nil {
		t.Fatalf("Reclaim of the failed record = %v, %v", ok, err)
	}
	if got, _ := get(t, s, "k"); got.Run != "run2" || got.State != v1.StateBuilding || got.Owner != "y" {
		t.Fatalf("record after Reclaim = %+v", got)
	}
}

func TestEndEndsItsOwnRunAndFiresTheHook(t *testing.T) {
	s, _, h := newStore(t)
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	final := succeeded(r)
	stored, err := s.End(t.Context(), final, rev)
	if err != nil || stored != final {
		t.Fatalf("End = %+v, %v; want its own final record", stored, err)
	}
	if got, _ := get(t, s, "k"); got.State != v1.StateSucceeded || got.Run != "run1" || got.Digest != "sha256:aa" {
		t.Fatalf("stored record = %+v", got)
	}
	h.expect(t, "the end of the run", "k")
}

// The same run, still building, written since the holder's revision (a
// take-over while it was slow): its outcome is the run's all the same.
func TestEndFromAStaleRevisionEndsTheSameRunStillBuilding(t *testing.T) {
	s, _, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	taken := *r
	taken.Owner = "y"
	if _, ok, err := s.TakeOver(ctx, &taken, rev); !ok || err != nil {
		t.Fatal(ok, err)
	}
	final := succeeded(r)
	stored, err := s.End(ctx, final, rev)
	if err != nil || stored != final {
		t.Fatalf("End from a stale revision of its own run = %+v, %v; want its final record", stored, err)
	}
	if got, _ := get(t, s, "k"); got.State != v1.StateSucceeded || got.Run != "run1" {
		t.Fatalf("stored record = %+v", got)
	}
	h.expect(t, "the end of the run", "k")
}

func TestEndNeverTouchesAnotherRun(t *testing.T) {
	s, _, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	// run1 failed meanwhile and run2 reclaimed the key.
	failed := *r
	failed.State, failed.Owner = v1.StateFailed, ""
	if ok, err := s.EndAt(ctx, &failed, rev); !ok || err != nil {
		t.Fatal(ok, err)
	}
	_, frev := get(t, s, "k")
	if _, ok, err := s.Reclaim(ctx, building("k", "run2", "y"), frev); !ok || err != nil {
		t.Fatal(ok, err)
	}
	_, rev2 := get(t, s, "k")
	h.take()

	stored, err := s.End(ctx, succeeded(r), rev)
	if !errors.Is(err, ErrSuperseded) || stored != nil {
		t.Fatalf("End of a superseded run = %+v, %v; want ErrSuperseded", stored, err)
	}
	if got, grev := get(t, s, "k"); got.Run != "run2" || got.State != v1.StateBuilding || grev != rev2 {
		t.Fatalf("End of a superseded run wrote %+v", got)
	}
	h.expect(t, "End of a superseded run")
}

// Someone else ended the same run (a cancel, the reconciler): their
// record stands and is returned.
func TestEndReturnsTheStandingRecordOfItsRunEndedByAnother(t *testing.T) {
	s, _, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	canceled := Canceled(r, t0.Add(time.Second))
	if ok, err := s.EndAt(ctx, canceled, rev); !ok || err != nil {
		t.Fatal(ok, err)
	}
	_, crev := get(t, s, "k")
	h.take()

	stored, err := s.End(ctx, succeeded(r), rev)
	if err != nil || stored == nil {
		t.Fatalf("End of a run ended by another = %+v, %v; want the standing record", stored, err)
	}
	if stored.State != v1.StateFailed || stored.Reason != v1.ReasonCanceled || stored.Run != "run1" {
		t.Fatalf("End returned %+v, want the cancel's record", stored)
	}
	if got, grev := get(t, s, "k"); got.State != v1.StateFailed || grev != crev {
		t.Fatalf("End overwrote the standing record: %+v at %d", got, grev)
	}
	// End returns without error, the run ended: it fires the hook (which
	// answers the requests parked on the key; answering twice is
	// harmless, missing them is not).
	h.expect(t, "the end of the run", "k")
}

// The record gone (the bucket's TTL, an operator): nothing to race with,
// and the run's outcome is stored.
func TestEndRecreatesARecordGoneMeanwhile(t *testing.T) {
	s, kv, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	if err := kv.Delete(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	final := succeeded(r)
	stored, err := s.End(ctx, final, rev)
	if err != nil || stored != final {
		t.Fatalf("End of a removed record = %+v, %v; want its final record", stored, err)
	}
	if got, _ := get(t, s, "k"); got.State != v1.StateSucceeded || got.Run != "run1" {
		t.Fatalf("stored record = %+v", got)
	}
	h.expect(t, "the end of the run", "k")
}

func TestEndReportsTheBucketsErrorAndDoesNotFireTheHook(t *testing.T) {
	s, kv, h := newStore(t)
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	boom := errors.New("nats: timeout")
	s.UseBucket(failingKV{KeyValue: kv, err: boom})
	if stored, err := s.End(t.Context(), succeeded(r), rev); !errors.Is(err, boom) || stored != nil {
		t.Fatalf("End on a failing bucket = %+v, %v; want the bucket's error", stored, err)
	}
	h.expect(t, "a failed End")
	// A canceled context: an error, and no hook.
	s.UseBucket(kv)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := s.End(ctx, succeeded(r), rev); err == nil {
		t.Fatal("End with a canceled context succeeded")
	}
	h.expect(t, "a failed End")
}

// EndAt is one compare-and-swap: a record that changed meanwhile is left
// to whoever changed it. The hook fires only when it wrote.
func TestEndAtWritesOnlyAtItsRevisionAndFiresOnlyWhenItWrote(t *testing.T) {
	s, kv, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	renewed, ok, err := s.Renew(ctx, Renewed(r, t0.Add(time.Second), time.Minute), rev)
	if !ok || err != nil {
		t.Fatal(ok, err)
	}
	if ok, err := s.EndAt(ctx, Canceled(r, t0), rev); ok || err != nil {
		t.Fatalf("EndAt at a stale revision = %v, %v; want false, nil", ok, err)
	}
	if got, _ := get(t, s, "k"); got.State != v1.StateBuilding {
		t.Fatalf("EndAt at a stale revision wrote %+v", got)
	}
	h.expect(t, "EndAt at a stale revision")
	boom := errors.New("nats: timeout")
	s.UseBucket(failingKV{KeyValue: kv, err: boom})
	if ok, err := s.EndAt(ctx, Canceled(r, t0), renewed); ok || !errors.Is(err, boom) {
		t.Fatalf("EndAt on a failing bucket = %v, %v", ok, err)
	}
	h.expect(t, "a failed EndAt")
	s.UseBucket(kv)
	if ok, err := s.EndAt(ctx, Canceled(r, t0), renewed); !ok || err != nil {
		t.Fatalf("EndAt at the current revision = %v, %v", ok, err)
	}
	if got, _ := get(t, s, "k"); got.State != v1.StateFailed || got.Reason != v1.ReasonCanceled {
		t.Fatalf("record after EndAt = %+v", got)
	}
	h.expect(t, "the end of the run", "k")
}

// Release lets the run go so the next worker takes it over at once, and
// fires the hook whatever the write's outcome: a record changed
// meanwhile may have ended too.
func TestReleaseLetsTheRunGoAndAlwaysFiresTheHook(t *testing.T) {
	s, kv, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)

	if ok, err := s.Release(ctx, r, rev+1); ok || err != nil {
		t.Fatalf("Release at a stale revision = %v, %v; want false, nil", ok, err)
	}
	h.expect(t, "Release at a stale revision", "k")
	if got, _ := get(t, s, "k"); got.Owner != "x" {
		t.Fatalf("Release at a stale revision wrote %+v", got)
	}

	boom := errors.New("nats: timeout")
	s.UseBucket(failingKV{KeyValue: kv, err: boom})
	if ok, err := s.Release(ctx, r, rev); ok || !errors.Is(err, boom) {
		t.Fatalf("Release on a failing bucket = %v, %v", ok, err)
	}
	h.expect(t, "Release on a failing bucket", "k")

	s.UseBucket(kv)
	if ok, err := s.Release(ctx, r, rev); !ok || err != nil {
		t.Fatalf("Release = %v, %v", ok, err)
	}
	h.expect(t, "Release", "k")
	got, _ := get(t, s, "k")
	if got.Owner != "" || !got.LeaseUntil.IsZero() || got.Run != "run1" || got.State != v1.StateBuilding ||
		!slices.Equal(got.Destinations, r.Destinations) {
		t.Fatalf("released record = %+v, want run1 building without an owner or lease", got)
	}
}

func TestWithdrawRemovesOnlyTheClaimItWasGivenAndAlwaysFiresTheHook(t *testing.T) {
	s, kv, h := newStore(t)
	ctx := t.Context()
	r := building("k", "run1", "x")
	rev := claim(t, s, r)

	// At a stale revision: the record is someone else's now.
	if ok, err := s.Withdraw(ctx, r, rev+1); ok || err != nil {
		t.Fatalf("Withdraw at a stale revision = %v, %v; want false, nil", ok, err)
	}
	h.expect(t, "Withdraw at a stale revision", "k")
	if got, grev := get(t, s, "k"); got.Run != "run1" || grev != rev {
		t.Fatalf("Withdraw at a stale revision changed the record: %+v at %d", got, grev)
	}

	boom := errors.New("nats: timeout")
	s.UseBucket(failingKV{KeyValue: kv, err: boom})
	if ok, err := s.Withdraw(ctx, r, rev); ok || !errors.Is(err, boom) {
		t.Fatalf("Withdraw on a failing bucket = %v, %v", ok, err)
	}
	h.expect(t, "Withdraw on a failing bucket", "k")

	s.UseBucket(kv)
	if ok, err := s.Withdraw(ctx, r, rev); !ok || err != nil {
		t.Fatalf("Withdraw = %v, %v", ok, err)
	}
	h.expect(t, "Withdraw", "k")
	if got, _, err := s.Get(ctx, "k"); err != nil || got != nil {
		t.Fatalf("after Withdraw the key holds %+v (%v); want it absent", got, err)
	}
	// Absent again: the next request claims it with its own run.
	next := building("k", "run2", "y")
	if _, ok, err := s.Claim(ctx, next); !ok || err != nil {
		t.Fatalf("Claim after Withdraw = %v, %v", ok, err)
	}
	if got, _ := get(t, s, "k"); got.Run != "run2" {
		t.Fatalf("record after the new claim = %+v", got)
	}
}

func TestAStoreWithoutAHookWritesAllTheSame(t *testing.T) {
	s, _, _ := newStore(t)
	s.OnEnded(nil)
	r := building("k", "run1", "x")
	rev := claim(t, s, r)
	if ok, err := s.Release(t.Context(), r, rev); !ok || err != nil {
		t.Fatalf("Release without a hook = %v, %v", ok, err)
	}
}

func TestClaimReportsTheBucketsError(t *testing.T) {
	s, kv, _ := newStore(t)
	boom := errors.New("nats: timeout")
	s.UseBucket(failingKV{KeyValue: kv, err: boom})
	if _, ok, err := s.Claim(t.Context(), building("k", "run1", "x")); ok || !errors.Is(err, boom) {
		t.Fatalf("Claim on a failing bucket = %v, %v", ok, err)
	}
	if _, ok, err := s.Renew(t.Context(), building("k", "run1", "x"), 1); ok || !errors.Is(err, boom) {
		t.Fatalf("Renew on a failing bucket = %v, %v", ok, err)
	}
}

// A record that cannot be read counts as a failed build, so the next
// claim replaces it rather than blocking the key forever.
func TestDecodeTurnsAnUnreadableRecordIntoAFailedOne(t *testing.T) {
	for _, b := range []string{"", "{", "not json", "{}", `{"key":"k","run":"r"}`, `{"state":""}`, `[1,2]`} {
		r := Decode("k", []byte(b))
		if r.Key != "k" || r.State != v1.StateFailed || !r.Final() || r.Message == "" {
			t.Errorf("Decode(%q) = %+v, want a failed record of k", b, r)
		}
	}
	want := building("k", "run1", "x")
	b, _ := json.Marshal(want)
	if got := Decode("k", b); got.Run != "run1" || got.State != v1.StateBuilding || got.Owner != "x" || !got.LeaseUntil.Equal(want.LeaseUntil) {
		t.Fatalf("Decode of a record = %+v, want %+v", got, want)
	}

	s, kv, _ := newStore(t)
	ctx := t.Context()
	rev, err := kv.Put(ctx, "bad", []byte("garbage"))
	if err != nil {
		t.Fatal(err)
	}
	got, grev := get(t, s, "bad")
	if got.State != v1.StateFailed || grev != rev {
		t.Fatalf("Get of an unreadable record = %+v at %d", got, grev)
	}
	// …which a Reclaim at its revision replaces.
	if _, ok, err := s.Reclaim(ctx, building("bad", "run2", "y"), grev); !ok || err != nil {
		t.Fatalf("Reclaim of the unreadable record = %v, %v", ok, err)
	}
}

func TestReleasedDropsOwnerAndLeaseAndKeepsTheRun(t *testing.T) {
	r := building("k", "run1", "x")
	c := Released(r)
	if c.Owner != "" || !c.LeaseUntil.IsZero() {
		t.Fatalf("Released = %+v, want no owner and no lease", c)
	}
	c.Owner, c.LeaseUntil = r.Owner, r.LeaseUntil
	if !recordsEqual(c, r) {
		t.Fatalf("Released changed more than owner and lease: %+v", c)
	}
	if r.Owner != "x" || r.LeaseUntil.IsZero() {
		t.Fatal("Released changed its argument")
	}
}

func TestRenewedSetsTheLeaseFromNowInUTC(t *testing.T) {
	r := building("k", "run1", "x")
	now := time.Date(2031, 5, 6, 7, 8, 9, 0, time.FixedZone("x", 2*3600))
	c := Renewed(r, now, 45*time.Second)
	if !c.LeaseUntil.Equal(now.Add(45*time.Second)) || c.LeaseUntil.Location() != time.UTC {
		t.Fatalf("Renewed LeaseUntil = %v, want %v in UTC", c.LeaseUntil, now.Add(45*time.Second))
	}
	c.LeaseUntil = r.LeaseUntil
	if !recordsEqual(c, r) {
		t.Fatalf("Renewed changed more than the lease: %+v", c)
	}
	if !r.LeaseUntil.Equal(t0.Add(30 * time.Second)) {
		t.Fatal("Renewed changed its argument")
	}
}

func TestCanceledEndsTheRunFailedWithoutItsImage(t *testing.T) {
	r := building("k", "run1", "x")
	r.Digest, r.LogTail = "sha256:partial", "step 3/9"
	now := time.Date(2031, 5, 6, 7, 8, 9, 0, time.FixedZone("x", 2*3600))
	c := Canceled(r, now)
	if c.State != v1.StateFailed || c.Reason != v1.ReasonCanceled || c.Message == "" || !c.Final() {
		t.Fatalf("Canceled = %+v, want failed/Canceled", c)
	}
	if c.Owner != "" || !c.LeaseUntil.IsZero() || c.Digest != "" || c.LogTail != "" {
		t.Fatalf("Canceled = %+v, want no owner, lease, digest or log", c)
	}
	if !c.FinishedAt.Equal(now) || c.FinishedAt.Location() != time.UTC {
		t.Fatalf("Canceled FinishedAt = %v, want %v in UTC", c.FinishedAt, now)
	}
	if c.Run != "run1" || c.Key != "k" || !c.StartedAt.Equal(r.StartedAt) || !slices.Equal(c.Destinations, r.Destinations) {
		t.Fatalf("Canceled lost the run: %+v", c)
	}
	if r.State != v1.StateBuilding || r.Owner != "x" || r.Digest == "" {
		t.Fatal("Canceled changed its argument")
	}
}

func TestNewRunIDIsFreshEveryTime(t *testing.T) {
	seen := map[string]bool{}
	hex24 := regexp.MustCompile(`^[0-9a-f]{24}$`)
	for range 100 {
		id := NewRunID()
		if !hex24.MatchString(id) || seen[id] {
			t.Fatalf("NewRunID = %q (seen before: %v)", id, seen[id])
		}
		seen[id] = true
	}
}

func TestWatchSeesTheRecordsWrites(t *testing.T) {
	s, _, _ := newStore(t)
	ctx := t.Context()
	w, err := s.Watch(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Stop() }()
	next := func() jetstream.KeyValueEntry {
		select {
		case e := <-w.Updates():
			return e
		case <-time.After(5 * time.Second):
			t.Fatal("no update from the watch")
			return nil
		}
	}
	if e := next(); e != nil {
		t.Fatalf("first update = %v, want the end of the initial values", e)
	}
	rev := claim(t, s, building("k", "run1", "x"))
	if e := next(); e == nil || e.Revision() != rev || Decode("k", e.Value()).Run != "run1" {
		t.Fatalf("watched %v, want the claim at %d", e, rev)
	}
}

func recordsEqual(a, b *v1.BuildRecord) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}
