package worker

// Image indexes and concurrency slots (fairq.ExtraSlots): a tenant's
// Jobs never outnumber its limit, whatever stops the index's handler.
// Part of the multi-platform attack review (platforms_attack_test.go).

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// Found: a worker stopped (a rolling update) while an image index builds
// its platforms on its own slot and an extra one. The handler hands the
// request back and keeps its own slot for it, but takePlatformSlots'
// extra slots are released (slots.close) although the platforms' Jobs run
// on in the cluster, let go to be taken over. Another request of the
// tenant takes the freed slot and creates its Job: acme runs three
// builds with a limit of 2.
// Fixed: extra slots are fairq.ExtraSlots of the dispatched request, kept
// (handed back) with its own slot when the handler stops or retries, and
// free only once the request is finished.
func TestAttack_IndexExtraSlotIsKeptWhileItsPlatformJobRunsAfterShutdown(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 2}
	}
	w1 := e.startWorker("w1", limit)
	ctx := context.Background()
	idx := multiRequest("extra-slot-shutdown", "linux/amd64", "linux/arm64")
	idx.RequestID = "index"
	names := platformJobNames(idx, nil)
	if _, err := e.pub.Publish(ctx, idx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "both platforms' Jobs, on the index's two slots", func() bool { return e.unfinishedJobs(names)["acme"] == 2 })
	e.startWorker("w2", limit)
	next := tenantRequest("acme", "extra-slot-next")
	next.RequestID = "next"
	next.Priority = v1.PriorityHigh
	names[jobOf(next)] = "acme"
	if _, err := e.pub.Publish(ctx, next); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	time.Sleep(300 * time.Millisecond)
	if n := e.unfinishedJobs(names)["acme"]; n != 2 {
		t.Fatalf("acme runs %d builds before the shutdown, want 2", n)
	}
	w1.stop(t)
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.unfinishedJobs(names)["acme"]; n > 2 {
			dumpSlots(t, e)
			t.Fatalf("acme runs %d builds at once (the index's two platforms, handed back and running on, and %s), its concurrency limit is 2",
				n, jobOf(next))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// dumpSlots logs the concurrency slots' keys, for a failure's diagnosis.
func dumpSlots(t *testing.T, e *env) {
	t.Helper()
	kv, err := e.js.KeyValue(context.Background(), v1.SlotsBucket)
	if err != nil {
		t.Log(err)
		return
	}
	keys, _ := kv.Keys(context.Background())
	for _, k := range keys {
		en, err := kv.Get(context.Background(), k)
		if err == nil {
			t.Logf("slot %s rev %d: %s", k, en.Revision(), en.Value())
		}
	}
}

// Found: fairq.Queue.ExtraSlot names the request it is taken for by the
// handler's message — fairq's queuedMsg, whose Subject and Metadata are
// the intake message's (buildq.requests.<tenant>, its BUILDQ_REQUESTS
// sequence) — not by its BUILDQ_QUEUE subject and sequence as the
// request's own slot does. Killed with its worker, the extra slot lapses
// and is judged by a queue sequence that is not its request's: here none
// (two requests of another tenant refused at intake put the sequences
// apart), so it is freed at once while the platform Job it was taken for
// runs on, and another request of the tenant takes it: three builds with
// a limit of 2.
// Fixed: the dispatcher hands the handler ExtraSlots naming the queue
// subject and sequence its own slot names.
func TestAttack_KilledIndexExtraSlotIsKeptForItsRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	cfg := func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 4
		c.Fair.Concurrency = map[string]int{"acme": 2}
		c.Fair.QueueLimit = map[string]int{"globex": 1}
		// The killed handler's request is redelivered only after the
		// window below: its slots are judged while it waits in the queue.
		c.AckWait = 30 * time.Second
	}
	w1 := e.startWorker("w1", cfg)
	results := e.collect()
	ctx := context.Background()
	// globex's first request is queued (its Job runs); its next two are
	// refused at intake: BUILDQ_REQUESTS is two sequences ahead of
	// BUILDQ_QUEUE from here on.
	g := tenantRequest("globex", "queued")
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(g))
	for i := range 2 {
		r := tenantRequest("globex", fmt.Sprint("refused-", i))
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if d := oneResult(t, results, r.RequestID).Data; d.Reason != v1.ReasonQuotaExceeded {
			t.Fatalf("premise: globex's request %d: %+v, want refused", i, d)
		}
	}
	idx := multiRequest("extra-slot-killed", "linux/amd64", "linux/arm64")
	idx.RequestID = "index"
	names := platformJobNames(idx, nil)
	if _, err := e.pub.Publish(ctx, idx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "both platforms' Jobs, on the index's two slots", func() bool { return e.unfinishedJobs(names)["acme"] == 2 })
	next := tenantRequest("acme", "extra-slot-killed-next")
	next.RequestID = "next"
	names[jobOf(next)] = "acme"
	if _, err := e.pub.Publish(ctx, next); err != nil {
		t.Fatal(err)
	}
	e.startWorker("w2", cfg)
	time.Sleep(500 * time.Millisecond)
	if n := e.unfinishedJobs(names)["acme"]; n != 2 {
		t.Fatalf("acme runs %d builds before the kill, want 2", n)
	}
	killWorker(w1)
	// Past the lease (2 s) and its lapse (1.5 leases), well before the
	// index's redelivery (AckWait 30 s).
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.unfinishedJobs(names)["acme"]; n > 2 {
			dumpSlots(t, e)
			t.Fatalf("acme runs %d builds at once (the index's two platforms, running on after the kill, and %s), its concurrency limit is 2",
				n, jobOf(next))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// An index of the most platforms a request may name (8) at a tenant limit
// of 3: every platform is built, never more than 3 at once, and the
// result lists all 8 (the extra slots are taken and given back as the
// platforms left shrink).
func TestIndexOfEightPlatformsStaysWithinTheLimitAndListsEveryPlatform(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 3}
	})
	results := e.collect()
	plats := []string{"linux/amd64", "linux/arm64", "linux/arm/v7", "linux/arm/v6", "linux/386", "linux/ppc64le", "linux/s390x", "linux/riscv64"}
	r := multiRequest("eight", plats...)
	r.RequestID = "eight"
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	names := platformJobNames(r, nil)
	done := map[string]bool{}
	deadline := time.Now().Add(60 * time.Second)
	peak := 0
	for len(byID(results.snapshot())[r.RequestID]) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no result within 60 s")
		}
		n := e.unfinishedJobs(names)["acme"]
		if n > 3 {
			t.Fatalf("acme runs %d platform builds at once, its limit is 3", n)
		}
		peak = max(peak, n)
		if n == 3 || (n > 0 && len(done) >= 6) {
			e.finishJobs(t, tr, names, done)
		}
		time.Sleep(50 * time.Millisecond)
	}
	d := oneResult(t, results, r.RequestID).Data
	if d.Status != v1.StatusSucceeded || len(d.Platforms) != 8 || e.creates.total() != 8 {
		t.Fatalf("result %s after %d Jobs, want 8 platforms built once each", mustJSON(t, d), e.creates.total())
	}
	if peak != 3 {
		t.Fatalf("at most %d platform builds ran at once, want the tenant's 3", peak)
	}
	idx, err := tr.client.IndexPlatforms(context.Background(), d.Image)
	if err != nil || len(idx) != 8 {
		t.Fatalf("the index at %s: %v %v", d.Image, idx, err)
	}
}

