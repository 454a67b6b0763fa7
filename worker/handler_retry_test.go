package worker

// Handler (handle.go, process.go): the retry budget. --max-deliver bounds a
// request's transient failures, counted in the ledger, not its
// deliveries; past it the request fails once and is dead-lettered, and a
// hand-back on the last delivery is not stranded (docs/design.md §2, §4).

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
func TestTransientJobCreateErrors(t *testing.T) {
	t.Parallel()

	t.Run("failing every delivery gives up once and dead-letters the request", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		calls := e.failJobCreates(func(int64) bool { return true })
		e.startWorker("w1", func(c *Config) { c.MaxDeliver = 2 })
		results := e.collect()

		req := request("always-500")
		req.APIVersion, req.RequestID = v1.APIVersion, "req-always-500"
		payload, err := json.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, req.RequestID)
		m.Data = payload
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}

		r := results.waitFor(t, 1, 15*time.Second)[0]
		d := r.Data
		if r.ID != req.RequestID || d.Status != v1.StatusFailed || d.Reason != v1.ReasonInfrastructureError || d.Attempts != 2 {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		if !strings.Contains(d.Message, "gave up after 2 transient failures") || !strings.Contains(d.Message, "create job") {
			t.Errorf("message %q", d.Message)
		}
		eventually(t, 5*time.Second, "request terminated", func() bool {
			msgs, pending, _ := e.streamState()
			return msgs == 0 && pending == 0
		})
		var dl []*jetstream.RawStreamMsg
		eventually(t, 5*time.Second, "a dead letter", func() bool {
			dl = e.streamMsgs(v1.DeadLetterStream)
			return len(dl) > 0
		})
		time.Sleep(200 * time.Millisecond)
		dl = e.streamMsgs(v1.DeadLetterStream)
		if len(dl) != 1 {
			t.Fatalf("%d dead letters, want 1", len(dl))
		}
		if dl[0].Subject != v1.DeadLetterSubject("acme") || !bytes.Equal(dl[0].Data, payload) {
			t.Errorf("dead letter on %s: %s, want the original payload on %s", dl[0].Subject, dl[0].Data, v1.DeadLetterSubject("acme"))
		}
		h := dl[0].Header
		if h.Get("Buildq-Original-Msg-Id") != req.RequestID || !strings.HasPrefix(h.Get(v1.MsgIDHeader), "deadletter/") || h.Get("Buildq-Original-Subject") != v1.RequestSubject("acme") || !strings.Contains(h.Get("Buildq-Error"), "Internal error") {
			t.Errorf("dead letter headers %v", h)
		}
		if n := len(results.snapshot()); n != 1 {
			t.Errorf("%d results, want 1", n)
		}
		if n := calls.Load(); n != 2 {
			t.Errorf("%d job creations tried, want one per delivery (2)", n)
		}
		if c := e.creates.total(); c != 0 {
			t.Errorf("%d jobs created", c)
		}
		// The claim is let go, so the next request for the key builds at once.
		if rec := e.claim(r.Data.Key); rec == nil || rec.Owner != "" || !rec.LeaseUntil.IsZero() {
			t.Errorf("claim still held: %+v", rec)
		}
	})

	t.Run("failing the first delivery only succeeds on the redelivery", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		e.failJobCreates(func(n int64) bool { return n == 1 })
		e.startWorker("w1", func(c *Config) { c.MaxDeliver = 2 })
		results := e.collect()

		req := request("once-500")
		if _, err := e.pub.Publish(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
		e.kubelet(job, 0, digestOf("once"))
		r := results.waitFor(t, 1, 15*time.Second)[0]
		if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 || r.Data.Origin != v1.OriginBuild {
			t.Fatalf("result %s", mustJSON(t, r))
		}
		eventually(t, 5*time.Second, "request acked", func() bool {
			msgs, pending, _ := e.streamState()
			return msgs == 0 && pending == 0
		})
		if dl := e.streamMsgs(v1.DeadLetterStream); len(dl) != 0 {
			t.Errorf("%d dead letters for a request that succeeded", len(dl))
		}
		if c := e.creates.total(); c != 1 {
			t.Errorf("%d jobs created, want 1", c)
		}
	})
}

