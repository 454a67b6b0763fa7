//go:build benchscale && linux

package worker

// P9 of docs/benchmarks.md (`make bench-scale`): toward internet scale,
// simulated. Many requests over fewer keys, several worker processes, one
// NATS server and then a 3-node JetStream cluster; each worker process has
// the test world's API server and node (world_test.go). It checks that
// every request is answered once and every key built once, and measures
// throughput over time, the NATS store, the buckets' growth, and the
// processes' memory and CPU.
//
// The processes are this test binary run again: TestBenchScaleNATS runs one
// nats-server node and TestBenchScaleWorker one worker, each told what to
// do by BUILDQ_SCALE_CHILD (JSON); both skip without it. The parent
// (TestBenchScale) serves the registry, publishes the requests and reads
// the results.
//
// Sizes are environment variables, so a bigger machine runs the full
// figure: BUILDQ_SCALE_REQUESTS (default 100000), BUILDQ_SCALE_KEYS
// (10000), BUILDQ_SCALE_WORKERS (10), BUILDQ_SCALE_TENANTS (10),
// BUILDQ_SCALE_IN_FLIGHT (slots per worker, 16), BUILDQ_SCALE_BUILD (one
// emulated build, 1s), BUILDQ_SCALE_TOPOLOGIES (single,cluster,cluster-bare;
// cluster-bare is the bare baseline of benchscale_bare_test.go),
// BUILDQ_SCALE_PHASE_TIMEOUT (per topology, 14m), BUILDQ_SCALE_PROFILE (a
// directory: the first worker and the first NATS node write CPU profiles
// there).

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
)

// scaleChildEnv carries a child process's scaleChild, as JSON.
const scaleChildEnv = "BUILDQ_SCALE_CHILD"

// scaleSettings are the sizes of one run.
type scaleSettings struct {
	Requests, Keys, Workers, Tenants, InFlight int
	Build                                      time.Duration
	Topologies                                 []string
	PhaseTimeout                               time.Duration
	ProfileDir                                 string
	Census                                     bool // count the clients' messages by subject (a diagnostic run)
}

func scaleSettingsFromEnv(t *testing.T) scaleSettings {
	t.Helper()
	num := func(name string, def int) int {
		v := os.Getenv(name)
		if v == "" {
			return def
		}
		n, err := strconv.Atoi(strings.ReplaceAll(v, "_", ""))
		if err != nil || n < 1 {
			t.Fatalf("%s=%q: want a positive integer", name, v)
		}
		return n
	}
	dur := func(name string, def time.Duration) time.Duration {
		v := os.Getenv(name)
		if v == "" {
			return def
		}
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("%s=%q: want a positive duration", name, v)
		}
		return d
	}
	s := scaleSettings{
		Requests:     num("BUILDQ_SCALE_REQUESTS", 100_000),
		Keys:         num("BUILDQ_SCALE_KEYS", 10_000),
		Workers:      num("BUILDQ_SCALE_WORKERS", 10),
		Tenants:      num("BUILDQ_SCALE_TENANTS", 10),
		InFlight:     num("BUILDQ_SCALE_IN_FLIGHT", 16),
		Build:        dur("BUILDQ_SCALE_BUILD", time.Second),
		PhaseTimeout: dur("BUILDQ_SCALE_PHASE_TIMEOUT", 14*time.Minute),
		ProfileDir:   os.Getenv("BUILDQ_SCALE_PROFILE"),
		Census:       os.Getenv("BUILDQ_SCALE_CENSUS") != "",
		Topologies:   []string{"single", "cluster", "cluster-bare"},
	}
	if v := os.Getenv("BUILDQ_SCALE_TOPOLOGIES"); v != "" {
		s.Topologies = nil
		for _, p := range strings.Split(v, ",") {
			p = strings.TrimSpace(p)
			if _, ok := scaleTopologies[p]; !ok {
				t.Fatalf("BUILDQ_SCALE_TOPOLOGIES: %q is none of single, cluster, cluster-bare", p)
			}
			s.Topologies = append(s.Topologies, p)
		}
	}
	if s.ProfileDir != "" {
		abs, err := filepath.Abs(s.ProfileDir)
		if err != nil {
			t.Fatal(err)
		}
		s.ProfileDir = abs
	}
	if s.Keys > s.Requests {
		s.Keys = s.Requests
	}
	if s.Tenants > s.Keys {
		s.Tenants = s.Keys
	}
	return s
}

