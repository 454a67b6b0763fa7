//go:build integration && benche2e

package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
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
	go func() {
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", w.metrics, int(d.Seconds())))
		if err != nil {
			t.Logf("profile %s: %v", name, err)
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		path := filepath.Join(dir, name+".pprof")
		if err := os.WriteFile(path, b, 0o644); err == nil {
			t.Logf("CPU profile of worker %s: %s", w.id, path)
		}
	}()
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

// baselineJob is what the P1 baseline creates: buildq's own Job as the
// API server stored it, renamed and without buildq's label (no worker or
// emulator looks at it). The Job controller gives it a Pod like buildq's,
// which stays Pending.
func baselineJob(like *batchv1.Job, name string) *batchv1.Job {
	j := like.DeepCopy()
	strip := func(labels map[string]string) map[string]string {
		out := map[string]string{"bench": "baseline"}
		for k, v := range labels {
			if k != kaniko.LabelManagedBy && k != "controller-uid" && k != "job-name" && !strings.HasPrefix(k, "batch.kubernetes.io/") {
				out[k] = v
			}
		}
		return out
	}
	annotations := maps.Clone(j.Annotations)
	delete(annotations, kaniko.AnnotationRequestID)
	j.ObjectMeta = metav1.ObjectMeta{Name: name, Labels: strip(j.Labels), Annotations: annotations}
	j.Spec.Selector, j.Spec.ManualSelector = nil, nil
	j.Spec.Template.Labels = strip(j.Spec.Template.Labels)
	j.Status = batchv1.JobStatus{}
	return j
}

// Why the goals P1, P2 and P3 are missed, measured with the traces and
// message counts these benchmarks take (docs/benchmarks.md prints them).
const (
	p1Why = "Why buildq's path is longer (a trace of one worker's stages, and P3's count of messages): a second queue hop for fair queueing (intake moves the request to its tenant's queue, a dispatcher takes it from there: about 1.5–3 ms here), the request's ledger entry (one answer per request: a KV create), the build claim (one build per key: a KV read and a create), the preflight of the requester's tag in the registry (one HEAD), then the same Job create as the baseline. Each is a round trip to NATS or the registry on this shared 2-core machine, together about 5–9 ms on top of the baseline's. Each carries a guarantee (fair share, one answer per request, one build per key, no tag overwritten), so the 1.3× goal is not met by design. Cut while measuring: the preflight's ping and re-authentication before every HEAD, and the ledger's read before its create."
	p2Why = "After its Job finishes buildq writes the build's final record (joiners and later requests read it), stores the request's decision in its ledger entry (a redelivery publishes the same result, never another), then publishes the result: three durable writes in sequence where the baseline makes one publish, 2–4 ms here. The baseline's p50 is below a millisecond, so the ratio is large while the overhead is a few milliseconds on builds of seconds to minutes; the goal is not met by design."
	p3Why = "A cache hit asks the server for about 13 messages (listed above, the producer's publish included) where the baseline needs 5: intake's move into the tenant's queue (fetch, publish, ack, later the delete and the ack of the queued copy), the ledger entry (create, decision, published mark), the build record, the result and two progress events; the registry HEAD that checks the indexed image is still there comes on top. Dumps of the worker's goroutines during the run (BUILDQ_BENCH_PPROF) find the hits in flight spread about evenly over six waits, one after the other: the ledger entry's create, the build record's read, the registry HEAD, the decision, the result's publish, and the queue delete (the published mark goes beside it); the baseline waits on two, the read and the publish. Each wait also takes longer under the load of 13 messages per hit. The 0.5× goal cannot be met without dropping the fair queue, the exactly-once ledger or the registry check; hits scale with workers instead (P9: about 1,700 answers per second over 10 workers, bounded by the NATS server's CPU). Cut while measuring: concurrent hits on one image share one registry HEAD, and the published mark goes beside the ack instead of before it (together 644 → 1,461 hits/s on this machine, the goroutine dumps' finding); fetches (the dispatcher takes several queued requests per fetch: 0.43–0.76 fetch requests per hit, intake's included, from 2); the ping and re-authentication before each registry HEAD; and the ledger's read before its create."
)

// notMet returns why when a goal was missed.
func notMet(met bool, why string) []string {
	if met {
		return nil
	}
	return []string{why}
}

// TestBenchE2ELatency measures P1 (publish → Job visible), P2 (Job
// complete → result received) against bare programs at three loads, and
// P4 (Kubernetes API requests per build) over the same builds.
func TestBenchE2ELatency(t *testing.T) {
	start := time.Now()
	const buildTime = 300 * time.Millisecond
	s := newSuite(t, options{faults: func(*corev1.Pod) fault { return fault{duration: buildTime} }})
	w := s.startBenchWorker("bench-1")
	src := s.benchSource()
	results := s.resultClock()
	jobs := s.jobClock()
	ctx := context.Background()

	// P1's baseline: publish → fetch → create a Job, nothing else.
	js := s.js()
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH_P1", Subjects: []string{"bench.p1"}})
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "bench", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	baseKube := kubernetes.NewForConfigOrDie(benchRest())
	// A warm-up build: connections, the first Job (the baseline's
	// model), the caches.
	warm := src.request("warm", "warm")
	src.publish(warm)
	results.wait(t, []string{warm.RequestID}, time.Minute)
	jobs.mu.Lock()
	like := jobs.first
	jobs.mu.Unlock()
	t.Cleanup(func() {
		_ = shared.kube.BatchV1().Jobs(s.ns).DeleteCollection(context.Background(),
			metav1.DeleteOptions{PropagationPolicy: ptr(metav1.DeletePropagationBackground)}, metav1.ListOptions{LabelSelector: "bench=baseline"})
	})
	it, err := cons.Messages()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(it.Stop)
	go func() {
		for {
			m, err := it.Next()
			if err != nil {
				return
			}
			go func() {
				if _, err := baseKube.BatchV1().Jobs(s.ns).Create(ctx, baselineJob(like, string(m.Data())), metav1.CreateOptions{}); err != nil {
					t.Errorf("baseline create: %v", err)
				}
				_ = m.Ack()
			}()
		}
	}()

	// P2's baseline: an informer that publishes when a Job completes.
	p2nc, err := nats.Connect(s.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p2nc.Close)
	p2js, _ := jetstream.New(p2nc)
	if _, err := p2js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH_P2", Subjects: []string{"bench.p2.>"}}); err != nil {
		t.Fatal(err)
	}
	var p2mu sync.Mutex
	p2at := map[string]time.Time{}
	p2sub, err := s.nc.Subscribe("bench.p2.>", func(m *nats.Msg) {
		now := time.Now()
		p2mu.Lock()
		defer p2mu.Unlock()
		if _, ok := p2at[string(m.Data)]; !ok {
			p2at[string(m.Data)] = now
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = p2sub.SetPendingLimits(-1, -1)
	_ = s.nc.Flush()
	var published sync.Map
	factory := informers.NewSharedInformerFactoryWithOptions(kubernetes.NewForConfigOrDie(benchRest()), 0, informers.WithNamespace(s.ns),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = kaniko.ManagedBySelector }))
	onJob := func(obj any) {
		j, ok := obj.(*batchv1.Job)
		if !ok || !jobComplete(j) {
			return
		}
		if _, dup := published.LoadOrStore(j.Name, true); dup {
			return
		}
		if _, err := p2js.Publish(ctx, "bench.p2."+j.Name, []byte(j.Name)); err != nil {
			t.Errorf("baseline publish: %v", err)
		}
	}
	_, _ = factory.Batch().V1().Jobs().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onJob, UpdateFunc: func(_, o any) { onJob(o) }})
	stopInf := make(chan struct{})
	factory.Start(stopInf)
	factory.WaitForCacheSync(stopInf)
	t.Cleanup(func() { close(stopInf); factory.Shutdown() })

	if _, err := js.Publish(ctx, "bench.p1", []byte("baseline-warm")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the warm-up baseline Job", func() bool {
		jobs.mu.Lock()
		defer jobs.mu.Unlock()
		_, ok := jobs.seen["baseline-warm"]
		return ok
	})
	eventually(t, time.Minute, "the warm-up Job deleted", func() bool {
		n, d := jobs.buildqJobs()
		return n == 1 && d == 1
	})
	before := w.kubeRequests(t)

	loads := []float64{2, 5, 10}
	const perLoad = 30
	var p1Series, p1Base, p1Series99, p1Base99, p2Series, p2Base, p2Series99, p2Base99 []benchfmt.Point
	var rows []benchfmt.Row
	var all []string
	p1Met, p2Met := true, true
	for li, load := range loads {
		var ids []string
		pubAt := map[string]time.Time{}
		basePubAt := map[string]time.Time{}
		tick := time.NewTicker(time.Duration(float64(time.Second) / load))
		for i := range perLoad {
			req := src.request("lat", fmt.Sprintf("%d-%d", li, i))
			name := fmt.Sprintf("baseline-%d-%d", li, i)
			pubBase := func() {
				basePubAt[name] = time.Now()
				if _, err := js.Publish(ctx, "bench.p1", []byte(name)); err != nil {
					t.Fatal(err)
				}
			}
			// Alternate which goes first, so neither always waits for
			// the other's publish.
			if i%2 == 0 {
				pubAt[req.RequestID] = src.publish(req)
				pubBase()
			} else {
				pubBase()
				pubAt[req.RequestID] = src.publish(req)
			}
			ids = append(ids, req.RequestID)
			<-tick.C
		}
		tick.Stop()
		results.wait(t, ids, 3*time.Minute)
		results.check(t, ids)
		all = append(all, ids...)
		eventually(t, time.Minute, "the baseline Jobs and completions", func() bool {
			jobs.mu.Lock()
			defer jobs.mu.Unlock()
			p2mu.Lock()
			defer p2mu.Unlock()
			for n := range basePubAt {
				if _, ok := jobs.seen[n]; !ok {
					return false
				}
			}
			for _, id := range ids {
				j := jobs.byReq[id]
				if _, ok := p2at[j]; !ok || j == "" {
					return false
				}
			}
			return true
		})
		var p1, b1, p2, b2 []float64
		jobs.mu.Lock()
		p2mu.Lock()
		for _, id := range ids {
			j := jobs.byReq[id]
			p1 = append(p1, ms(jobs.seen[j].Sub(pubAt[id])))
			done, ok := jobs.complete[j]
			if !ok {
				t.Errorf("job %s of request %s: never seen complete", j, id)
				continue
			}
			p2 = append(p2, ms(results.arrival(id).Sub(done)))
			b2 = append(b2, ms(p2at[j].Sub(done)))
		}
		for n, at := range basePubAt {
			b1 = append(b1, ms(jobs.seen[n].Sub(at)))
		}
		p2mu.Unlock()
		jobs.mu.Unlock()
		a50, a99 := pct(p1)
		c50, c99 := pct(b1)
		d50, d99 := pct(p2)
		e50, e99 := pct(b2)
		l := fmt.Sprintf("%g req/s", load)
		rows = append(rows,
			benchfmt.Compared("P1 publish → Job visible, p50 @ "+l, "ms", a50, c50),
			benchfmt.Compared("P1 publish → Job visible, p99 @ "+l, "ms", a99, c99),
			benchfmt.Compared("P2 Job complete → result, p50 @ "+l, "ms", d50, e50),
			benchfmt.Compared("P2 Job complete → result, p99 @ "+l, "ms", d99, e99))
		p1Met = p1Met && a50 <= 1.3*c50 && a99 <= 1.3*c99
		p2Met = p2Met && d50 <= 1.3*e50 && d99 <= 1.3*e99
		p1Series, p1Base = append(p1Series, benchfmt.Point{X: load, Y: a50}), append(p1Base, benchfmt.Point{X: load, Y: c50})
		p1Series99, p1Base99 = append(p1Series99, benchfmt.Point{X: load, Y: a99}), append(p1Base99, benchfmt.Point{X: load, Y: c99})
		p2Series, p2Base = append(p2Series, benchfmt.Point{X: load, Y: d50}), append(p2Base, benchfmt.Point{X: load, Y: e50})
		p2Series99, p2Base99 = append(p2Series99, benchfmt.Point{X: load, Y: d99}), append(p2Base99, benchfmt.Point{X: load, Y: e99})
	}

	// P4: what those builds cost in API requests, once every Job is gone.
	eventually(t, 2*time.Minute, "every Job deleted", func() bool {
		n, d := jobs.buildqJobs()
		return n == d
	})
	after := w.kubeRequests(t)
	builds := float64(len(all))
	var p4 []benchfmt.Row
	mutating, gets := 0.0, 0.0
	for _, k := range slices.Sorted(maps.Keys(after)) {
		n := (after[k] - before[k]) / builds
		if n == 0 {
			continue
		}
		switch verb(k) {
		case "get", "list":
			gets += n
		default:
			mutating += n
		}
		p4 = append(p4, benchfmt.Compared("P4 "+k+" per build", "requests", n, map[string]float64{"create jobs": 1, "delete jobs": 1}[k]))
	}
	p4 = append(p4, benchfmt.Compared("P4 mutating requests per build", "requests", mutating, 2), benchfmt.Compared("P4 GET/LIST per build", "requests", gets, 0))
	elapsed := time.Since(start).Seconds()

	series := func(name, y string, pts []benchfmt.Point) benchfmt.Series {
		return benchfmt.Series{Name: name, XLabel: "offered load (requests/s)", YLabel: y, Points: pts}
	}
	writeResult(t, benchfmt.Result{ID: "P1", Title: "publish → Job visible in the API",
		Baseline: "a bare program in the same run, at the same rate: JetStream publish → fetch → Job create (client-go, same rate limit as the worker)",
		Rows:     filterRows(rows, "P1"), Goal: "p50 and p99 within 1.3× the baseline", Met: benchfmt.Bool(p1Met), Seconds: elapsed, Notes: notMet(p1Met, p1Why),
		Series: []benchfmt.Series{series("P1 buildq p50", "P1 latency (ms)", p1Series), series("P1 baseline p50", "P1 latency (ms)", p1Base),
			series("P1 buildq p99", "P1 latency (ms)", p1Series99), series("P1 baseline p99", "P1 latency (ms)", p1Base99)}})
	writeResult(t, benchfmt.Result{ID: "P2", Title: "Job complete → result event received",
		Baseline: "a bare informer on the same Jobs that publishes to JetStream when one completes; both timed from a third informer seeing the Job complete",
		Rows:     filterRows(rows, "P2"), Goal: "p50 and p99 within 1.3× the baseline", Met: benchfmt.Bool(p2Met), Seconds: elapsed, Notes: notMet(p2Met, p2Why),
		Series: []benchfmt.Series{series("P2 buildq p50", "P2 latency (ms)", p2Series), series("P2 baseline p50", "P2 latency (ms)", p2Base),
			series("P2 buildq p99", "P2 latency (ms)", p2Series99), series("P2 baseline p99", "P2 latency (ms)", p2Base99)}})
	writeResult(t, benchfmt.Result{ID: "P4", Title: "Kubernetes API requests per build, by verb",
		Baseline: "the minimum: one create and one delete of the Job",
		Rows:     p4, Goal: "≤ 2 mutating requests and 0 GETs per build", Met: benchfmt.Bool(mutating <= 2 && gets == 0), Seconds: elapsed,
		Notes: []string{fmt.Sprintf("%d builds; the worker's own client, counted by buildq_kube_requests_total; the informers' watches are not requests per build", len(all))}})
}