// --max-deliver bounds a request's transient failures, not its deliveries:
// hand-backs at shutdown (rolling restarts) and crashes redeliver too, and
// must not use the budget up.
//
// Origin: --max-deliver bounds transient failures, counted in the ledger, not deliveries (804cbcc).
func TestRetryBudgetCountsTransientFailuresNotDeliveries(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.startWorker("w1", func(c *Config) { c.MaxDeliver = 3 })
	w := r.w
	le, _, err := w.ledger.Open(context.Background(), "acme", "web", "budget", "", 1, time.Unix(1e9, 0))
	if err != nil {
		t.Fatal(err)
	}
	// The tenth delivery, after nine hand-backs: still the first failure.
	for i, want := range []bool{true, true, false} {
		if got := w.ledger.SpendRetry(context.Background(), le, 10, w.cfg.MaxDeliver); got != want {
			t.Fatalf("transient failure %d: retry = %v, want %v", i+1, got, want)
		}
	}
	if le.E.TransientFailures != 3 {
		t.Fatalf("ledger counts %d failures", le.E.TransientFailures)
	}
}

// A result that cannot be published is retried only up to MaxDeliver; then
// the request goes to the dead-letter stream instead of looping forever.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestUnpublishableResultIsDeadLetteredAfterMaxDeliver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	metrics := NewMetrics(prometheus.NewRegistry())
	e.startWorker("w1", func(c *Config) { c.MaxDeliver = 2; c.Metrics = metrics })
	if err := e.js.DeleteStream(context.Background(), v1.ResultsStream); err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(v1.RequestSubject("acme"))
	m.Header.Set(v1.MsgIDHeader, "unpublishable")
	m.Data = []byte(`{"requestId":"unpublishable"}`) // invalid: a quick verdict
	if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the request to leave the queue", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	dl := e.streamMsgs(v1.DeadLetterStream)
	if len(dl) != 1 || dl[0].Header.Get("Buildq-Original-Msg-Id") != "unpublishable" {
		t.Fatalf("dead letters: %d", len(dl))
	}
	if n := testutil.ToFloat64(metrics.dead); n != 1 {
		t.Fatalf("buildq_dead_letters_total %v, want 1", n)
	}
}

// Origin: stranded hand-backs and stale Job adoption (ebcc535).
func TestHandBackOnTheLastDeliveryIsNotStranded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", func(c *Config) { c.MaxDeliver = 1 })
	results := e.collect()
	req := request("last-delivery")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	w1.stop(t) // hands the request back on its only allowed delivery
	e.startWorker("w2", func(c *Config) { c.MaxDeliver = 1 })
	time.Sleep(300 * time.Millisecond)
	e.kubelet(job, 0, digestOf("not stranded"))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts != 2 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

// Origin: dedupe end to end (d7f9faf).
func TestRegistryErrorIsRetriedWithoutJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	tr.fail.Store(true)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	events := e.events()

	req := request("flaky-registry")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	// The 500 is never read as "exists" nor as "missing": no Job, and the
	// request is handed back for a later try (its message redelivered, or
	// — taken straight from intake the first time — queued), and taken
	// again.
	eventually(t, 15*time.Second, "a second try", func() bool { return events.count(req.RequestID, v1.PhaseQueued) >= 2 })
	if c := e.creates.total(); c != 0 {
		t.Fatalf("%d jobs created while the registry failed", c)
	}
	if n := len(results.snapshot()); n != 0 {
		t.Fatalf("%d results while the registry failed", n)
	}
	tr.fail.Store(false)
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts < 2 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}
