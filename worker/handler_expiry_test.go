package worker

// Handler (handle.go, ttl.go): --queue-ttl. A request first taken later
// than the TTL after it was stored is answered failed/Expired without a
// Job; a redelivery is not expired, and the age is judged on the server's
// clock (docs/design.md §2 step 2, §6).

import (
	"context"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
func TestQueueTTL(t *testing.T) {
	t.Parallel()

	t.Run("request older than the TTL expires without a job", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		const ttl = time.Second
		// The streams exist before the worker starts, as after an outage.
		if _, _, err := EnsureStreams(context.Background(), e.js, testConfig("setup")); err != nil {
			t.Fatal(err)
		}
		req := request("stale")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		// The request must outlive the TTL in the queue: only time does that.
		time.Sleep(ttl + 200*time.Millisecond)
		e.startWorker("w1", func(c *Config) { c.QueueTTL = ttl })
		results := e.collect()

		r := results.waitFor(t, 1, 10*time.Second)[0]
		key := v1.BuildKey(req, kanikoID)
		if r.ID != req.RequestID || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonExpired {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if !strings.Contains(r.Data.Message, "longer than the queue TTL of 1s") || r.Data.Key != key {
			t.Errorf("message %q key %q", r.Data.Message, r.Data.Key)
		}
		if r.Data.Timings.QueueWaitMs < ttl.Milliseconds() {
			t.Errorf("queue wait %dms, want more than the TTL", r.Data.Timings.QueueWaitMs)
		}
		eventually(t, 5*time.Second, "request terminated", func() bool {
			msgs, pending, _ := e.streamState()
			return msgs == 0 && pending == 0
		})
		if c := e.creates.total(); c != 0 {
			t.Errorf("%d jobs created for an expired request", c)
		}
		if rec := e.claim(key); rec != nil {
			t.Errorf("an expired request claimed its key: %+v", rec)
		}
		time.Sleep(200 * time.Millisecond)
		if n := len(results.snapshot()); n != 1 {
			t.Errorf("%d results, want 1", n)
		}
	})

	t.Run("request within the TTL is built", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.startWorker("w1", func(c *Config) { c.QueueTTL = time.Minute })
		results := e.collect()
		req := request("fresh")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID))), 0, digestOf("fresh"))
		r := results.waitFor(t, 1, 10*time.Second)[0]
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	})

	t.Run("redelivery after the TTL is not expired", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		const ttl = time.Second
		// The first delivery is taken in time but fails transiently; the
		// retry comes after retryDelay(1) = 2s, past the TTL.
		e.failJobCreates(func(n int64) bool { return n == 1 })
		e.startWorker("w1", func(c *Config) { c.QueueTTL = ttl })
		results := e.collect()
		req := request("retried")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID))), 0, digestOf("retried"))
		r := results.waitFor(t, 1, 15*time.Second)[0]
		if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if r.Data.Timings.QueueWaitMs <= ttl.Milliseconds() {
			t.Errorf("queue wait %dms: the redelivery came before the TTL, the test proves nothing", r.Data.Timings.QueueWaitMs)
		}
	})

	t.Run("negative TTL is refused", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig("w1")
		cfg.QueueTTL = -time.Second
		err := cfg.WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), "queue TTL") {
			t.Fatalf("Validate() = %v, want a queue TTL error", err)
		}
	})
}

// A worker whose clock is 5 minutes ahead refused a fresh request Expired
// (queue TTL 1 minute); one 5 minutes behind built a request that had
// waited past its queue TTL of 1 s.
//
// Origin: issue 24, defect 5 (--queue-ttl compared the worker's clock with the server's).
func TestQueueTTLIsJudgedOnTheServersClock(t *testing.T) {
	t.Parallel()
	t.Run("a worker ahead does not expire a fresh request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.startWorker("w1", func(c *Config) {
			c.QueueTTL = time.Minute
			c.Now = func() time.Time { return time.Now().Add(5 * time.Minute) }
		})
		results := e.collect()
		req := request("i24-fresh-ahead")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			if got := results.snapshot(); len(got) > 0 {
				t.Fatalf("a fresh request was answered %s/%s: %q", got[0].Data.Status, got[0].Data.Reason, got[0].Data.Message)
			}
			if _, ok := e.jobs()[kaniko.JobName(v1.BuildKey(req, kanikoID))]; ok {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatal("the fresh request was not built")
	})
	t.Run("a worker behind expires a stale request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		const ttl = time.Second
		if _, _, err := EnsureStreams(context.Background(), e.js, testConfig("setup")); err != nil {
			t.Fatal(err)
		}
		req := request("i24-stale-behind")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		time.Sleep(ttl + 500*time.Millisecond)
		e.startWorker("w1", func(c *Config) {
			c.QueueTTL = ttl
			c.Now = func() time.Time { return time.Now().Add(-5 * time.Minute) }
		})
		results := e.collect()
		r := results.waitFor(t, 1, 10*time.Second)[0]
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonExpired {
			t.Fatalf("a request past its queue TTL was answered %s", mustJSON(t, r))
		}
		if n := e.creates.total(); n != 0 {
			t.Fatalf("%d Jobs created for an expired request", n)
		}
	})
}
