package ledger

import (
	"errors"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

func TestKeyIsAValidKVKeyThatKeepsTenantsApart(t *testing.T) {
	k := Key("acme", "build:1/x")
	if !regexp.MustCompile(`^[0-9a-f]{40}$`).MatchString(k) {
		t.Fatalf("Key = %q, want 40 hex digits (request ids may hold ':', which KV keys may not)", k)
	}
	if Key("acme", "build:1/x") != k {
		t.Fatal("Key is not stable")
	}
	if Key("other", "build:1/x") == k {
		t.Fatal("two tenants' requests of the same id share a ledger key")
	}
	// The tenant and the id are not simply concatenated.
	if Key("ab", "c") == Key("a", "bc") {
		t.Fatal("Key(ab, c) == Key(a, bc)")
	}
}

func TestOpenCreatesOnceAndTellsARedeliveryFromADuplicate(t *testing.T) {
	w := newWorld(t)
	clk := newClock()
	l := w.ledger("w1", clk, time.Minute)
	ctx := t.Context()

	le, fresh, err := l.Open(ctx, "acme", "app", "r1", "key1", 7, msgTime)
	if err != nil || !fresh {
		t.Fatalf("first Open = fresh %v, %v; want fresh", fresh, err)
	}
	if le.E.State != v1.RequestStateBuilding || le.E.Seq != 7 || !le.E.MsgTime.Equal(msgTime) ||
		le.E.Worker != "w1" || !le.E.UpdatedAt.Equal(clk.Now()) || le.E.Key != "key1" || le.E.Name != "app" {
		t.Fatalf("created entry = %+v", le.E)
	}

	// A redelivery of the same message (same sequence and time, given in
	// another location) gets the entry, not a new one.
	again, fresh, err := l.Open(ctx, "acme", "app", "r1", "key1", 7, msgTime.In(time.FixedZone("x", 3600)))
	if err != nil || fresh {
		t.Fatalf("redelivered Open = fresh %v, %v; want the existing entry", fresh, err)
	}
	if again.Rev != le.Rev || again.E.Seq != 7 {
		t.Fatalf("redelivered Open = rev %d %+v, want rev %d", again.Rev, again.E, le.Rev)
	}

	// Another message holding the id: another sequence, or another time.
	if _, _, err := l.Open(ctx, "acme", "app", "r1", "key1", 8, msgTime); !errors.Is(err, ErrDuplicateID) {
		t.Fatalf("Open of another sequence = %v, want ErrDuplicateID", err)
	}
	if _, _, err := l.Open(ctx, "acme", "app", "r1", "key1", 7, msgTime.Add(time.Nanosecond)); !errors.Is(err, ErrDuplicateID) {
		t.Fatalf("Open of another message time = %v, want ErrDuplicateID", err)
	}
	// The duplicates changed nothing.
	if cur := read(t, l, "acme", "r1"); cur.Rev != le.Rev {
		t.Fatalf("a duplicate wrote the entry: rev %d, want %d", cur.Rev, le.Rev)
	}

	// The same id of another tenant is another request.
	if _, fresh, err := l.Open(ctx, "other", "app", "r1", "key1", 8, msgTime); err != nil || !fresh {
		t.Fatalf("Open of another tenant's id = fresh %v, %v; want fresh", fresh, err)
	}
}

func TestOpenCreatesAnEntryRemovedBetweenItsCreateAndItsRead(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), time.Minute, f)
	// The first create finds a key that is gone by the time it is read.
	tries := 0
	f.onCreate(func(string) error {
		if tries++; tries == 1 {
			return jetstream.ErrKeyExists
		}
		return nil
	})
	le, fresh, err := l.Open(t.Context(), "acme", "app", "r1", "key1", 1, msgTime)
	if err != nil || !fresh || le == nil {
		t.Fatalf("Open = %v fresh %v, %v; want the entry created on the second try", le, fresh, err)
	}
	if tries != 2 {
		t.Fatalf("Open created %d times, want 2", tries)
	}
}

func TestGetOfAnUnknownRequestIsNilAndAnUnreadableEntryAnError(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	if le, err := l.Get(t.Context(), "acme", "nope"); le != nil || err != nil {
		t.Fatalf("Get of an unknown id = %v, %v; want nil, nil", le, err)
	}
	if _, err := w.kv.Put(t.Context(), Key("acme", "bad"), []byte("{not json")); err != nil {
		t.Fatal(err)
	}
	if le, err := l.Get(t.Context(), "acme", "bad"); err == nil {
		t.Fatalf("Get of an unreadable entry = %+v, nil; want an error", le)
	}
}

