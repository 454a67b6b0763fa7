package worker

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// A parked request is requeued; the requeued message's read of its entry
// by requeue token (ByRequeueToken) fails on every delivery of its budget
// (a ledger outage), and the ledger works again at the give-up. The
// request must still get a result: its waiter entry is gone, and the
// requeued message is the only thing that stands for it.
//
// Expected: a result (failed/InfrastructureError, or the build's). The
// give-up path, which writes a result into the id's entry, takes the
// entry whose requeue token the message carries as its own. (From an
// attack: it compared stream sequences only, took the requeued message,
// a new one, for a duplicate and terminated it without a result.)
func TestARequeuedRequestGivenUpOnGetsItsResult(t *testing.T) {
	t.Parallel()
	e, tr, req, key, lk := requeueWorld(t, "atk5-requeue-given-up")
	var armed atomic.Bool
	var fails atomic.Int32
	r := e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.MaxDeliver = 2 }, nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onGet: func(_ context.Context, k string) error {
			// Both deliveries of the requeued message fail to read the
			// entry by token; the ledger works at the give-up.
			if k == lk && armed.Load() && calledFrom(".ByRequeueToken") && fails.Add(1) <= 2 {
				return nats.ErrTimeout
			}
			return nil
		}})
	})
	results := e.collect()
	putDeadRun(t, r.w, tr, key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	waitParked(t, r.w, key, req.RequestID)
	armed.Store(true)
	deadline := time.Now().Add(25 * time.Second)
	for time.Now().Before(deadline) {
		if rs := storedOf(results, "acme", req.RequestID); len(rs) > 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	ent := e.ledgerEntry("acme", req.RequestID)
	t.Fatalf("the requeued request got no result (ByRequeueToken failures: %d); its entry: %s", fails.Load(), mustJSON(t, ent))
}