// scaleChild tells a child process what to run.
type scaleChild struct {
	Role    string `json:"role"` // "worker", "nats" or "bare"
	Name    string `json:"name"`
	Ready   string `json:"ready"`   // file written once the child serves
	Report  string `json:"report"`  // file the child's scaleReport goes to at exit
	Profile string `json:"profile"` // CPU profile file ("": none)

	// worker
	NATS     string        `json:"nats,omitempty"`
	Registry string        `json:"registry,omitempty"` // host:port in image references
	RegAddr  string        `json:"regAddr,omitempty"`  // where it listens
	RegCA    string        `json:"regCA,omitempty"`    // its certificate (PEM file)
	InFlight int           `json:"inFlight,omitempty"`
	Build    time.Duration `json:"build,omitempty"`
	Replicas int           `json:"replicas,omitempty"`

	// nats
	Port        int      `json:"port,omitempty"`
	ClusterPort int      `json:"clusterPort,omitempty"`
	Routes      []string `json:"routes,omitempty"`
	StoreDir    string   `json:"storeDir,omitempty"`
}

// slotSample is how many of a worker's slots were busy at a moment.
type slotSample struct {
	At   int64 `json:"at"` // Unix milliseconds
	Busy int   `json:"busy"`
}

// scaleReport is what a child reports at exit.
type scaleReport struct {
	Name       string  `json:"name"`
	RSSMiB     float64 `json:"rssMiB"`
	CPUSeconds float64 `json:"cpuSeconds"`
	// Jobs: Job name → creations that reached the fake API server.
	Jobs map[string]int `json:"jobs,omitempty"`
	// JobsLeft: Jobs still in the fake API server at exit.
	JobsLeft int                `json:"jobsLeft"`
	Metrics  map[string]float64 `json:"metrics,omitempty"`
	// Slots: the worker's busy slots, sampled every 100 ms.
	Slots  []slotSample `json:"slots,omitempty"`
	Errors []string     `json:"errors,omitempty"`
}

func childSpec(t *testing.T, role string) scaleChild {
	t.Helper()
	raw := os.Getenv(scaleChildEnv)
	if raw == "" {
		t.Skip("a process of TestBenchScale (" + scaleChildEnv + " unset)")
	}
	var spec scaleChild
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatal(err)
	}
	if spec.Role != role {
		t.Skipf("this process is a %s", spec.Role)
	}
	return spec
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

func writeJSONFile(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// startProfile starts a CPU profile into path ("": none); the returned
// function stops it.
func startProfile(path string) func() {
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return func() {}
	}
	return func() { pprof.StopCPUProfile(); f.Close() }
}

// ---- the NATS node process ----