// Found: the same escape without a shutdown. A platform's Job create
// fails (a 500 from the API server: transient) while the index's other
// platforms' Jobs run: buildIndex stops its platform builds, which let
// their runs go with their Jobs running on, and the request is retried
// after a delay. dispatched() keeps the request's own slot for the retry
// (handBack), but slots.close() releases the extra slots at once: two
// other requests of the tenant take them, and acme runs four builds with
// a limit of 3.
// Fixed as the shutdown case: a retried request keeps its extras too.
func TestAttack_RetriedIndexKeepsItsExtraSlotsWhileItsPlatformJobsRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	// The third Job create is held until the test lets it go, and then
	// fails.
	var creates atomic.Int64
	release := make(chan struct{})
	held := make(chan struct{})
	slow := slowCreates{Interface: e.kube, hold: func() {
		if creates.Add(1) == 3 {
			close(held)
			<-release
		}
	}}
	e.failJobCreates(func(n int64) bool { return n == 3 })
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 6
		c.Fair.Concurrency = map[string]int{"acme": 3}
	}, slow, nil)
	ctx := context.Background()
	idx := multiRequest("retried-index", "linux/amd64", "linux/arm64", "linux/386")
	idx.RequestID = "index"
	names := platformJobNames(idx, nil)
	if _, err := e.pub.Publish(ctx, idx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the index never created its third platform's Job")
	}
	eventually(t, 30*time.Second, "two platforms' Jobs", func() bool { return e.unfinishedJobs(names)["acme"] == 2 })
	for i := range 2 {
		r := tenantRequest("acme", fmt.Sprint("after-retried-index-", i))
		r.Priority = v1.PriorityHigh
		names[jobOf(r)] = "acme"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	e.waitAdmitted(3)
	close(release)
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		if n := e.unfinishedJobs(names)["acme"]; n > 3 {
			dumpSlots(t, e)
			t.Fatalf("acme runs %d builds at once (two platforms of the index retried after a transient failure, running on, and the requests that took its extra slots), its concurrency limit is 3", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Limits rule: two indexes sharing a platform at a tenant limit of 1, on
// two workers: neither deadlocks (the one holding the slot builds its
// platforms one by one, the other waits in the queue), the shared one is
// built once, and never two Jobs at once.
func TestTwoIndexesAtLimitOneNeitherDeadlockNorExceedIt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	limit := func(c *Config) {
		withRegistry(tr)(c)
		c.Fair.Concurrency = map[string]int{"acme": 1}
	}
	e.startWorker("w1", limit)
	e.startWorker("w2", limit)
	results := e.collect()
	ctx := context.Background()
	a := multiRequest("limit-one-two", "linux/amd64", "linux/arm64")
	a.RequestID = "a"
	b := multiRequest("limit-one-two", "linux/amd64", "linux/386")
	b.RequestID = "b"
	names := platformJobNames(b, platformJobNames(a, nil))
	for _, r := range []*v1.Request{a, b} {
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	done := map[string]bool{}
	deadline := time.Now().Add(60 * time.Second)
	for len(byID(results.snapshot())[a.RequestID]) == 0 || len(byID(results.snapshot())[b.RequestID]) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("results within 60 s: %s", mustJSON(t, results.snapshot()))
		}
		n := e.unfinishedJobs(names)["acme"]
		if n > 1 {
			t.Fatalf("acme runs %d builds at once, its limit is 1", n)
		}
		if n == 1 {
			time.Sleep(200 * time.Millisecond)
			if n := e.unfinishedJobs(names)["acme"]; n > 1 {
				t.Fatalf("acme runs %d builds at once, its limit is 1", n)
			}
			e.finishJobs(t, tr, names, done)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, r := range []*v1.Request{a, b} {
		if d := oneResult(t, results, r.RequestID).Data; d.Status != v1.StatusSucceeded || len(d.Platforms) != 2 {
			t.Fatalf("%s: %+v", r.RequestID, d)
		}
	}
	if n := e.creates.total(); n != 3 {
		t.Fatalf("%d Jobs created, want 3 (linux/amd64 once)", n)
	}
}