func TestRecordKeepsTheFirstDecision(t *testing.T) {
	w := newWorld(t)
	clk := newClock()
	l := w.ledger("w1", clk, time.Minute)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	stale := *le

	clk.Advance(time.Second)
	first := decision("acme", "r1", v1.StatusSucceeded)
	first.CleanupKey, first.CleanupRun = "key1", "run1"
	got, err := l.Record(ctx, le, first)
	if err != nil {
		t.Fatal(err)
	}
	if got.Recorded || got.Data.Status != v1.StatusSucceeded {
		t.Fatalf("first Record = %+v, want the decision itself, not Recorded", got)
	}
	e := read(t, l, "acme", "r1").E
	if e.Result == nil || e.Result.Digest != first.Data.Digest || e.State != string(v1.StatusSucceeded) ||
		e.Digest != first.Data.Digest || e.Origin != v1.OriginBuild || e.CleanupRun != "run1" ||
		e.Worker != "w1" || !e.UpdatedAt.Equal(clk.Now()) || e.Published {
		t.Fatalf("recorded entry = %+v", e)
	}

	// A second handler of the message, on the entry as read before the
	// first decision, decides otherwise: the first decision stands.
	second := decision("acme", "r1", v1.StatusFailed)
	second.Term = true
	got, err = l.Record(ctx, &stale, second)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Recorded || got.Data.Status != v1.StatusSucceeded || got.Data.Digest != first.Data.Digest ||
		got.Term || got.CleanupRun != "run1" || got.PublishedBefore {
		t.Fatalf("second Record = %+v, want the first decision with Recorded set", got)
	}
	if e2 := read(t, l, "acme", "r1"); e2.E.Result.Status != v1.StatusSucceeded || e2.E.Term {
		t.Fatalf("the second decision overwrote the first: %+v", e2.E)
	}
}

