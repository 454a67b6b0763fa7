//go:build integration && benche2e

package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
)

// The end-to-end benchmarks of make bench-e2e (docs/benchmarks.md): buildq
// on the suite's real components, each figure against a baseline program
// measured in the same run. They print figures and write them with
// benchfmt; they assert only that nothing was lost, never a speed.

// benchWorker is a worker process with its metrics address.
type benchWorker struct {
	*workerProc
	id      string
	metrics string
}

// startBenchWorker starts a worker serving /metrics and waits until it is
// ready. extra flags come last and so win.
func (s *suite) startBenchWorker(id string, extra ...string) *benchWorker {
	s.t.Helper()
	addr := freeAddr()
	saved := s.workerArgs
	s.workerArgs = append(slices.Clone(saved), append([]string{"--metrics-addr", addr, "--pprof", "--log-level", "info"}, extra...)...)
	w := s.startWorker(id)
	s.workerArgs = saved
	eventually(s.t, time.Minute, "worker "+id+" ready", func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return &benchWorker{workerProc: w, id: id, metrics: addr}
}

// profile, when $BUILDQ_BENCH_PPROF names a directory, takes a CPU
// profile of the worker for d into <dir>/<name>.pprof and, halfway
// through, a dump of its goroutines (where requests wait: the worker is
// mostly waiting for round trips, which a CPU profile does not show) into
// <dir>/<name>.goroutines.txt, in the background (the worker runs with
// --pprof).
func (w *benchWorker) profile(t *testing.T, name string, d time.Duration) {
	dir := os.Getenv("BUILDQ_BENCH_PPROF")
	if dir == "" {
		return
	}
	go func() {
		for i := range 4 {
			time.Sleep(d / 6)
			resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/goroutine?debug=1", w.metrics))
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				_ = os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s.goroutines-%d.txt", name, i)), b, 0o644)
			}
		}
	}()
	go w.save(t, "CPU profile", fmt.Sprintf("profile?seconds=%d", int(d.Seconds())), filepath.Join(dir, name+".pprof"))
}

// save fetches the worker's /debug/pprof/<query> into path.
func (w *benchWorker) save(t *testing.T, what, query, path string) {
	resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/%s", w.metrics, query))
	if err != nil {
		t.Logf("%s of worker %s: %v", what, w.id, err)
		return
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if err := os.WriteFile(path, b, 0o644); err == nil {
		t.Logf("%s of worker %s: %s", what, w.id, path)
	}
}

// traceExec, when $BUILDQ_BENCH_PPROF names a directory, takes an
// execution trace of the worker for d into <dir>/<name>.trace, in the
// background: where a request's wall time goes between round trips
// (goroutines runnable but not running, threads woken), which neither a
// CPU profile nor a goroutine dump shows. Read it with go tool trace, or
// go tool trace -pprof=sched for the scheduling delays alone.
func (w *benchWorker) traceExec(t *testing.T, name string, d time.Duration) {
	dir := os.Getenv("BUILDQ_BENCH_PPROF")
	if dir == "" {
		return
	}
	go w.save(t, "execution trace", fmt.Sprintf("trace?seconds=%d", int(d.Seconds())), filepath.Join(dir, name+".trace"))
}

func (w *benchWorker) stop(t *testing.T, sig syscall.Signal) {
	t.Helper()
	_ = w.cmd.Process.Signal(sig)
	select {
	case <-w.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("worker %s did not exit after %v", w.id, sig)
	}
}

var kubeRequestLine = regexp.MustCompile(`^buildq_kube_requests_total\{resource="([^"]*)",verb="([^"]*)"\} (\S+)$`)

// kubeRequests scrapes the worker's buildq_kube_requests_total by
// "VERB resource".
func (w *benchWorker) kubeRequests(t *testing.T) map[string]float64 {
	t.Helper()
	resp, err := http.Get("http://" + w.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if m := kubeRequestLine.FindStringSubmatch(sc.Text()); m != nil {
			v, _ := strconv.ParseFloat(m[3], 64)
			out[m[2]+" "+m[1]] = v
		}
	}
	return out
}

// benchSource is one uploaded context; requests differ by a build
// argument, so each (tag, i) is its own build key.
type benchSource struct {
	s  *suite
	up v1.S3Source
	d  string
}

func (s *suite) benchSource() *benchSource {
	s.t.Helper()
	dir := contextDir(s.t, map[string]string{
		"Dockerfile": "FROM scratch\nARG BENCH\nCOPY hello /hello\n",
		"hello":      "hello from the benchmarks\n",
	})
	up, err := s.store.ForTenant("acme").UploadContext(context.Background(), dir, contexttar.Options{}, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	return &benchSource{s: s, up: v1.S3Source{Bucket: up.Bucket, Key: up.Key}, d: up.Digest}
}

func (b *benchSource) request(name, arg string) *v1.Request {
	return &v1.Request{Tenant: "acme", Name: name, Source: v1.Source{S3: &v1.S3Source{Bucket: b.up.Bucket, Key: b.up.Key}},
		ContextDigest: b.d, BuildArgs: map[string]string{"BENCH": arg}}
}

func (b *benchSource) publish(req *v1.Request) time.Time {
	at := time.Now()
	if _, err := b.s.pub.Publish(context.Background(), req); err != nil {
		b.s.t.Fatal(err)
	}
	return at
}

// resultClock records when each request's result arrives and how many
// were published for it (a core subscription sees every publish).
type resultClock struct {
	mu  sync.Mutex
	at  map[string]time.Time
	n   map[string]int
	res map[string]v1.ResultData
	src map[string]string
}

func (s *suite) resultClock() *resultClock {
	s.t.Helper()
	c := &resultClock{at: map[string]time.Time{}, n: map[string]int{}, res: map[string]v1.ResultData{}, src: map[string]string{}}
	sub, err := s.nc.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		now := time.Now()
		var r v1.Result
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		id := r.Data.RequestID
		if c.n[id] == 0 {
			c.at[id], c.res[id], c.src[id] = now, r.Data, r.Source
		}
		c.n[id]++
	})
	if err != nil {
		s.t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	if err := s.nc.Flush(); err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { _ = sub.Unsubscribe() })
	return c
}

