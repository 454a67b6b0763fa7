package worker

// Metrics (metrics.go): results counted by status, origin and reason,
// readiness, queue wait, and per tenant the requests queued, the builds
// running and the requests parked.

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// Origin: kaniko Job hardening, cancel and metrics (dfb1424).
func TestMetricsCountResults(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	if testutil.ToFloat64(m.ready) != 0 {
		t.Fatal("buildq_worker_ready is 1 before the worker runs")
	}
	w := e.startWorker("w1", func(c *Config) { c.Metrics = m })
	results := e.collect()
	eventually(t, 5*time.Second, "buildq_worker_ready 1", func() bool { return testutil.ToFloat64(m.ready) == 1 })

	ok, bad := request("metrics-ok"), request("metrics-bad")
	for _, r := range []*v1.Request{ok, bad} {
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(ok, "kaniko@"+testKaniko.ExecutorImage))), 0, digestOf("m"))
	e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(bad, "kaniko@"+testKaniko.ExecutorImage))), 1, "error building image: boom")
	results.waitFor(t, 2, 10*time.Second)
	eventually(t, 5*time.Second, "counters", func() bool {
		return testutil.ToFloat64(m.results.WithLabelValues("succeeded", "build", "")) == 1 &&
			testutil.ToFloat64(m.results.WithLabelValues("failed", "build", v1.ReasonBuildFailed)) == 1 &&
			testutil.ToFloat64(m.inFlight) == 0
	})
	if n := testutil.CollectAndCount(m.queueWait); n != 1 {
		t.Errorf("queue wait histogram: %d series", n)
	}
	w.stop(t)
	if testutil.ToFloat64(m.ready) != 0 {
		t.Error("buildq_worker_ready is still 1 after the worker stopped")
	}
}

// The per-tenant metrics: requests queued, builds running, requests
// parked on builds in progress.
//
// Origin: per-tenant metrics (245cf5d).
func TestMetricsPerTenant(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	w := e.startWorker("w1", func(c *Config) { c.Metrics = m; c.Lease = time.Second })
	results := e.collect()
	ctx := context.Background()
	acme := request("metrics-tenant")
	if _, err := e.pub.Publish(ctx, acme); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(acme, "kaniko@"+testKaniko.ExecutorImage)))
	if _, err := e.pub.Publish(ctx, request("metrics-tenant")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's build running, one request parked", func() bool {
		w.w.park.sweepWaiters(ctx)
		return testutil.ToFloat64(m.running.WithLabelValues("acme")) == 1 && testutil.ToFloat64(m.parkedNow) == 1
	})
	globex := request("metrics-globex")
	globex.Tenant = "globex"
	globex.Source.S3.Key = "contexts/globex/sha256/" + hex64("metrics-globex") + ".tar.gz"
	if _, err := e.pub.Publish(ctx, globex); err != nil {
		t.Fatal(err)
	}
	gjob := e.waitJob(kaniko.JobName(v1.BuildKey(globex, "kaniko@"+testKaniko.ExecutorImage)))
	// Stored per tenant: acme's owner (the parked one is acked), globex's.
	eventually(t, 10*time.Second, "the queue counted per tenant", func() bool {
		w.w.countQueued(ctx)
		return testutil.ToFloat64(m.queued.WithLabelValues("globex")) == 1 && testutil.ToFloat64(m.queued.WithLabelValues("acme")) == 1 &&
			testutil.ToFloat64(m.running.WithLabelValues("globex")) == 1
	})
	e.kubelet(job, 0, digestOf("metrics-tenant"))
	e.kubelet(gjob, 0, digestOf("metrics-globex"))
	results.waitFor(t, 3, 10*time.Second)
	eventually(t, 10*time.Second, "the builds ended, nothing parked or queued", func() bool {
		w.w.park.sweepWaiters(ctx)
		w.w.countQueued(ctx)
		return testutil.ToFloat64(m.running.WithLabelValues("acme")) == 0 && testutil.ToFloat64(m.parkedNow) == 0 &&
			testutil.CollectAndCount(m.queued) == 0
	})
	if n := testutil.CollectAndCount(m.queueWait); n != 2 {
		t.Errorf("queue wait: %d series, want one per tenant", n)
	}
}