// verb is the verb of a "verb resource" key of kubeRequests.
func verb(k string) string {
	v, _, _ := strings.Cut(k, " ")
	return v
}

func filterRows(rows []benchfmt.Row, prefix string) []benchfmt.Row {
	var out []benchfmt.Row
	for _, r := range rows {
		if strings.HasPrefix(r.Metric, prefix) {
			out = append(out, r)
		}
	}
	return out
}

// TestBenchE2ECacheHits measures P3: cache hits answered per second by one
// worker, against a bare program doing what a hit needs at the least:
// fetch → KV get → publish → ack, with the worker's concurrency.
func TestBenchE2ECacheHits(t *testing.T) {
	start := time.Now()
	const n = 2000
	s := newSuite(t, options{})
	w := s.startBenchWorker("bench-1")
	src := s.benchSource()
	results := s.resultClock()
	first := src.request("hits", "hit")
	src.publish(first)
	results.wait(t, []string{first.RequestID}, time.Minute)
	w.stop(t, syscall.SIGTERM)

	// The same key n times, queued while no worker runs.
	var ids []string
	for range n {
		req := src.request("hits", "hit")
		src.publish(req)
		ids = append(ids, req.RequestID)
	}
	s.startBenchWorker("bench-2").profile(t, "p3-cache-hits", 2*time.Second)
	results.wait(t, ids, 5*time.Minute)
	results.check(t, ids)
	rate := func(times []time.Time) float64 {
		slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
		return float64(len(times)-1) / times[len(times)-1].Sub(times[0]).Seconds()
	}
	var got []time.Time
	for _, id := range ids {
		got = append(got, results.arrival(id))
	}
	buildqRate := rate(got)

	// What one cache hit asks of the server: every message any client
	// sends, by kind, over a further round of requests (counted apart
	// from the measurement, which the counting would slow).
	const counted = 200
	traffic := s.countTraffic()
	var more []string
	for range counted {
		req := src.request("hits", "hit")
		src.publish(req)
		more = append(more, req.RequestID)
	}
	results.wait(t, more, 2*time.Minute)
	perHit := traffic()

	// The baseline, on the same server: the build record the worker
	// stored, the same request bodies.
	ctx := context.Background()
	js := s.js()
	idx, err := js.KeyValue(ctx, "buildq-builds")
	if err != nil {
		t.Fatal(err)
	}
	key := results.res[first.RequestID].Key
	rec, err := idx.Get(ctx, key)
	if err != nil {
		t.Fatalf("the build record of %s: %v", key, err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "bench-p3"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "k", rec.Value()); err != nil {
		t.Fatal(err)
	}
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH_P3", Subjects: []string{"bench.p3.in"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH_P3_OUT", Subjects: []string{"bench.p3.out.>"}}); err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(first)
	for range n {
		if _, err := js.Publish(ctx, "bench.p3.in", body); err != nil {
			t.Fatal(err)
		}
	}
	var bmu sync.Mutex
	var baseAt []time.Time
	sub, err := s.nc.Subscribe("bench.p3.out.>", func(*nats.Msg) {
		bmu.Lock()
		baseAt = append(baseAt, time.Now())
		bmu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	_ = s.nc.Flush()
	bnc, err := nats.Connect(s.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer bnc.Close()
	bjs, _ := jetstream.New(bnc)
	bkv, _ := bjs.KeyValue(ctx, "bench-p3")
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "bench", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 16})
	if err != nil {
		t.Fatal(err)
	}
	it, err := cons.Messages()
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan jetstream.Msg)
	var wg sync.WaitGroup
	seq := 0
	var seqMu sync.Mutex
	for range 16 { // the worker's --max-in-flight
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range msgs {
				var req v1.Request
				if err := json.Unmarshal(m.Data(), &req); err != nil {
					t.Error(err)
				}
				e, err := bkv.Get(ctx, "k")
				if err != nil {
					t.Error(err)
					continue
				}
				seqMu.Lock()
				seq++
				id := strconv.Itoa(seq)
				seqMu.Unlock()
				out := nats.NewMsg("bench.p3.out." + id)
				out.Header.Set(v1.MsgIDHeader, id)
				out.Data = e.Value()
				if _, err := bjs.PublishMsg(ctx, out); err != nil {
					t.Error(err)
				}
				_ = m.Ack()
			}
		}()
	}
	go func() {
		for range n {
			m, err := it.Next()
			if err != nil {
				break
			}
			msgs <- m
		}
		close(msgs)
	}()
	eventually(t, 2*time.Minute, "the baseline's answers", func() bool {
		bmu.Lock()
		defer bmu.Unlock()
		return len(baseAt) >= n
	})
	it.Stop()
	wg.Wait()
	bmu.Lock()
	baseRate := rate(baseAt)
	bmu.Unlock()
	rows := []benchfmt.Row{benchfmt.Compared(fmt.Sprintf("P3 cache hits answered (%d queued, one worker)", n), "req/s", buildqRate, baseRate)}
	total := 0.0
	for _, k := range slices.Sorted(maps.Keys(perHit)) {
		v := float64(perHit[k]) / counted
		total += v
		rows = append(rows, benchfmt.Plain("P3 messages to the server per hit: "+k, "messages", v))
	}
	rows = append(rows, benchfmt.Compared("P3 messages to the server per hit, all (the producer's publish included)", "messages", total, 5))
	writeResult(t, benchfmt.Result{ID: "P3", Title: "cache hits answered per second (no Job)",
		Baseline: "a bare program on the same NATS server: fetch → KV get of the same build record → JetStream publish → ack, 16 at a time like the worker: with the producer's publish, 5 messages to the server per request (fewer with batched fetches)",
		Rows:     rows,
		Goal:     "at least 0.5× the baseline", Met: benchfmt.Bool(buildqRate >= 0.5*baseRate), Seconds: time.Since(start).Seconds(),
		Notes: notMet(buildqRate >= 0.5*baseRate, p3Why)})
}