func TestACanceledEntryIsRecordedCanceledWhateverIsDecided(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	stale := *le

	if ok, err := l.MarkCanceled(ctx, le); !ok || err != nil {
		t.Fatalf("MarkCanceled = %v, %v; want true", ok, err)
	}
	// Marked already: nothing to do, on the current entry or a stale one.
	if ok, err := l.MarkCanceled(ctx, le); ok || err != nil {
		t.Fatalf("second MarkCanceled = %v, %v; want false, nil", ok, err)
	}
	if ok, err := l.MarkCanceled(ctx, &stale); ok || err != nil {
		t.Fatalf("MarkCanceled on a stale entry = %v, %v; want false, nil", ok, err)
	}

	d := decision("acme", "r1", v1.StatusSucceeded)
	d.Term = true
	got, err := l.Record(ctx, &stale, d)
	if err != nil {
		t.Fatal(err)
	}
	if got.Data.Status != v1.StatusCanceled || got.Data.Reason != v1.ReasonCanceled ||
		got.Data.Digest != "" || got.Data.Image != "" || got.Data.ImageRef != "" || got.Term {
		t.Fatalf("Record on a canceled entry = %+v, want the canceled result", got)
	}
	if e := read(t, l, "acme", "r1").E; e.Result.Status != v1.StatusCanceled || e.State != string(v1.StatusCanceled) || e.Digest != "" {
		t.Fatalf("recorded entry = %+v, want canceled", e)
	}

	// Decided: a cancel comes too late.
	le2 := open(t, l, "acme", "r2")
	if _, err := l.Record(ctx, le2, decision("acme", "r2", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.MarkCanceled(ctx, le2); ok || err != nil {
		t.Fatalf("MarkCanceled of a decided entry = %v, %v; want false, nil", ok, err)
	}
	// Removed: nothing to mark, and no error.
	le3 := open(t, l, "acme", "r3")
	if err := w.kv.Delete(ctx, le3.Key()); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.MarkCanceled(ctx, le3); ok || err != nil {
		t.Fatalf("MarkCanceled of a removed entry = %v, %v; want false, nil", ok, err)
	}
}

func TestDecisionCanceledClearsTheImageAndTheTerm(t *testing.T) {
	d := decision("acme", "r1", v1.StatusFailed)
	d.Term, d.CleanupKey = true, "key1"
	c := d.Canceled()
	if c.Data.Status != v1.StatusCanceled || c.Data.Reason != v1.ReasonCanceled || c.Data.Message == "" ||
		c.Data.LogTail != "" || c.Term || c.CleanupKey != "key1" || c.Data.RequestID != "r1" {
		t.Fatalf("Canceled = %+v", c)
	}
	if d.Data.Status != v1.StatusFailed || !d.Term {
		t.Fatal("Canceled changed its receiver")
	}
}

func TestSpendRetryCountsTransientFailuresInTheEntry(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")

	// The budget bounds transient failures, whatever the deliveries.
	for i, want := range []bool{true, true, false} {
		if got := l.SpendRetry(ctx, le, 100, 3); got != want {
			t.Fatalf("SpendRetry #%d = %v, want %v", i+1, got, want)
		}
	}
	if n := read(t, l, "acme", "r1").E.TransientFailures; n != 3 {
		t.Fatalf("TransientFailures = %d, want 3", n)
	}
	// A stale copy of the entry counts on top of the stored count.
	stale := open(t, l, "acme", "r2")
	cp := *stale
	l.SpendRetry(ctx, stale, 1, 5)
	l.SpendRetry(ctx, &cp, 1, 5)
	if n := read(t, l, "acme", "r2").E.TransientFailures; n != 2 {
		t.Fatalf("TransientFailures after a stale SpendRetry = %d, want 2", n)
	}
}

func TestSpendRetryFallsBackToDeliveriesWithoutAnEntry(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), time.Minute, f)
	ctx := t.Context()

	if !l.SpendRetry(ctx, nil, 2, 3) || l.SpendRetry(ctx, nil, 3, 3) {
		t.Fatal("without an entry, SpendRetry does not count deliveries against maxFailures")
	}
	// The ledger unreachable: deliveries again.
	le := open(t, l, "acme", "r1")
	f.onUpdate(func(string, uint64) error { return errors.New("nats: timeout") })
	if !l.SpendRetry(ctx, le, 1, 3) || l.SpendRetry(ctx, le, 3, 3) {
		t.Fatal("with the ledger failing, SpendRetry does not count deliveries against maxFailures")
	}
	// The entry gone meanwhile: deliveries again.
	f.onUpdate(nil)
	if err := w.kv.Delete(ctx, le.Key()); err != nil {
		t.Fatal(err)
	}
	if l.SpendRetry(ctx, le, 9, 3) {
		t.Fatal("with the entry gone, SpendRetry does not count deliveries against maxFailures")
	}
}

func TestRetryDelayDoublesAndCapsAtAMinute(t *testing.T) {
	byDeliveries := map[uint64]time.Duration{
		0: time.Second, 1: 2 * time.Second, 2: 4 * time.Second, 3: 8 * time.Second,
		5: 32 * time.Second, 6: time.Minute, 7: time.Minute, 1 << 40: time.Minute,
	}
	for n, want := range byDeliveries {
		if got := RetryDelay(nil, n); got != want {
			t.Errorf("RetryDelay(nil, %d) = %v, want %v", n, got, want)
		}
	}
	// With an entry, its transient failures count (at least one), not
	// the deliveries.
	byFailures := map[int]time.Duration{0: 2 * time.Second, 1: 2 * time.Second, 3: 8 * time.Second, 6: time.Minute, 50: time.Minute}
	for n, want := range byFailures {
		le := &Entry{E: v1.RequestEntry{TransientFailures: n}}
		if got := RetryDelay(le, 1000); got != want {
			t.Errorf("RetryDelay(%d failures, 1000 deliveries) = %v, want %v", n, got, want)
		}
	}
}