func (c *resultClock) wait(t *testing.T, ids []string, timeout time.Duration) {
	t.Helper()
	eventually(t, timeout, fmt.Sprintf("%d results", len(ids)), func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, id := range ids {
			if c.n[id] == 0 {
				return false
			}
		}
		return true
	})
}

// check fails the test unless every request of ids was answered exactly
// once, successfully.
func (c *resultClock) check(t *testing.T, ids []string) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	bad := 0
	for _, id := range ids {
		if c.n[id] != 1 || c.res[id].Status != v1.StatusSucceeded {
			if bad < 5 {
				t.Errorf("request %s: %d results, status %s %s", id, c.n[id], c.res[id].Status, c.res[id].Message)
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d requests not answered exactly once with success", bad, len(ids))
	}
}

func (c *resultClock) arrival(id string) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.at[id]
}

// jobClock watches every Job of the namespace as a client would: when each
// was first seen, when it was first seen complete, and how many there were.
type jobClock struct {
	mu       sync.Mutex
	seen     map[string]time.Time
	complete map[string]time.Time
	byReq    map[string]string // request id annotation → Job name
	deleted  map[string]bool
	// first is the first Job buildq created, as the API server stored it.
	first *batchv1.Job
}

func (s *suite) jobClock() *jobClock {
	s.t.Helper()
	c := &jobClock{seen: map[string]time.Time{}, complete: map[string]time.Time{}, byReq: map[string]string{}, deleted: map[string]bool{}}
	factory := informers.NewSharedInformerFactoryWithOptions(shared.kube, 0, informers.WithNamespace(s.ns))
	inf := factory.Batch().V1().Jobs().Informer()
	see := func(obj any) {
		now := time.Now()
		j, ok := obj.(*batchv1.Job)
		if !ok {
			return
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		if _, ok := c.seen[j.Name]; !ok {
			c.seen[j.Name] = now
			if id := j.Annotations[kaniko.AnnotationRequestID]; id != "" {
				c.byReq[id] = j.Name
				if c.first == nil {
					c.first = j.DeepCopy()
				}
			}
		}
		if _, ok := c.complete[j.Name]; !ok && jobComplete(j) {
			c.complete[j.Name] = now
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    see,
		UpdateFunc: func(_, o any) { see(o) },
		DeleteFunc: func(o any) {
			if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = d.Obj
			}
			if j, ok := o.(*batchv1.Job); ok {
				c.mu.Lock()
				c.deleted[j.Name] = true
				c.mu.Unlock()
			}
		},
	})
	stop := make(chan struct{})
	factory.Start(stop)
	factory.WaitForCacheSync(stop)
	s.t.Cleanup(func() { close(stop); factory.Shutdown() })
	return c
}

// jobComplete: the Job succeeded, by its first condition that says so
// (SuccessCriteriaMet comes before Complete, which waits for the Pods to
// be finished off).
func jobComplete(j *batchv1.Job) bool {
	for _, c := range j.Status.Conditions {
		if (c.Type == batchv1.JobComplete || c.Type == batchv1.JobSuccessCriteriaMet) && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// buildqJobs counts the Jobs buildq created (not the baselines') and how
// many of them are gone.
func (c *jobClock) buildqJobs() (seen, deleted int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, name := range c.byReq {
		seen++
		if c.deleted[name] {
			deleted++
		}
	}
	return seen, deleted
}

// benchRest is a client like the worker's: its own connection and the
// worker's default rate limit.
func benchRest() *rest.Config {
	rc := rest.CopyConfig(shared.restConfig)
	rc.QPS, rc.Burst = 50, 100
	return rc
}

// pct returns the p50 and p99 of xs (milliseconds).
func pct(xs []float64) (p50, p99 float64) {
	ys := slices.Clone(xs)
	return benchfmt.Percentile(ys, 50), benchfmt.Percentile(ys, 99)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func writeResult(t *testing.T, r benchfmt.Result) {
	t.Helper()
	for _, row := range r.Rows {
		if row.Ratio != nil {
			t.Logf("%s %-52s %10.3f %-6s baseline %10.3f  ratio %.2f×", r.ID, row.Metric, row.Value, row.Unit, *row.Baseline, *row.Ratio)
		} else {
			t.Logf("%s %-52s %10.3f %s", r.ID, row.Metric, row.Value, row.Unit)
		}
	}
	for _, n := range r.Notes {
		t.Logf("%s note: %s", r.ID, n)
	}
	if r.Met != nil {
		t.Logf("%s goal %q met: %v", r.ID, r.Goal, *r.Met)
	}
	if path, err := benchfmt.Write(r); err != nil {
		t.Fatal(err)
	} else if path != "" {
		t.Logf("%s written to %s", r.ID, path)
	}
}