// countTraffic counts every message clients send to the suite's NATS
// server from now on, by kind, until the returned function is called.
// Replies to inboxes, consumers' deliveries and the server's own
// advisories are not counted: each request to the server counts once.
func (s *suite) countTraffic() func() map[string]int {
	s.t.Helper()
	nc, err := nats.Connect(s.natsURL)
	if err != nil {
		s.t.Fatal(err)
	}
	var mu sync.Mutex
	counts := map[string]int{}
	sub, err := nc.Subscribe(">", func(m *nats.Msg) {
		if strings.HasPrefix(m.Reply, "$JS.ACK.") {
			return // a consumer's delivery, sent by the server
		}
		kind := trafficKind(m.Subject)
		if kind == "" {
			return
		}
		mu.Lock()
		counts[kind]++
		mu.Unlock()
	})
	if err != nil {
		s.t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	_ = nc.Flush()
	return func() map[string]int {
		_ = nc.Flush()
		time.Sleep(200 * time.Millisecond) // the last messages in flight
		_ = sub.Unsubscribe()
		nc.Close()
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(counts)
	}
}

// trafficKind names what a message to subject does: a JetStream API call
// by its operation, a KV write by bucket, an ack, a stream publish or a
// core message by its subject's first tokens ("" for replies).
func trafficKind(subject string) string {
	tok := strings.Split(subject, ".")
	switch {
	case strings.HasPrefix(subject, "_INBOX") || strings.HasPrefix(subject, "$SYS") || strings.HasPrefix(subject, "$JS.EVENT."):
		return ""
	case strings.HasPrefix(subject, "$JS.ACK."):
		return "ack/nak/progress of a consumer's message"
	case strings.HasPrefix(subject, "$JS.API.DIRECT.GET.") && len(tok) > 4:
		return "KV get " + strings.TrimPrefix(tok[4], "KV_")
	case strings.HasPrefix(subject, "$JS.API.") && len(tok) > 3:
		op := tok[2] + "." + tok[3]
		if len(tok) > 4 && (tok[3] == "MSG" || tok[3] == "CONSUMER") {
			op += "." + tok[4]
		}
		return "JetStream API " + op
	case strings.HasPrefix(subject, "$KV.") && len(tok) > 1:
		return "KV write " + tok[1]
	case len(tok) >= 2:
		return "publish " + tok[0] + "." + tok[1]
	}
	return "publish " + subject
}

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

// TestBenchE2ERecovery measures P7: how long a build waits when its
// worker dies (SIGKILL: redelivery after AckWait, take-over after the
// lease) or stops (SIGTERM: handed off at once).
func TestBenchE2ERecovery(t *testing.T) {
	start := time.Now()
	const (
		ackWait = 5 * time.Second // the suite's --ack-wait
		lease   = 3 * time.Second // the suite's --lease
		rounds  = 3
	)
	names := []string{}
	for _, sig := range []string{"kill", "term"} {
		for i := range rounds {
			names = append(names, fmt.Sprintf("%s-%d", sig, i))
		}
	}
	h := newHolds(t, names...)
	s := newSuite(t, options{faults: h.fault})
	src := s.benchSource()
	results := s.resultClock()
	// measure runs one request on one of two workers, signals its worker
	// with sig as the build ends, and returns how long until the other
	// worker took the request on (its first progress event) and until the
	// result arrived.
	measure := func(name string, sig syscall.Signal) (resumed, answered float64) {
		a := s.startBenchWorker(name + "-a")
		b := s.startBenchWorker(name + "-b")
		defer b.stop(t, syscall.SIGTERM)
		var mu sync.Mutex
		var events []v1.Event
		var eventAt []time.Time
		sub, err := s.nc.Subscribe(v1.EventSubject("acme", name), func(m *nats.Msg) {
			var e v1.Event
			if json.Unmarshal(m.Data, &e) == nil {
				mu.Lock()
				events, eventAt = append(events, e), append(eventAt, time.Now())
				mu.Unlock()
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = sub.Unsubscribe() }()
		req := src.request(name, name)
		src.publish(req)
		// The worker that creates the Job says so in its progress events.
		var owner, other *benchWorker
		eventually(t, time.Minute, "the Job of "+name, func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, e := range events {
				if e.Phase == v1.PhaseJobCreated {
					owner, other = a, b
					if e.Worker == b.id {
						owner, other = b, a
					}
					return true
				}
			}
			return false
		})
		t0 := time.Now()
		owner.stop(t, sig)
		h.release(name)
		results.wait(t, []string{req.RequestID}, 2*time.Minute)
		results.check(t, []string{req.RequestID})
		results.mu.Lock()
		by := results.src[req.RequestID]
		results.mu.Unlock()
		if !containsID(by, other.id) {
			t.Errorf("%s answered by %q, want the other worker %s", name, by, other.id)
		}
		mu.Lock()
		for i, e := range events {
			if e.Worker == other.id && eventAt[i].After(t0) {
				resumed = ms(eventAt[i].Sub(t0))
				break
			}
		}
		mu.Unlock()
		if other == a {
			a.stop(t, syscall.SIGTERM)
		}
		return resumed, ms(results.arrival(req.RequestID).Sub(t0))
	}
	var kill, term, killDone, termDone []float64
	for i := range rounds {
		r, d := measure(fmt.Sprintf("kill-%d", i), syscall.SIGKILL)
		kill, killDone = append(kill, r), append(killDone, d)
		r, d = measure(fmt.Sprintf("term-%d", i), syscall.SIGTERM)
		term, termDone = append(term, r), append(termDone, d)
	}
	k50, _ := pct(kill)
	t50, _ := pct(term)
	kd50, _ := pct(killDone)
	td50, _ := pct(termDone)
	writeResult(t, benchfmt.Result{ID: "P7", Title: "a worker's build resumed elsewhere: SIGKILL, SIGTERM",
		Baseline: fmt.Sprintf("AckWait (%v) for SIGKILL, lease (%v) for SIGTERM", ackWait, lease),
		Rows: []benchfmt.Row{
			benchfmt.Compared("P7 SIGKILL → request taken on by the other worker, median", "ms", k50, ms(ackWait)),
			benchfmt.Compared("P7 SIGKILL → result, median", "ms", kd50, ms(ackWait)),
			benchfmt.Compared("P7 SIGTERM → request taken on by the other worker, median", "ms", t50, ms(lease)),
			benchfmt.Compared("P7 SIGTERM → result, median", "ms", td50, ms(lease)),
		},
		Notes: []string{fmt.Sprintf("median of %d rounds each, two workers, --ack-wait %v, --lease %v; the build is held while its worker runs and let go when the worker is signalled, so the result also waits for the rest of the emulated build (context fetch, build, push)", rounds, ackWait, lease),
			"SIGKILL: the request comes back after AckWait and the other worker adopts the running Job; SIGTERM: the worker hands the request and its claim back at once"},
		Seconds: time.Since(start).Seconds()})
}

func containsID(source, id string) bool {
	return regexp.MustCompile(`\b` + regexp.QuoteMeta(id) + `\b`).MatchString(source)
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
