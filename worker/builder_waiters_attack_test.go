package worker

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// A claim that fails (a KV timeout) leaves no waiter index entry behind
// when the request's retry is answered from the index (a build finished
// meanwhile): the entry is written once the claim is made, not beside it.
//
// Origin: attack review of taking requests straight from intake; failed
// on 272503c (the entry went out beside the claim and was never dropped),
// fixed by writing it after the claim again.
func TestAttack_AFailedClaimLeavesNoWaiterEntry(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	tr := newTestRegistry(t)
	req := request("atk-waiter")
	key := v1.BuildKey(req, kanikoID)
	var failed atomic.Bool
	w1 := e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(), onCreate: func(k string, _ []byte) error {
			if k == key && failed.CompareAndSwap(false, true) {
				return nats.ErrTimeout
			}
			return nil
		}})
	})
	results := e.collect()
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the claim failed", failed.Load)
	// Meanwhile the key is built (another worker's build).
	repo := tr.host + "/acme/web"
	digest := tr.push(t, repo+":"+v1.DefaultTag(key))
	e.atkPutRecord(t, atkSucceeded(key, repo, digest, "acme"))
	r := results.waitFor(t, 1, 15*time.Second)[0]
	t.Logf("result %s", decision(r.Data))
	time.Sleep(time.Second)
	items, err := w1.w.ledger.ListWaiters(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range items[key] {
		t.Logf("waiter entry left: %s parked=%v", it.K, it.V.Parked)
	}
	if n := len(items[key]); n != 0 {
		t.Errorf("%d waiter entries left for a request answered from the cache", n)
	}
}