// TestBenchScaleNATS is one nats-server node of TestBenchScale.
func TestBenchScaleNATS(t *testing.T) {
	spec := childSpec(t, "nats")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	stopProfile := startProfile(spec.Profile)
	n := startNATS(t, natsConfig{Name: spec.Name, Port: spec.Port, Dir: spec.StoreDir, Configure: func(o *server.Options) {
		// Logs to the child's log file; JetStream's limits from the machine.
		o.NoLog, o.Logtime = false, true
		o.JetStreamMaxMemory, o.JetStreamMaxStore = 0, 0
		if spec.ClusterPort > 0 {
			o.Cluster = server.ClusterOpts{Name: "buildq-scale", Host: "127.0.0.1", Port: spec.ClusterPort}
			o.Routes = server.RoutesFromStr(strings.Join(spec.Routes, ","))
		}
	}})
	srv := n.Server()
	if err := os.WriteFile(spec.Ready, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	<-ctx.Done()
	rep := scaleReport{Name: spec.Name, Metrics: map[string]float64{}}
	if v, err := srv.Varz(nil); err == nil {
		rep.Metrics["in_msgs"], rep.Metrics["out_msgs"] = float64(v.InMsgs), float64(v.OutMsgs)
		rep.Metrics["in_bytes"], rep.Metrics["out_bytes"] = float64(v.InBytes), float64(v.OutBytes)
	}
	n.Stop()
	stopProfile()
	rep.RSSMiB, rep.CPUSeconds = benchfmt.RSSMiB(os.Getpid()), cpuSeconds()
	if err := writeJSONFile(spec.Report, rep); err != nil {
		t.Fatal(err)
	}
}

// ---- the worker process ----

// TestBenchScaleWorker is one worker process of TestBenchScale: the real
// worker and kaniko Job backend, against a fake API server with an
// emulated kubelet, the shared NATS and the shared registry.
func TestBenchScaleWorker(t *testing.T) {
	spec := childSpec(t, "worker")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	stopProfile := startProfile(spec.Profile)

	// The test world without NATS: the API server, and the node, whose
	// every build succeeds spec.Build after its Job's creation and pushes
	// a small image of its own to the registry of the parent.
	reg := tlsRegistryClient(t, spec.Registry, spec.RegAddr, spec.RegCA)
	images, err := benchImages()
	if err != nil {
		t.Fatal(err)
	}
	wld := newWorld(t, worldConfig{noNATS: true, node: nodeOptions{
		plan:     func(*batchv1.Job) buildPlan { return buildPlan{auto: true, after: spec.Build, succeed: true} },
		registry: reg,
		image:    images,
	}})
	// The event log bounded to the last 100 to 200 events (what a watch
	// resumes from; nothing breaks a watch here), and the actions the fake
	// clientset records for tests to inspect forgotten every second: both
	// would count as the worker's memory (with 1000 events kept, a
	// worker's peak RSS rose by half at 750 Jobs).
	wld.api.keep = 100
	client := wld.api.newClient(spec.Name, nil)
	kc := testKaniko
	factory := kube.NewInformerFactory(client, kc.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		t.Fatal(err)
	}
	infCtx, stopInformers := context.WithCancel(context.Background())
	defer stopInformers()
	factory.Start(infCtx.Done())
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
				client.ClearActions()
			case <-infCtx.Done():
				return
			}
		}
	}()
	if !watcher.WaitForSync(ctx) {
		t.Fatal("informers did not sync")
	}
	backend, err := NewKubeBackend(client, watcher, kc)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(spec.NATS, nats.Name(spec.Name), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	promReg := prometheus.NewRegistry()
	logCfg := zap.NewProductionConfig()
	logCfg.Level = zap.NewAtomicLevelAt(zapcore.WarnLevel)
	logCfg.Sampling = &zap.SamplingConfig{Initial: 20, Thereafter: 1000}
	logger, err := logCfg.Build()
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(nc, backend, Config{
		ID:            spec.Name,
		MaxInFlight:   spec.InFlight,
		Replicas:      spec.Replicas,
		Naming:        naming.Policy{Registry: spec.Registry},
		ContextPrefix: "contexts/{tenant}/",
		Registry:      reg,
		Metrics:       NewMetrics(promReg),
		Logger:        logger.Named(spec.Name),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(spec.Ready, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var slots []slotSample
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case now := <-tick.C:
				slots = append(slots, slotSample{At: now.UnixMilli(), Busy: w.fq.InFlight()})
			case <-ctx.Done():
				return
			}
		}
	}()
	if err := w.Run(ctx); err != nil {
		t.Error(err)
	}
	<-sampled
	wld.node.close()
	stopInformers()
	factory.Shutdown()
	stopProfile()
	_ = logger.Sync()

	rep := scaleReport{Name: spec.Name, Metrics: map[string]float64{}, Slots: slots}
	wld.node.creates.mu.Lock()
	rep.Jobs = maps.Clone(wld.node.creates.n)
	wld.node.creates.mu.Unlock()
	wld.node.mu.Lock()
	rep.Errors = slices.Clone(wld.node.errs)
	wld.node.mu.Unlock()
	if list, err := client.BatchV1().Jobs(kc.Namespace).List(context.Background(), metav1.ListOptions{}); err == nil {
		rep.JobsLeft = len(list.Items)
	}
	if mfs, err := promReg.Gather(); err == nil {
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				name := mf.GetName()
				for _, l := range m.GetLabel() {
					if l.GetName() == "origin" || l.GetName() == "status" || l.GetName() == "at" {
						name += "/" + l.GetValue()
					}
				}
				if c := m.GetCounter(); c != nil {
					rep.Metrics[name] += c.GetValue()
				}
			}
		}
	}
	rep.RSSMiB, rep.CPUSeconds = benchfmt.RSSMiB(os.Getpid()), cpuSeconds()
	if err := writeJSONFile(spec.Report, rep); err != nil {
		t.Fatal(err)
	}
}

