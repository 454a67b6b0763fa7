package worker

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

func TestMetricsCountResults(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	e.startWorker("w1", func(c *Config) { c.Metrics = m })
	results := e.collect()

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
}
