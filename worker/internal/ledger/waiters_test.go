package ledger

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

const (
	buildA = "aaaa0001"
	buildB = "bbbb0002"
)

func TestParseWaiterReadsJSONAndTheFirstVersionsForm(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Waiter
		ok   bool
	}{
		{`{"tenant":"acme","requestId":"r1","parked":true,"run":"run1","seq":9}`, Waiter{Tenant: "acme", RequestID: "r1", Parked: true, Run: "run1", Seq: 9}, true},
		{"acme/r1", Waiter{Tenant: "acme", RequestID: "r1"}, true},
		{"acme/r/1", Waiter{Tenant: "acme", RequestID: "r/1"}, true},
		{`{"tenant":"acme"}`, Waiter{Tenant: "acme"}, false},
		{`{"requestId":"r1"}`, Waiter{RequestID: "r1"}, false},
		{`{"tenant":`, Waiter{}, false},
		{"no slash", Waiter{Tenant: "no slash"}, false},
		{"", Waiter{}, false},
	} {
		got, ok := ParseWaiter([]byte(c.in))
		if ok != c.ok || (ok && (got.Tenant != c.want.Tenant || got.RequestID != c.want.RequestID ||
			got.Parked != c.want.Parked || got.Run != c.want.Run || got.Seq != c.want.Seq)) {
			t.Errorf("ParseWaiter(%q) = %+v, %v; want %+v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

func TestWaiterKeyIsOneEntryPerBuildKeyAndRequest(t *testing.T) {
	k := WaiterKey(buildA, "acme", "r:1")
	if k != "w."+buildA+"."+Key("acme", "r:1") {
		t.Fatalf("WaiterKey = %q", k)
	}
	if WaiterKey(buildA, "other", "r:1") == k || WaiterKey(buildB, "acme", "r:1") == k {
		t.Fatal("two requests' (or two keys') waiter entries share a key")
	}
}

// Listed from the stream's subjects (UseStream), or without the stream by
// a key listing.
func TestWaiterIndexListsEachBuildKeysWaiters(t *testing.T) {
	for _, withStream := range []bool{true, false} {
		t.Run(map[bool]string{true: "stream subjects", false: "key listing"}[withStream], func(t *testing.T) {
			w := newWorld(t)
			l := w.ledger("w1", newClock(), time.Minute)
			if !withStream {
				l = New(Config{Worker: "w1", Now: newClock().Now})
				l.UseBucket(w.kv)
			}
			testWaiterIndexLists(t, w, l)
		})
	}
}

func testWaiterIndexLists(t *testing.T, w *world, l *Ledger) {
	ctx := t.Context()

	if got, err := l.ListWaiters(ctx, ""); err != nil || len(got) != 0 {
		t.Fatalf("ListWaiters of an empty index = %v, %v", got, err)
	}
	l.AddWaiter(ctx, buildA, "acme", "r1")
	parked := Waiter{Tenant: "acme", RequestID: "r2", Parked: true, Run: "run1", Subject: "buildq.requests.acme",
		Seq: 42, MsgTime: msgTime, Body: []byte(`{"x":1}`), ParkedAt: msgTime.Add(time.Second), Token: "tok"}
	if err := l.PutWaiter(ctx, buildA, parked); err != nil {
		t.Fatal(err)
	}
	l.AddWaiter(ctx, buildB, "other", "r1")
	// Not a waiter entry: neither listed nor in the way.
	if _, err := w.kv.Put(ctx, Key("acme", "r1"), []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if _, err := w.kv.Put(ctx, "w."+buildA+".garbage", []byte("???")); err != nil {
		t.Fatal(err)
	}

	byKey, err := l.ListWaiters(ctx, buildA)
	if err != nil {
		t.Fatal(err)
	}
	if len(byKey) != 1 || len(byKey[buildA]) != 2 {
		t.Fatalf("ListWaiters(%s) = %+v, want its two waiters only", buildA, byKey)
	}
	var got Waiter
	for _, it := range byKey[buildA] {
		if it.Rev == 0 || it.K != WaiterKey(buildA, it.V.Tenant, it.V.RequestID) {
			t.Fatalf("waiter item = %+v", it)
		}
		if it.V.RequestID == "r2" {
			got = it.V
		}
	}
	if !got.Parked || got.Run != "run1" || got.Seq != 42 || !got.MsgTime.Equal(msgTime) || string(got.Body) != `{"x":1}` ||
		got.Token != "tok" || got.Subject != parked.Subject || !got.ParkedAt.Equal(parked.ParkedAt) {
		t.Fatalf("parked waiter read back = %+v, want %+v", got, parked)
	}

	all, err := l.ListWaiters(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 2 || len(all[buildA]) != 2 || len(all[buildB]) != 1 || all[buildB][0].V.Tenant != "other" {
		t.Fatalf("ListWaiters(all) = %+v", all)
	}

	l.DropWaiter(ctx, buildA, "acme", "r1")
	byKey, err = l.ListWaiters(ctx, buildA)
	if err != nil || len(byKey[buildA]) != 1 || byKey[buildA][0].V.RequestID != "r2" {
		t.Fatalf("ListWaiters after DropWaiter = %+v, %v", byKey, err)
	}
}

// A waiter written again since it was read (parked anew) stays.
func TestDropWaiterAtRemovesOnlyTheRevisionItRead(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	if err := l.PutWaiter(ctx, buildA, Waiter{Tenant: "acme", RequestID: "r1", Parked: true, Run: "run1"}); err != nil {
		t.Fatal(err)
	}
	items, err := l.ListWaiters(ctx, buildA)
	if err != nil || len(items[buildA]) != 1 {
		t.Fatalf("ListWaiters = %v, %v", items, err)
	}
	old := items[buildA][0]
	if err := l.PutWaiter(ctx, buildA, Waiter{Tenant: "acme", RequestID: "r1", Parked: true, Run: "run2"}); err != nil {
		t.Fatal(err)
	}
	l.DropWaiterAt(ctx, old)
	items, err = l.ListWaiters(ctx, buildA)
	if err != nil || len(items[buildA]) != 1 || items[buildA][0].V.Run != "run2" {
		t.Fatalf("after DropWaiterAt of the old revision: %+v, %v; want the new waiter kept", items, err)
	}
	l.DropWaiterAt(ctx, items[buildA][0])
	items, err = l.ListWaiters(ctx, buildA)
	if err != nil || len(items[buildA]) != 0 {
		t.Fatalf("after DropWaiterAt of the current revision: %+v, %v; want none", items, err)
	}
}

// A dropped waiter leaves no delete marker: the sweep lists every waiter
// subject the bucket holds, on every worker every half lease, and markers
// stay for the bucket's max age (days), so they would be listed again and
// again, more with every build. Without the bucket's stream the entry is
// deleted as a key-value entry, marker and all.
func TestADroppedWaiterLeavesNothingInTheBucket(t *testing.T) {
	w := newWorld(t)
	ctx := t.Context()
	subjects := func() map[string]uint64 {
		t.Helper()
		st, err := w.js.Stream(ctx, "KV_"+v1.RequestsBucket)
		if err != nil {
			t.Fatal(err)
		}
		info, err := st.Info(ctx, jetstream.WithSubjectFilter(bucketSubjectPrefix+"w.>"))
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Subjects
	}
	l := w.ledger("w1", newClock(), time.Minute)
	l.AddWaiter(ctx, buildA, "acme", "r1")
	if err := l.PutWaiter(ctx, buildA, Waiter{Tenant: "acme", RequestID: "r2", Parked: true, Run: "run1"}); err != nil {
		t.Fatal(err)
	}
	if n := len(subjects()); n != 2 {
		t.Fatalf("%d waiter subjects after two waiters, want 2", n)
	}
	l.DropWaiter(ctx, buildA, "acme", "r1")
	items, err := l.ListWaiters(ctx, buildA)
	if err != nil || len(items[buildA]) != 1 {
		t.Fatalf("ListWaiters = %v, %v; want r2's only", items, err)
	}
	l.DropWaiterAt(ctx, items[buildA][0])
	if got := subjects(); len(got) != 0 {
		t.Fatalf("waiter subjects after both were dropped: %v, want none (no delete markers)", got)
	}
	// A dropped waiter is written again as a new one; an update of the
	// dropped revision is refused as a wrong revision.
	l.AddWaiter(ctx, buildA, "acme", "r1")
	if items, err := l.ListWaiters(ctx, buildA); err != nil || len(items[buildA]) != 1 || items[buildA][0].V.RequestID != "r1" {
		t.Fatalf("ListWaiters after AddWaiter again = %v, %v", items, err)
	}
	err = l.UpdateWaiter(ctx, buildA, Waiter{Tenant: "acme", RequestID: "r2", Parked: true, Run: "run2"}, items[buildA][0].Rev)
	if !IsWrongRevision(err) {
		t.Fatalf("UpdateWaiter of a dropped waiter = %v, want a wrong revision", err)
	}

	// Without the stream: deleted, and a marker stays.
	kvOnly := New(Config{Worker: "w2", Now: newClock().Now})
	kvOnly.UseBucket(w.kv)
	kvOnly.DropWaiter(ctx, buildA, "acme", "r1")
	if items, err := l.ListWaiters(ctx, buildA); err != nil || len(items[buildA]) != 0 {
		t.Fatalf("ListWaiters after a key-value delete = %v, %v; want none", items, err)
	}
	if n := len(subjects()); n != 1 {
		t.Fatalf("%d waiter subjects after a key-value delete, want its marker", n)
	}
}

func TestWaitersAreTheUndecidedEntriesWaitingOnAKey(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	for _, id := range []string{"held", "parked", "decided"} {
		open(t, l, "acme", id)
		l.AddWaiter(ctx, buildA, "acme", id)
	}
	if err := l.PutWaiter(ctx, buildA, Waiter{Tenant: "acme", RequestID: "parked", Parked: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Record(ctx, read(t, l, "acme", "decided"), decision("acme", "decided", v1.StatusSucceeded)); err != nil {
		t.Fatal(err)
	}
	l.AddWaiter(ctx, buildA, "acme", "no-entry") // its entry aged out
	open(t, l, "acme", "elsewhere")
	l.AddWaiter(ctx, buildB, "acme", "elsewhere")

	got, err := l.Waiters(ctx, buildA)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, le := range got {
		ids = append(ids, le.E.RequestID)
		if le.Rev == 0 {
			t.Fatalf("waiter %s without its revision", le.E.RequestID)
		}
	}
	slices.Sort(ids)
	if !slices.Equal(ids, []string{"held", "parked"}) {
		t.Fatalf("Waiters(%s) = %v, want the undecided held and parked requests", buildA, ids)
	}
	if got, err := l.Waiters(ctx, "cccc0003"); err != nil || len(got) != 0 {
		t.Fatalf("Waiters of a key nobody waits on = %v, %v", got, err)
	}
}

// A handler of an earlier delivery that stalled while a later delivery
// parked the request must not turn the parked entry into a plain one: the
// later message is acked, and the parked entry is what the sweep answers.
// Origin: a request lost under load (seed 6 of the fault simulation,
// replayed 24 times at once): its parked entry was overwritten and no
// sweep looked at it again.
func TestAddWaiterKeepsAParkedEntry(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	parked := Waiter{Tenant: "acme", RequestID: "r1", Parked: true, Run: "run1", Subject: "buildq.requests.acme",
		Seq: 7, MsgTime: msgTime, Body: []byte(`{"x":1}`), Token: "tok"}
	if err := l.PutWaiter(ctx, buildA, parked); err != nil {
		t.Fatal(err)
	}
	l.AddWaiter(ctx, buildA, "acme", "r1")
	items, err := l.ListWaiters(ctx, buildA)
	if err != nil {
		t.Fatal(err)
	}
	if len(items[buildA]) != 1 || !items[buildA][0].V.Parked || items[buildA][0].V.Token != "tok" {
		t.Fatalf("after AddWaiter the entry is %+v, want the parked one", items[buildA])
	}
	// A request with no entry gets a plain one.
	l.AddWaiter(ctx, buildA, "acme", "r2")
	items, err = l.ListWaiters(ctx, buildA)
	if err != nil || len(items[buildA]) != 2 {
		t.Fatalf("ListWaiters = %+v, %v; want two entries", items, err)
	}
}