// scaleRegistryHost is the registry's name in image references.
const scaleRegistryHost = "registry.scale.test"

// ---- the parent ----

// scaleProc is a child process.
type scaleProc struct {
	spec scaleChild
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
}

func startScaleChild(t *testing.T, dir, test string, spec scaleChild) *scaleProc {
	t.Helper()
	spec.Ready = filepath.Join(dir, spec.Name+".ready")
	spec.Report = filepath.Join(dir, spec.Name+".report.json")
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &scaleProc{spec: spec, log: filepath.Join(dir, spec.Name+".log"), done: make(chan struct{})}
	out, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.timeout=0", "-test.v")
	p.cmd.Env = append(os.Environ(), scaleChildEnv+"="+string(b))
	p.cmd.Stdout, p.cmd.Stderr = out, out
	// A parent that dies takes its children along.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		out.Close()
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		out.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// waitReady waits until the child wrote its ready file.
func (p *scaleProc) waitReady(t *testing.T, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(p.spec.Ready); err == nil {
			return
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited before it was ready (%v):\n%s", p.spec.Name, p.err, p.tail())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready after %s:\n%s", p.spec.Name, timeout, p.tail())
		}
	}
}

var originLabel = map[v1.Origin]string{
	v1.OriginBuild: "from a build", v1.OriginInflight: "joining a build", v1.OriginCache: "from the index",
}

func sum(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return sum(xs) / float64(len(xs))
}

// TestBenchScale is P9: see the top of this file.
// scaleGoal states P9's goal. It is not judged by the run: its reference
// is the code before issue 31 (7fbab6b) run the same way on the same
// machine in the same session — a machine's speed moves from day to day
// more than the code does (the bare P3 loop ran at 6,200 req/s on an AMD
// EPYC one day and 17,100 on an Intel Xeon the next, both 2-core machines
// of the same kind) — and the note says
// what that comparison gave.
func scaleGoal(res *benchfmt.Result) {
	res.Goal = "the 3-node cluster answers at least twice the requests per second of the code before issue 31 (7fbab6b), both run on the same machine in the same session"
	res.Notes = append(res.Notes, scaleReference)
}