func TestRequeueTokenIsSetOnceAndByRequeueTokenMatchesOnlyIt(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	stale := *le

	tok, err := l.RequeueToken(ctx, le)
	if err != nil || len(tok) != 32 {
		t.Fatalf("RequeueToken = %q, %v; want 32 hex digits", tok, err)
	}
	// Parking again — on the entry as it is, or as read before the token —
	// keeps the token.
	for _, e := range []*Entry{le, &stale, read(t, l, "acme", "r1")} {
		if again, err := l.RequeueToken(ctx, e); err != nil || again != tok {
			t.Fatalf("RequeueToken again = %q, %v; want %q", again, err, tok)
		}
	}
	if got := read(t, l, "acme", "r1").E.RequeueToken; got != tok {
		t.Fatalf("stored token = %q, want %q", got, tok)
	}

	if got, err := l.ByRequeueToken(ctx, "acme", "r1", tok); err != nil || got == nil || got.E.RequestID != "r1" {
		t.Fatalf("ByRequeueToken(the token) = %v, %v; want the entry", got, err)
	}
	for _, c := range []struct{ tenant, id, tok string }{
		{"acme", "r1", ""},
		{"acme", "r1", tok[:31] + "x"},
		{"acme", "r1", tok + "0"},
		{"other", "r1", tok},
		{"acme", "r2", tok},
	} {
		if got, err := l.ByRequeueToken(ctx, c.tenant, c.id, c.tok); got != nil || err != nil {
			t.Errorf("ByRequeueToken(%s, %s, %q) = %v, %v; want nil, nil", c.tenant, c.id, c.tok, got, err)
		}
	}
	// An entry without a token matches no token, not even the empty one.
	open(t, l, "acme", "r3")
	if got, err := l.ByRequeueToken(ctx, "acme", "r3", tok); got != nil || err != nil {
		t.Fatalf("ByRequeueToken of an entry without a token = %v, %v", got, err)
	}
	// Nothing known: an error, never a nil entry.
	if _, err := w.kv.Put(ctx, Key("acme", "bad"), []byte("{")); err != nil {
		t.Fatal(err)
	}
	if _, err := l.ByRequeueToken(ctx, "acme", "bad", tok); err == nil {
		t.Fatal("ByRequeueToken of an unreadable entry gave no error")
	}

	if _, err := l.RequeueToken(ctx, nil); err == nil {
		t.Fatal("RequeueToken(nil) gave no error")
	}
	gone := open(t, l, "acme", "r4")
	if err := w.kv.Delete(ctx, gone.Key()); err != nil {
		t.Fatal(err)
	}
	if tok, err := l.RequeueToken(ctx, gone); err == nil {
		t.Fatalf("RequeueToken of a removed entry = %q, nil; want an error", tok)
	}
}

func TestRequeueTokensDifferBetweenRequests(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	seen := map[string]bool{}
	for i := range 5 {
		tok, err := l.RequeueToken(t.Context(), open(t, l, "acme", fmt.Sprint("r", i)))
		if err != nil {
			t.Fatal(err)
		}
		if seen[tok] {
			t.Fatalf("token %q given twice", tok)
		}
		seen[tok] = true
	}
}

// change is the ledger's one compare-and-swap loop: a write between its
// read and its update is not lost, and the mutation is applied again on
// the entry as it is now.
func TestChangeReappliesTheMutationAfterAConcurrentWrite(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), time.Minute, f)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")

	// Another party counts two failures between this read and its write.
	interfered := false
	f.onUpdate(func(key string, _ uint64) error {
		if interfered {
			return nil
		}
		interfered = true
		cur := read(t, l, "acme", "r1")
		cur.E.TransientFailures += 2
		if _, err := w.kv.Update(ctx, key, mustJSON(t, cur.E), cur.Rev); err != nil {
			t.Errorf("the concurrent write failed: %v", err)
		}
		return nil
	})
	calls := 0
	ok, err := l.change(ctx, le, 3, func(e *v1.RequestEntry) bool {
		calls++
		e.TransientFailures++
		return true
	})
	if !ok || err != nil {
		t.Fatalf("change = %v, %v; want written", ok, err)
	}
	if calls != 2 {
		t.Fatalf("the mutation ran %d times, want 2 (once more after the conflict)", calls)
	}
	cur := read(t, l, "acme", "r1")
	if cur.E.TransientFailures != 3 {
		t.Fatalf("TransientFailures = %d, want 3: the concurrent write's 2 and this change's 1", cur.E.TransientFailures)
	}
	if le.Rev != cur.Rev || le.E.TransientFailures != 3 {
		t.Fatalf("le = rev %d %+v, want the written entry at rev %d", le.Rev, le.E, cur.Rev)
	}
}

