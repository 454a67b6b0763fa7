package worker

// Fair queue (worker/internal/fairq), concurrency slots: a tenant never
// runs more builds than its limit, across workers, through lost replies,
// workers with different leases and NATS outages (docs/design.md §2d). A
// review's test tells the attack as it worked before its fix; it asserts
// the fixed outcome.

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// A tenant's concurrency limit holds across workers: acme, limited to 2,
// never runs a third build while 3 workers have free slots; it waits
// (no failure, no redelivery) and its next request starts when one ends.
// Another tenant is not held back by it.
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
func TestConcurrencyLimitIsExactAcrossWorkers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for i := range 3 {
		e.startWorker(fmt.Sprintf("w%d", i), func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = 3
			c.Fair.Concurrency = map[string]int{"acme": 2}
		})
	}
	results := e.collect()
	ctx := context.Background()
	names := map[string]string{}
	for i := range 6 {
		r := tenantRequest("acme", fmt.Sprint("limit-", i))
		names[jobOf(r)] = "acme"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		r := tenantRequest("globex", fmt.Sprint("free-", i))
		names[jobOf(r)] = "globex"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "acme 2 and globex 3 running", func() bool {
		got := e.running(names)
		return got["acme"] == 2 && got["globex"] == 3
	})
	for range 20 { // it stays at the limit
		if got := e.running(names); got["acme"] > 2 {
			t.Fatalf("acme runs %d builds, its limit is 2", got["acme"])
		}
		time.Sleep(50 * time.Millisecond)
	}
	// One ends: the next starts, and acme is still at 2.
	var ended string
	for n, j := range e.jobs() {
		if names[n] == "acme" {
			ended = n
			e.kubelet(j, 0, tr.push(t, destination(j)))
			break
		}
	}
	eventually(t, 10*time.Second, "acme's next build", func() bool {
		js := e.jobs()
		_, still := js[ended]
		return !still && e.running(names)["acme"] == 2
	})
	if got := results.snapshot(); len(got) != 1 || got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("results %+v, want the one finished build's", got)
	}
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d requests redelivered: a tenant at its limit must not burn deliveries", redelivered)
	}
}

// NATS hiccup during a slot renewal. renewSlot does
// Update(key, val, s.rev) and keeps s.rev when it gets an error. When the
// server applied the update but the reply was lost (a timeout, the
// connection dropping during a NATS restart), the key's revision is newer
// than s.rev: every later renewal fails with "wrong last sequence", forever,
// and the worker only logs it. The key ages out one lease later while the
// build still runs, and any dispatcher takes the same slot for the tenant's
// next request: acme (limit 1) runs two builds, with no worker paused.
// (The same happens after a NATS outage longer than 2/3 of the lease: the
// key expires at the restart and renewal never re-creates it.)
// Here the lost reply is played by writing the slot's key once with the
// same value, as the applied renewal would have.
//
// Origin: first adversarial review of fair queueing; failed on 1f09732, fixed by db0cecb.
func TestSlotRenewalWithALostReplyKeepsTheLimit(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 1}
	})
	ctx := context.Background()
	names := map[string]string{}
	for i := range 2 {
		r := tenantRequest("acme", fmt.Sprint("renew-", i))
		names[jobOf(r)] = "acme"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			e.waitJob(jobOf(r))
		}
	}
	kv, err := e.js.KeyValue(ctx, v1.SlotsBucket)
	if err != nil {
		t.Fatal(err)
	}
	var holder []byte
	eventually(t, 5*time.Second, "acme's slot", func() bool {
		en, err := kv.Get(ctx, "acme.0")
		if err != nil {
			return false
		}
		holder = en.Value()
		return true
	})
	// The renewal the server applied and whose reply never came back.
	if _, err := kv.Put(ctx, "acme.0", holder); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.running(names)["acme"]; n > 1 {
			t.Fatalf("acme runs %d builds at once, its concurrency limit is 1 (no worker was paused)", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// w1 (lease 6 s, renewing its slot every 2 s) runs acme's r1; w2 starts
// with a lease of 1 s and set the slots bucket's TTL to it: w1's key aged
// out between its renewals and w2 took the slot for r2, nobody paused or
// killed.
//
// Origin: issue 24, defect 4 (the slots bucket's TTL was the last starting worker's lease).
func TestSlotExpiryIsTheHoldersLeaseNotTheBuckets(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(lease time.Duration) func(*Config) {
		return func(c *Config) {
			withRegistry(tr)(c)
			c.Lease = lease
			c.Fair.Concurrency = map[string]int{"acme": 1}
		}
	}
	e.startWorker("w1", limit(6*time.Second))
	ctx := context.Background()
	names := map[string]string{}
	r1 := tenantRequest("acme", "i24-long-lease")
	names[jobOf(r1)] = "acme"
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	e.startWorker("w2", limit(time.Second))
	r2 := tenantRequest("acme", "i24-short-lease")
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	neverTwoAtOnce(t, e, names, 8*time.Second, "w1's live slot expired by w2's lease")
	j1 := e.jobs()[jobOf(r1)]
	e.kubelet(j1, 0, tr.push(t, destination(j1)))
	e.waitJob(jobOf(r2))
}

// w1 runs acme's r1 (limit 1). NATS is down for 3 s, longer than the
// 2 s lease, and w1's first slot renewals after it fail (its KV answers
// late). The slot key expired at the restart (the bucket's TTL): w2's
// dispatcher created it again and ran r2 while r1's build went on.
//
// Origin: issue 24, a suspicion its review raised (slots lost while NATS is down longer than the lease).
func TestSlotSurvivesANATSOutageLongerThanTheLease(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var blocked atomic.Bool
	fail := func() error {
		if blocked.Load() {
			return nats.ErrTimeout
		}
		return nil
	}
	limit := func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 1}
	}
	e.startWorkerHooked("w1", limit, nil, func(w *Worker) {
		w.fq.UseSlots(&hookedKV{KeyValue: w.fq.Slots(),
			onGet:    func(context.Context, string) error { return fail() },
			onCreate: func(string, []byte) error { return fail() },
			onUpdate: func(string, []byte) error { return fail() }})
	})
	r1, _, names := holderAndNext(t, e, "i24-outage-holder", "i24-outage-next", func() { e.startWorker("w2", limit) })
	time.Sleep(500 * time.Millisecond)
	blocked.Store(true)
	if err := e.world.nats.Restart(3 * time.Second); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(4 * time.Second) // w1 recovers after the others reconnected
		blocked.Store(false)
	}()
	neverTwoAtOnce(t, e, names, 10*time.Second, "the slot was taken by another dispatcher after a NATS outage longer than the lease")
	if _, ok := e.jobs()[jobOf(r1)]; !ok {
		t.Fatal("premise: r1's Job is gone")
	}
}