// scaleReference is the last same-session comparison with the code before
// issue 31, run as `git worktree add /tmp/ref 7fbab6b` and, there,
// `BUILDQ_SCALE_TOPOLOGIES=cluster go test -tags benchscale -count=1
// -timeout 50m -run '^TestBenchScale$' -v ./worker/`.
const scaleReference = "Against the code before issue 31 (7fbab6b), run the same way on the same machine right before this run (2026-12-03): the 3-node cluster answered the 100,000 requests in 175 s (571/s; 85.5 messages into the servers and 3.2 ledger writes per request; NATS 171 CPU-s, workers 136) where this code, run right after it, took 158 s (634/s; 69.7 messages, 1.4 ledger writes; NATS 148 CPU-s, workers 132): 1.11×, the goal of 2× not met. (On 2026-12-02, on another 2-core machine of the kind, an AMD EPYC, the same pair was 452 s and 298 s with cache hits answered at intake only: 1.52×.) What bounds both: the 10,000 builds come first and hold the 160 slots for about 78 s (127 builds/s: slots × a build's 1.25 s), and the hits queued behind them wait for slots; then the hits run at about 1,050/s in both, which is the 2 cores' worth of CPU at 1.8–1.9 ms per answer summed over every process (three NATS servers, ten workers, the harness). Twice the rate needs the queued hits answered while the builds hold the slots, and the CPU per answer halved. Later the same day, after requests were taken straight from intake (272503c, 1b50043), the cluster took 159 s, 176 s and 176 s in three runs: unchanged within this machine's spread (taking a request straight from intake needs an idle dispatcher, and P9's requests wait behind builds in busy queues). The bare protocol joined this benchmark that day (its note below gives each run's own figures): in three runs it answered the same requests on a 3-node cluster of its own in 72–73 s where buildq took 163–178 s. Twice the code before issue 31 (88 s) lies above that floor, so the goal is not beyond the machine. What separates buildq from it is mostly the cost of a cache hit answered from the queue (about four times the messages into the servers per request, and about ten times the CPU per answer once the builds are done), and in part the builds' own (buildq held a slot about 1.3 s per emulated build of 1 s; both need at least 62 s for the builds). What would close it, as measured then: a request whose key's build is queued answered without the queue's hop. That came next (99f47ae, 5592663): such a request is held at intake, unqueued and with nothing written for it, and answered from the cache where it was held when its key's build ends (docs/design.md §2d, item 4). On the same machine the cluster then took 143 s and 187 s with 99f47ae (the latter with one request held to its 2-minute limit after a replica's stale read, mended in 5592663) and 142 s with 5592663 (this page's run), against 163–178 s just before: about 1.2× the code before issue 31, still short of 2×. Messages into the servers per request fell from 65 to about 44 and the run's CPU from 337 to about 285 CPU-s; of the 90,000 hits about 43,000 were answered where they were held and about 2,200 from the queue, where 65,000 came from the queue before. What bounds it now is the machine's CPU, not the queue: the two cores were busy from the first publish to the last answer, and the builds slowed with them (a slot held 1.44 s per emulated 1 s build, about 108 builds/s, so some 93 s for the builds alone), and an answer after the builds cost 1.8–2.4 ms of CPU over all processes against the bare protocol's 0.24. A profile of a worker and of a NATS node in a run of 99f47ae: the servers' Raft and file-store writes, their writes of buildq-workers' state with the held requests pending on it (about an eighth of a node's CPU), and their network writes; the workers' allocation and JSON, and the emulated nodes' image pushes (gzip, about a tenth of the workers' CPU, which the bare protocol does not have). Then (4f3e523, 3e86773), from a census of the run's messages by kind of subject (BUILDQ_SCALE_CENSUS=1): every worker's waiter sweep (each half lease) listed every waiter delete marker the ledger held, since a build's waiter entry was deleted with a key-value delete whose marker stays for the bucket's max age, so the sweeps listed more with every build (in a deployment, every build of the last week, on every worker, every 15 s); a waiter entry is now purged and leaves nothing. Each build's end created and deleted an ordered consumer to list its key's waiters, two changes of the cluster's meta group per build; the waiters are now named from the stream's subjects. Intake's look at a key whose record the watch showed reads nothing (the watch's records are kept while that watch runs). And the emulated node stopped compressing a random layer per build on the workers' CPU, about a tenth of it, counted against buildq: its images share one layer, each with a config of its own; the same change was made to 7fbab6b's benchmark for the comparison. Run in the same session on the same machine (2026-12-03, afternoon), 7fbab6b took 201 s and 207 s on the cluster (NATS 216–221 CPU-s, workers 139–147, 84–85 messages into the servers per request) and this code 97 s (this page's run) and 95 s (NATS 89 CPU-s, workers 89, 34.2 messages): 2.07–2.18×, the goal of 2× met on this machine. (The morning's run of 7fbab6b, with the node's gzip, took 175 s: this machine's figures wander by a sixth between runs hours apart, which is why both sides were run within minutes of each other.) What bounds it now is the machine's two cores, busy from the first publish to the last answer, about half for the NATS servers and half for the workers: the harness's publisher, starved with them, took 96 s to publish the 100,000 requests, and the last answer came a second after the last publish. The builds ran at about 134/s (a slot held 1.17 s per emulated 1 s build, about 75 s for the builds alone); the bare protocol took 73 s in the same run. What is left of buildq's own cost per request: a cache hit's ledger entry, result and ack (three replicated writes where the bare protocol has one), the record and pending-mark reads of a key whose build is queued but not started (about 0.8 of each per request in a small census run), and buildq-workers' state with the held requests pending on it, which each node writes up to ten times a second (about a tenth of a node's CPU in a profile)."