func TestChangeGivesUpAfterItsTriesAndReportsAGoneEntry(t *testing.T) {
	w := newWorld(t)
	f := &faultyKV{KeyValue: w.kv}
	l := w.ledger("w1", newClock(), time.Minute, f)
	ctx := t.Context()
	le := open(t, l, "acme", "r1")
	bump := func(e *v1.RequestEntry) bool { e.TransientFailures++; return true }

	// Someone writes the entry before every update: errConflict after
	// exactly tries updates, and le holds the entry as last read.
	f.onUpdate(func(key string, _ uint64) error {
		cur := read(t, l, "acme", "r1")
		cur.E.Name += "+"
		if _, err := w.kv.Update(ctx, key, mustJSON(t, cur.E), cur.Rev); err != nil {
			t.Errorf("the concurrent write failed: %v", err)
		}
		return nil
	})
	f.updates = 0
	ok, err := l.change(ctx, le, 4, bump)
	if ok || !errors.Is(err, errConflict) {
		t.Fatalf("change under constant interference = %v, %v; want errConflict", ok, err)
	}
	if f.updates != 4 {
		t.Fatalf("change tried %d updates, want 4", f.updates)
	}
	if le.E.Name != "app+++" || le.E.TransientFailures != 0 {
		t.Fatalf("le after giving up = %+v, want the entry as last read (three interfering writes seen, none of its own)", le.E)
	}

	// A mutation with nothing to write does not write.
	f.onUpdate(nil)
	f.updates = 0
	if ok, err := l.change(ctx, le, 4, func(*v1.RequestEntry) bool { return false }); ok || err != nil || f.updates != 0 {
		t.Fatalf("change with nothing to write = %v, %v after %d updates", ok, err, f.updates)
	}

	// The entry removed meanwhile.
	if err := w.kv.Delete(ctx, le.Key()); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.change(ctx, le, 4, bump); ok || !errors.Is(err, errGone) {
		t.Fatalf("change of a removed entry = %v, %v; want errGone", ok, err)
	}

	// Any other failure is the bucket's, and not retried.
	le2 := open(t, l, "acme", "r2")
	boom := errors.New("boom")
	f.onUpdate(func(string, uint64) error { return boom })
	f.updates = 0
	if ok, err := l.change(ctx, le2, 4, bump); ok || !errors.Is(err, boom) || f.updates != 1 {
		t.Fatalf("change on a failing bucket = %v, %v after %d updates; want the bucket's error after 1", ok, err, f.updates)
	}
}

func TestWrittenAtIsTheServersTimeOfTheWrite(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute) // the ledger's clock is years away
	ctx := t.Context()
	before := time.Now().Add(-time.Second)
	le := open(t, l, "acme", "r1")
	at, err := l.WrittenAt(ctx, le)
	if err != nil {
		t.Fatal(err)
	}
	after := time.Now().Add(time.Second)
	if at.Before(before) || at.After(after) {
		t.Fatalf("WrittenAt = %v, want the server's time, between %v and %v", at, before, after)
	}
	// Written again since (the bucket keeps one revision): the later write's
	// time.
	stale := *le
	time.Sleep(5 * time.Millisecond)
	if ok, err := l.MarkCanceled(ctx, le); !ok || err != nil {
		t.Fatal(ok, err)
	}
	later, err := l.WrittenAt(ctx, &stale)
	if err != nil {
		t.Fatal(err)
	}
	if !later.After(at) {
		t.Fatalf("WrittenAt of a rewritten entry = %v, want after the first write's %v", later, at)
	}
	if err := w.kv.Delete(ctx, le.Key()); err != nil {
		t.Fatal(err)
	}
	if _, err := l.WrittenAt(ctx, le); err == nil {
		t.Fatal("WrittenAt of a removed entry gave no error")
	}
}

