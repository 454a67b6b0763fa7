//go:build integration && benche2e

package integration

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/registry"
)

// registryProxy puts a proxy that delays every request by d in front of
// the registry and points the suite's workers and Jobs at it.
func (s *suite) registryProxy(d time.Duration) {
	s.t.Helper()
	reg := startFaultProxy(s.t, "http://"+shared.registryHost)
	reg.setDelay(d)
	cfg, err := registry.DockerConfigJSON(reg.addr, shared.registryUser, shared.registryPass)
	if err != nil {
		s.t.Fatal(err)
	}
	cfgPath := filepath.Join(s.t.TempDir(), "config.json")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		s.t.Fatal(err)
	}
	if _, err := shared.kube.CoreV1().Secrets(s.ns).Create(context.Background(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry-proxy", Namespace: s.ns}, Type: corev1.SecretTypeDockerConfigJson,
		Data: map[string][]byte{corev1.DockerConfigJsonKey: cfg}}, metav1.CreateOptions{}); err != nil {
		s.t.Fatal(err)
	}
	s.workerArgs = append(s.workerArgs, "--registry", reg.addr, "--insecure-registry", reg.addr,
		"--registry-config", cfgPath, "--registry-secret", "buildq-registry-proxy")
}

// TestBenchE2EScaleOut measures P5: builds per second with 1, 2 and 3
// workers, each running at most two builds, the registry 20 ms away.
func TestBenchE2EScaleOut(t *testing.T) {
	start := time.Now()
	const (
		perRound  = 24
		inFlight  = "2"
		buildTime = time.Second
	)
	s := newSuite(t, options{faults: func(*corev1.Pod) fault { return fault{duration: buildTime} }})
	s.registryProxy(20 * time.Millisecond)
	src := s.benchSource()
	results := s.resultClock()
	var rows []benchfmt.Row
	var pts []benchfmt.Point
	var one float64
	met := false
	for n := 1; n <= 3; n++ {
		var ws []*benchWorker
		for i := range n {
			ws = append(ws, s.startBenchWorker(fmt.Sprintf("scale-%d-%d", n, i), "--max-in-flight", inFlight))
		}
		var ids []string
		t0 := time.Now()
		for i := range perRound {
			req := src.request("scale", fmt.Sprintf("%d-%d", n, i))
			src.publish(req)
			ids = append(ids, req.RequestID)
		}
		results.wait(t, ids, 5*time.Minute)
		results.check(t, ids)
		var last time.Time
		for _, id := range ids {
			if a := results.arrival(id); a.After(last) {
				last = a
			}
		}
		rate := perRound / last.Sub(t0).Seconds()
		if n == 1 {
			one = rate
		}
		rows = append(rows, benchfmt.Compared(fmt.Sprintf("P5 builds/s with %d worker(s)", n), "builds/s", rate, one))
		pts = append(pts, benchfmt.Point{X: float64(n), Y: rate})
		met = n == 3 && rate >= 2.7*one
		for _, w := range ws {
			w.stop(t, syscall.SIGTERM)
		}
	}
	writeResult(t, benchfmt.Result{ID: "P5", Title: "throughput with 1, 2, 3 workers, 20 ms registry latency injected",
		Baseline: "1 worker", Rows: rows, Goal: "3 workers ≥ 2.7× one", Met: benchfmt.Bool(met), Seconds: time.Since(start).Seconds(),
		Notes:  []string{fmt.Sprintf("%d distinct builds per round of %v each (the kubelet emulator's build time), --max-in-flight %s per worker; the worker and the build Pods reach the registry through a proxy that holds every request 20 ms", perRound, buildTime, inFlight)},
		Series: []benchfmt.Series{{Name: "P5 buildq builds/s", XLabel: "workers", YLabel: "builds/s", Points: pts}}})
}

// TestBenchE2EBacklog measures P8: 10,000 queued requests over 1,000 keys
// taken by 3 workers — each answered once, exactly one Job per key — with
// the workers' peak RSS and API requests per build.
func TestBenchE2EBacklog(t *testing.T) {
	start := time.Now()
	const (
		keys    = 1000
		perKey  = 10
		workers = 3
	)
	s := newSuite(t, options{})
	src := s.benchSource()
	results := s.resultClock()
	jobs := s.jobClock()
	// A worker creates the streams, then stops: the requests wait in
	// the queue until the three start.
	s.startBenchWorker("backlog-setup").stop(t, syscall.SIGTERM)
	var ids []string
	t0 := time.Now()
	for i := range keys * perKey {
		req := src.request("backlog", strconv.Itoa(i%keys))
		src.publish(req)
		ids = append(ids, req.RequestID)
	}
	publishS := time.Since(t0).Seconds()
	var ws []*benchWorker
	t1 := time.Now()
	for i := range workers {
		ws = append(ws, s.startBenchWorker(fmt.Sprintf("backlog-%d", i)))
	}
	results.wait(t, ids, 10*time.Minute)
	drain := time.Since(t1).Seconds()
	results.check(t, ids)
	eventually(t, 3*time.Minute, "every Job deleted", func() bool {
		n, d := jobs.buildqJobs()
		return n == d
	})
	created, _ := jobs.buildqJobs()
	if created != keys {
		t.Errorf("%d Jobs for %d keys, want exactly one each", created, keys)
	}
	calls := map[string]float64{}
	var maxRSS float64
	for _, w := range ws {
		for k, v := range w.kubeRequests(t) {
			calls[k] += v
		}
		maxRSS = max(maxRSS, benchfmt.RSSMiB(w.cmd.Process.Pid))
	}
	rows := []benchfmt.Row{
		benchfmt.Plain("P8 requests answered exactly once", "requests", float64(len(ids))),
		benchfmt.Plain("P8 Jobs created", "Jobs", float64(created)),
		benchfmt.Plain("P8 queue drained by 3 workers in", "s", drain),
		benchfmt.Plain("P8 answered per second", "req/s", float64(len(ids))/drain),
		benchfmt.Plain("P8 requests published in", "s", publishS),
		benchfmt.Plain("P8 worker peak RSS (largest of 3)", "MiB", maxRSS),
	}
	mutating := 0.0
	for _, k := range slices.Sorted(maps.Keys(calls)) {
		rows = append(rows, benchfmt.Plain("P8 "+k+" per build", "requests", calls[k]/keys))
		if v := verb(k); v != "get" && v != "list" {
			mutating += calls[k] / keys
		}
	}
	met := maxRSS < 150 && created == keys && !t.Failed()
	writeResult(t, benchfmt.Result{ID: "P8", Title: "10,000 queued requests over 1,000 keys, 3 workers",
		Rows: rows, Goal: "all answered once, exactly 1,000 Jobs, worker RSS < 150 MB", Met: benchfmt.Bool(met), Seconds: time.Since(start).Seconds(),
		Notes: []string{"the requests are queued before the workers start; the kubelet emulator runs every Pod's build for real (context from MinIO, local build, push)",
			fmt.Sprintf("API requests are the three workers' own, including their start-up LISTs; %.2f mutating requests per build", mutating)}})
}