func TestBenchScale(t *testing.T) {
	if os.Getenv(scaleChildEnv) != "" {
		t.Skip("a child process")
	}
	s := scaleSettingsFromEnv(t)
	if s.ProfileDir != "" {
		if err := os.MkdirAll(s.ProfileDir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	began := time.Now()
	var where []string
	for _, name := range s.Topologies {
		where = append(where, scaleTopologies[name].label)
	}
	res := benchfmt.Result{
		ID: "P9",
		Title: fmt.Sprintf("Toward internet scale, simulated: %d requests over %d keys of %d tenants, %d worker processes; %s",
			s.Requests, s.Keys, s.Tenants, s.Workers, strings.Join(where, ", then ")),
	}
	sums := map[string]scaleSummary{}
	for _, name := range s.Topologies {
		run := runScale
		if scaleTopologies[name].bare {
			run = runScaleBare
		}
		o := run(t, s, scaleTopologies[name])
		sums[name] = o.sum
		res.Rows = append(res.Rows, o.rows...)
		res.Series = append(res.Series, o.series)
		res.Notes = append(res.Notes, o.notes...)
		if t.Failed() {
			break
		}
	}
	scaleGoal(&res)
	q, okq := sums["cluster"]
	if bare, ok := sums["cluster-bare"]; ok && okq && !t.Failed() {
		res.Notes = append(res.Notes, bareNote(s, q, bare))
	}
	res.Notes = append(res.Notes, fmt.Sprintf(
		"Emulated: each worker process has its own fake Kubernetes API server (the test world's, worker/world_api_test.go: client-go's fake clientset on one object store with resource versions and resumable watches, so its informers see only its own Jobs) and the test world's node (worker/world_node_test.go), which ends every Job %s after its creation: it pushes a small image of its own to the Job's destinations (one random layer shared by every image, compressed once, and a config naming the Job), then writes the Pod with the digest as the kaniko container's termination message and the Job's Complete condition. Real: the worker package with the kaniko Job backend, %d slots per worker, production defaults (AckWait and lease 30 s), NATS over TCP with file storage, go-containerregistry's registry (in memory, in the harness process, over TLS) for the preflight, the index checks and the pushes. Requests are published as one backlog, key i mod %d, so the %d requests of a key are spread over the whole run.",
		s.Build, s.InFlight, s.Keys, s.Requests/s.Keys))
	if t.Failed() {
		res.Notes = append([]string{"This run FAILED its checks (see the test's log): the figures are not to be trusted."}, res.Notes...)
	}
	res.Seconds = time.Since(began).Seconds()
	for _, r := range res.Rows {
		t.Logf("%-75s %12.1f %s", r.Metric, r.Value, r.Unit)
	}
	for _, n := range res.Notes {
		t.Log(n)
	}
	path, err := benchfmt.Write(res)
	if err != nil {
		t.Fatal(err)
	}
	if path != "" {
		t.Logf("wrote %s", path)
	}
}