func TestProofsAreRecordedOnceAndFoundAgain(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	const k = "p.acme.0123"
	if ok, err := l.HasProof(ctx, k); ok || err != nil {
		t.Fatalf("HasProof before = %v, %v", ok, err)
	}
	if err := l.RecordProof(ctx, k, []byte("first")); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordProof(ctx, k, []byte("second")); err != nil {
		t.Fatalf("recording a recorded proof again = %v, want nil", err)
	}
	if ok, err := l.HasProof(ctx, k); !ok || err != nil {
		t.Fatalf("HasProof after = %v, %v", ok, err)
	}
	got, err := w.kv.Get(ctx, k)
	if err != nil || string(got.Value()) != "first" {
		t.Fatalf("stored proof = %v, %v; want the first", got, err)
	}

	// Without a bucket: nothing known, nothing recorded, no error.
	none := New(Config{Worker: "w2", Now: time.Now})
	if none.Ready() || none.Bucket() != nil {
		t.Fatal("a ledger without UseBucket is ready")
	}
	if ok, err := none.HasProof(ctx, k); ok || err != nil {
		t.Fatalf("HasProof without a bucket = %v, %v", ok, err)
	}
	if err := none.RecordProof(ctx, k, nil); err != nil {
		t.Fatalf("RecordProof without a bucket = %v", err)
	}
}

// A request's packed git source is recorded once: a second handler (a
// redelivery racing a slow first one) gets the first source back, never
// its own, so the request builds one commit whatever its ref does.
func TestSetSourceKeepsTheFirstSource(t *testing.T) {
	w := newWorld(t)
	clk := newClock()
	l1, l2 := w.ledger("w1", clk, time.Minute), w.ledger("w2", clk, time.Minute)
	ctx := t.Context()
	le1 := open(t, l1, "acme", "r1")
	le2 := read(t, l2, "acme", "r1")
	src := func(commit string) *v1.ResolvedSource {
		return &v1.ResolvedSource{
			SourceInfo: v1.SourceInfo{GitURL: "https://git.example.com/a.git", Ref: "main", Commit: commit, ContextDigest: "sha256:" + commit},
			S3:         v1.S3Source{Bucket: "buildq", Key: "contexts/acme/sha256/" + commit + ".tar.gz"},
		}
	}
	got, err := l1.SetSource(ctx, le1, src("c1"), "key-c1")
	if err != nil || got.Commit != "c1" {
		t.Fatalf("first SetSource = %+v, %v", got, err)
	}
	got, err = l2.SetSource(ctx, le2, src("c2"), "key-c2")
	if err != nil || got.Commit != "c1" {
		t.Fatalf("second SetSource = %+v, %v; want the first source (c1)", got, err)
	}
	if e := read(t, l2, "acme", "r1"); e.E.Source == nil || e.E.Source.Commit != "c1" || e.E.Key != "key-c1" {
		t.Fatalf("stored entry %+v, want source c1 and key key-c1", e.E)
	}
}

// A cancel and the recording of a packed source are one compare-and-swap
// apart: canceled first, the source is never recorded (nothing is
// built); recorded first, the cancel learns the request is keyed and
// cancels it as such.
func TestCancelAndSetSourceNeverBothWin(t *testing.T) {
	w := newWorld(t)
	clk := newClock()
	l := w.ledger("w1", clk, time.Minute)
	ctx := t.Context()
	src := &v1.ResolvedSource{SourceInfo: v1.SourceInfo{Commit: "c1", ContextDigest: "sha256:c1"}, S3: v1.S3Source{Bucket: "b", Key: "k"}}

	canceledFirst, _, err := l.Open(ctx, "acme", "app", "r1", "", 1, msgTime) // no key before its source is packed
	if err != nil {
		t.Fatal(err)
	}
	if ok, keyed, err := l.MarkCanceledUnkeyed(ctx, read(t, l, "acme", "r1")); !ok || keyed || err != nil {
		t.Fatalf("MarkCanceledUnkeyed = %v, %v, %v; want canceled", ok, keyed, err)
	}
	if got, err := l.SetSource(ctx, canceledFirst, src, "key-c1"); !errors.Is(err, ErrCanceled) || got != nil {
		t.Fatalf("SetSource after the cancel = %+v, %v; want ErrCanceled", got, err)
	}

	le, _, err := l.Open(ctx, "acme", "app", "r2", "", 2, msgTime.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.SetSource(ctx, le, src, "key-c1"); err != nil {
		t.Fatal(err)
	}
	ok, keyed, err := l.MarkCanceledUnkeyed(ctx, read(t, l, "acme", "r2"))
	if ok || !keyed || err != nil {
		t.Fatalf("MarkCanceledUnkeyed of a keyed request = %v, %v, %v; want keyed, nothing written", ok, keyed, err)
	}
	if e := read(t, l, "acme", "r2"); e.E.Canceled {
		t.Fatal("a keyed request was marked canceled by the unkeyed cancel")
	}
}
