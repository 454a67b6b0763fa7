package ledger

import (
	"testing"
	"time"
)

func TestAPendingMarkNamesTheFirstRequestUntilItAges(t *testing.T) {
	w := newWorld(t)
	l := w.ledger("w1", newClock(), time.Minute)
	ctx := t.Context()
	first := Pending{Tenant: "acme", RequestID: "r1", Priority: "normal"}
	second := Pending{Tenant: "acme", RequestID: "r2", Priority: "high"}

	mine, cur, err := l.MarkPending(ctx, buildA, first, time.Hour)
	if err != nil || !mine || cur != first {
		t.Fatalf("first mark: mine %v, cur %+v, err %v; want it written, naming r1", mine, cur, err)
	}
	mine, cur, err = l.MarkPending(ctx, buildA, second, time.Hour)
	if err != nil || mine || cur != first {
		t.Fatalf("second request: mine %v, cur %+v, err %v; want the first mark standing", mine, cur, err)
	}
	// Another key has its own mark.
	if mine, _, err := l.MarkPending(ctx, buildB, second, time.Hour); err != nil || !mine {
		t.Fatalf("another key's first mark: mine %v, err %v", mine, err)
	}
	// A mark older than its freshness is taken over by the next request.
	time.Sleep(20 * time.Millisecond)
	mine, cur, err = l.MarkPending(ctx, buildA, second, 10*time.Millisecond)
	if err != nil || !mine || cur != second {
		t.Fatalf("aged mark: mine %v, cur %+v, err %v; want it taken over by r2", mine, cur, err)
	}
	if _, cur, _ := l.MarkPending(ctx, buildA, first, time.Hour); cur != second {
		t.Fatalf("after the take-over the mark names %+v, want r2", cur)
	}
	// A mark that does not read as one is taken over too.
	if _, err := w.kv.Put(ctx, PendingKey(buildB), []byte("???")); err != nil {
		t.Fatal(err)
	}
	if mine, cur, err := l.MarkPending(ctx, buildB, first, time.Hour); err != nil || !mine || cur != first {
		t.Fatalf("unreadable mark: mine %v, cur %+v, err %v; want it taken over", mine, cur, err)
	}
}
