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
// emulated build, 1s), BUILDQ_SCALE_TOPOLOGIES (single,cluster),
// BUILDQ_SCALE_PHASE_TIMEOUT (per topology, 14m), BUILDQ_SCALE_PROFILE (a
// directory: the first worker and the first NATS node write CPU profiles
// there).

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/publisher"
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
		Topologies:   []string{"single", "cluster"},
	}
	if v := os.Getenv("BUILDQ_SCALE_TOPOLOGIES"); v != "" {
		s.Topologies = nil
		for _, p := range strings.Split(v, ",") {
			switch p = strings.TrimSpace(p); p {
			case "single", "cluster":
				s.Topologies = append(s.Topologies, p)
			default:
				t.Fatalf("BUILDQ_SCALE_TOPOLOGIES: %q is neither single nor cluster", p)
			}
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
	Role    string `json:"role"` // "worker" or "nats"
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
	n := startNATS(t, natsConfig{name: spec.Name, port: spec.Port, dir: spec.StoreDir, configure: func(o *server.Options) {
		// Logs to the child's log file; JetStream's limits from the machine.
		o.NoLog, o.Logtime = false, true
		o.JetStreamMaxMemory, o.JetStreamMaxStore = 0, 0
		if spec.ClusterPort > 0 {
			o.Cluster = server.ClusterOpts{Name: "buildq-scale", Host: "127.0.0.1", Port: spec.ClusterPort}
			o.Routes = server.RoutesFromStr(strings.Join(spec.Routes, ","))
		}
	}})
	srv := n.server()
	if err := os.WriteFile(spec.Ready, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	<-ctx.Done()
	rep := scaleReport{Name: spec.Name, Metrics: map[string]float64{}}
	if v, err := srv.Varz(nil); err == nil {
		rep.Metrics["in_msgs"], rep.Metrics["out_msgs"] = float64(v.InMsgs), float64(v.OutMsgs)
		rep.Metrics["in_bytes"], rep.Metrics["out_bytes"] = float64(v.InBytes), float64(v.OutBytes)
	}
	n.stop()
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
	// a small random image to the registry of the parent.
	reg := tlsRegistryClient(t, spec.Registry, spec.RegAddr, spec.RegCA)
	wld := newWorld(t, worldConfig{noNATS: true, node: nodeOptions{
		plan:     func(*batchv1.Job) buildPlan { return buildPlan{auto: true, after: spec.Build, succeed: true} },
		registry: reg,
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
	nc, err := nats.Connect(spec.NATS, nats.Name(spec.Name), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond))
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
					if l.GetName() == "origin" || l.GetName() == "status" {
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

func (p *scaleProc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// stop sends SIGTERM, waits for the exit and reads the child's report.
func (p *scaleProc) stop(t *testing.T, timeout time.Duration) scaleReport {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		t.Errorf("%s did not stop within %s:\n%s", p.spec.Name, timeout, p.tail())
	}
	var rep scaleReport
	b, err := os.ReadFile(p.spec.Report)
	if err == nil {
		err = json.Unmarshal(b, &rep)
	}
	if err != nil || p.err != nil {
		t.Errorf("%s: exit %v, report %v:\n%s", p.spec.Name, p.err, err, p.tail())
	}
	return rep
}

// cpuTicks reads the machine's busy and total CPU time (/proc/stat).
func cpuTicks() (busy, total uint64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	for i, f := range fields[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total
}

// procCPU is the CPU time (s) process pid has used, from /proc/<pid>/stat.
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command name, which is in parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	return (utime + stime) / 100 // USER_HZ
}

// cpuSample is the CPU time the benchmark's processes had used by a moment.
type cpuSample struct {
	at  time.Time
	cpu float64
}

// cpuBetween is the CPU time used between from and to, from the samples.
func cpuBetween(samples []cpuSample, from, to time.Time) float64 {
	at := func(t time.Time) float64 {
		v := 0.0
		for _, s := range samples {
			if s.at.After(t) {
				break
			}
			v = s.cpu
		}
		return v
	}
	return at(to) - at(from)
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// duBytes is the disk space the files under dir use (du).
func duBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil //nolint:nilerr // a file gone meanwhile counts nothing; the walk goes on
		}
		if info, err := d.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}

// scaleStreams are the streams P9 reports, with their short names.
var scaleStreams = []struct{ stream, label string }{
	{v1.RequestsStream, v1.RequestsStream},
	{v1.QueueStream, v1.QueueStream},
	{v1.ResultsStream, v1.ResultsStream},
	{"KV_" + v1.BuildsBucket, "KV " + v1.BuildsBucket},
	{"KV_" + v1.RequestsBucket, "KV " + v1.RequestsBucket + " (ledger)"},
	{"KV_" + v1.SlotsBucket, "KV " + v1.SlotsBucket},
}

type streamSize struct {
	msgs, bytes, lastSeq uint64
	leader               string // the stream's leader (clusters)
}

func streamSizes(ctx context.Context, js jetstream.JetStream) map[string]streamSize {
	out := map[string]streamSize{}
	for _, s := range scaleStreams {
		st, err := js.Stream(ctx, s.stream)
		if err != nil {
			continue
		}
		info, err := st.Info(ctx)
		if err != nil {
			continue
		}
		out[s.stream] = streamSize{msgs: info.State.Msgs, bytes: info.State.Bytes, lastSeq: info.State.LastSeq}
		if info.Cluster != nil {
			sz := out[s.stream]
			sz.leader = info.Cluster.Leader
			out[s.stream] = sz
		}
	}
	return out
}

// scaleTopology is one NATS deployment P9 runs against.
type scaleTopology struct {
	name, label string
	nodes       int
}

var scaleTopologies = map[string]scaleTopology{
	"single":  {name: "single", label: "single NATS", nodes: 1},
	"cluster": {name: "cluster", label: "3-node NATS cluster, replicas 3", nodes: 3},
}

// scaleRequest is request i: key i mod keys (so the requests of a key
// are interleaved with all the others), of the key's tenant.
func scaleRequest(s scaleSettings, i int) *v1.Request {
	k := i % s.Keys
	tenant := fmt.Sprintf("t%02d", k%s.Tenants)
	d := hex64(fmt.Sprint("scale-key-", k))
	return &v1.Request{
		Tenant: tenant, Name: "app", RequestID: fmt.Sprintf("r%07d", i),
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/" + tenant + "/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
	}
}

// scaleOutcome is what one topology's run measured.
type scaleOutcome struct {
	rows   []benchfmt.Row
	series benchfmt.Series
	notes  []string
}

// runScale runs one topology: NATS nodes, the registry, the workers; it
// publishes every request, waits for every result and checks them.
func runScale(t *testing.T, s scaleSettings, topo scaleTopology) scaleOutcome {
	dir := t.TempDir()
	p := topo.name + ": "
	var out scaleOutcome
	row := func(metric, unit string, v float64) {
		out.rows = append(out.rows, benchfmt.Plain(p+metric, unit, v))
	}
	var parentCPU0 = cpuSeconds()

	// The registry every worker's preflight, index check and node push
	// goes to: the test world's, in this process, over TLS.
	regCA := filepath.Join(dir, "registry.pem")
	reg := newTLSRegistry(t, scaleRegistryHost, regCA)
	defer reg.srv.Close()
	regHost := reg.host

	// NATS.
	var nodes []*scaleProc
	ports := make([]int, topo.nodes)
	cports := make([]int, topo.nodes)
	for i := range topo.nodes {
		ports[i] = freePort(t)
		if topo.nodes > 1 {
			cports[i] = freePort(t)
		}
	}
	var urls []string
	for i := range topo.nodes {
		spec := scaleChild{Role: "nats", Name: fmt.Sprintf("%s-nats-%d", topo.name, i), Port: ports[i],
			StoreDir: filepath.Join(dir, fmt.Sprintf("store-%d", i))}
		if topo.nodes > 1 {
			spec.ClusterPort = cports[i]
			for j := range topo.nodes {
				if j != i {
					spec.Routes = append(spec.Routes, fmt.Sprintf("nats-route://127.0.0.1:%d", cports[j]))
				}
			}
		}
		if s.ProfileDir != "" && i == 0 {
			spec.Profile = filepath.Join(s.ProfileDir, topo.name+"-nats.pprof")
		}
		nodes = append(nodes, startScaleChild(t, dir, "TestBenchScaleNATS", spec))
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", ports[i]))
	}
	for _, n := range nodes {
		n.waitReady(t, time.Minute)
	}
	natsURL := strings.Join(urls, ",")
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	replicas := min(topo.nodes, 3)
	// The streams and buckets, as a worker creates them (Setup waits for
	// a cluster still electing its meta leader).
	sw, err := New(nc, nil, Config{ID: "bench-setup", Replicas: replicas, Naming: naming.Policy{Registry: regHost},
		Logger: zaptest.NewLogger(t, zaptest.Level(zapcore.WarnLevel))})
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	err = sw.Setup(sctx)
	cancel()
	if err != nil {
		t.Fatalf("setting up the streams: %v", err)
	}
	ctx := context.Background()
	before := streamSizes(ctx, js)

	// Every result publish, as a subscriber sees it.
	var (
		mu        sync.Mutex
		firstAt   = map[string]time.Time{}
		publishes = map[string]int{}
		answered  atomic.Int64
	)
	sub, err := nc.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		id := m.Header.Get(v1.MsgIDHeader)
		now := time.Now()
		mu.Lock()
		publishes[id]++
		if _, ok := firstAt[id]; !ok {
			firstAt[id] = now
			answered.Add(1)
		}
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	// Workers.
	var workers []*scaleProc
	for i := range s.Workers {
		spec := scaleChild{Role: "worker", Name: fmt.Sprintf("%s-w%02d", topo.name, i), NATS: natsURL,
			Registry: regHost, RegAddr: reg.addr, RegCA: regCA,
			InFlight: s.InFlight, Build: s.Build, Replicas: replicas}
		if s.ProfileDir != "" && i == 0 {
			spec.Profile = filepath.Join(s.ProfileDir, topo.name+"-worker.pprof")
		}
		workers = append(workers, startScaleChild(t, dir, "TestBenchScaleWorker", spec))
	}
	for _, w := range workers {
		w.waitReady(t, 2*time.Minute)
	}
	t.Logf("%s: %d NATS node(s), %d workers ready; publishing %d requests over %d keys of %d tenants",
		topo.label, topo.nodes, s.Workers, s.Requests, s.Keys, s.Tenants)

	// Publish everything as fast as the stream takes it (a backlog), 32
	// publishers at once, each waiting for its PubAck.
	pub, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// The CPU time of every process of the benchmark, every second: the
	// cost of an answer, apart from what else runs on the machine.
	ourCPU := func() float64 {
		c := cpuSeconds()
		for _, p := range append(slices.Clone(nodes), workers...) {
			c += procCPU(p.cmd.Process.Pid)
		}
		return c
	}
	cpuSamples := []cpuSample{{at: time.Now(), cpu: ourCPU()}}
	start := time.Now()
	var published atomic.Int64
	publishDone := make(chan time.Duration, 1)
	go func() {
		next := make(chan int)
		var wg sync.WaitGroup
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					req := scaleRequest(s, i)
					var err error
					for range 20 {
						pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
						_, err = pub.Publish(pctx, req)
						cancel()
						if err == nil {
							break
						}
						time.Sleep(200 * time.Millisecond)
					}
					if err != nil {
						t.Errorf("publish %s: %v", req.RequestID, err)
						continue
					}
					published.Add(1)
				}
			}()
		}
		for i := range s.Requests {
			next <- i
		}
		close(next)
		wg.Wait()
		publishDone <- time.Since(start)
	}()

	// Wait for every answer, sampling the rate every 10 s.
	const window = 10 * time.Second
	deadline := start.Add(s.PhaseTimeout)
	var (
		publishTook time.Duration
		lastCount   int64
		lastAt      = start
		complete    bool
	)
	busy0, total0 := cpuTicks()
	busyStart, totalStart := busy0, total0
	out.series = benchfmt.Series{Name: "P9 " + topo.label, XLabel: "elapsed (s)", YLabel: "results/s (10 s windows)"}
	tick := time.NewTicker(time.Second)
	for !complete {
		<-tick.C
		cpuSamples = append(cpuSamples, cpuSample{at: time.Now(), cpu: ourCPU()})
		select {
		case publishTook = <-publishDone:
			t.Logf("%s: %d requests published in %s", topo.label, published.Load(), publishTook.Round(time.Millisecond))
		default:
		}
		n := answered.Load()
		now := time.Now()
		complete = n >= int64(s.Requests)
		if now.Sub(lastAt) >= window || complete {
			rate := float64(n-lastCount) / now.Sub(lastAt).Seconds()
			out.series.Points = append(out.series.Points, benchfmt.Point{X: now.Sub(start).Seconds(), Y: rate})
			sz := streamSizes(ctx, js)
			busy1, total1 := cpuTicks()
			cpu := 100 * float64(busy1-busy0) / float64(max(total1-total0, 1))
			busy0, total0 = busy1, total1
			t.Logf("%s: %6.0fs  answered %7d  %6.0f results/s  machine %3.0f%% busy  queued %d  ledger %d msgs %.1f MiB  builds %d msgs",
				topo.label, now.Sub(start).Seconds(), n, rate, cpu,
				sz[v1.RequestsStream].msgs+sz[v1.QueueStream].msgs, sz["KV_"+v1.RequestsBucket].msgs,
				float64(sz["KV_"+v1.RequestsBucket].bytes)/(1<<20), sz["KV_"+v1.BuildsBucket].msgs)
			lastCount, lastAt = n, now
		}
		if !complete && now.After(deadline) {
			t.Errorf("%s: %d of %d requests answered after %s", topo.label, n, s.Requests, s.PhaseTimeout)
			break
		}
	}
	tick.Stop()
	cpuSamples = append(cpuSamples, cpuSample{at: time.Now(), cpu: ourCPU()})
	busyEnd, totalEnd := cpuTicks()
	machineBusy := 100 * float64(busyEnd-busyStart) / float64(max(totalEnd-totalStart, 1))
	if publishTook == 0 {
		select {
		case publishTook = <-publishDone:
		case <-time.After(time.Minute):
		}
	}
	mu.Lock()
	var arrivals []time.Time
	for _, at := range firstAt {
		arrivals = append(arrivals, at)
	}
	republished := 0
	for _, c := range publishes {
		republished += c - 1
	}
	mu.Unlock()
	slices.SortFunc(arrivals, func(a, b time.Time) int { return a.Compare(b) })
	wall := time.Since(start)
	if len(arrivals) > 0 {
		wall = arrivals[len(arrivals)-1].Sub(start)
	}

	// Nothing left in the queues, nothing held.
	var q QueueState
	eventually := time.Now().Add(time.Minute)
	for {
		q, err = ReadQueueState(ctx, js)
		if err == nil && q.Messages == 0 && q.Held == 0 {
			break
		}
		if time.Now().After(eventually) {
			t.Errorf("%s: requests left in the streams: %+v (%v)", topo.label, q, err)
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	waitersLeft := 0
	if kv, err := js.KeyValue(ctx, v1.RequestsBucket); err == nil {
		if l, err := kv.ListKeysFiltered(ctx, "w.>"); err == nil {
			for range l.Keys() {
				waitersLeft++
			}
		}
	}
	if waitersLeft > 0 {
		t.Errorf("%s: %d waiter entries left in the ledger", topo.label, waitersLeft)
	}

	// Every stored result: one per request, every one a success, one
	// digest per key.
	stored := map[string]int{}
	origins := map[v1.Origin]int{}
	handling := map[v1.Origin][]float64{}
	var buildMs []float64 // the builds' own time: claim to outcome
	digests := map[string]string{}
	bad := 0
	rs, err := js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	ri, err := rs.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Read back from a consumer created anew (from the next sequence)
	// whenever a fetch fails: on a cluster a new consumer can take a moment
	// to answer.
	var (
		nextSeq  uint64 = 1
		failures int
		oc       jetstream.Consumer
	)
	for read := uint64(0); read < ri.State.Msgs; {
		if oc == nil {
			oc, err = rs.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
				DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: nextSeq})
		}
		var batch jetstream.MessageBatch
		if err == nil {
			batch, err = oc.Fetch(1000, jetstream.FetchMaxWait(5*time.Second))
		}
		if err != nil {
			if failures++; failures > 20 {
				t.Fatalf("reading the results: %v", err)
			}
			oc, err = nil, nil
			time.Sleep(500 * time.Millisecond)
			continue
		}
		got := 0
		for m := range batch.Messages() {
			got++
			read++
			if meta, err := m.Metadata(); err == nil {
				nextSeq = meta.Sequence.Stream + 1
			}
			var r v1.Result
			if err := json.Unmarshal(m.Data(), &r); err != nil {
				t.Errorf("result %s: %v", m.Data(), err)
				continue
			}
			stored[m.Headers().Get(v1.MsgIDHeader)]++
			origins[r.Data.Origin]++
			handling[r.Data.Origin] = append(handling[r.Data.Origin], r.Data.Timings.FinishedAt.Sub(r.Data.Timings.StartedAt).Seconds()*1000)
			if r.Data.Origin == v1.OriginBuild {
				buildMs = append(buildMs, float64(r.Data.Timings.BuildMs))
			}
			if r.Data.Status != v1.StatusSucceeded {
				if bad++; bad <= 5 {
					t.Errorf("%s: request %s: %s %s: %s", topo.label, r.Data.RequestID, r.Data.Status, r.Data.Reason, r.Data.Message)
				}
			}
			if d, ok := digests[r.Data.Key]; ok && d != r.Data.Digest {
				t.Errorf("%s: key %s answered with digests %s and %s", topo.label, r.Data.Key, d, r.Data.Digest)
			}
			digests[r.Data.Key] = r.Data.Digest
		}
		if got == 0 {
			if err := batch.Error(); err != nil && failures < 20 {
				failures++
				oc = nil
				continue
			}
			t.Fatalf("reading the results: nothing after %d of %d (%v)", read, ri.State.Msgs, batch.Error())
		}
	}
	if bad > 0 {
		t.Errorf("%s: %d results did not succeed", topo.label, bad)
	}
	twice := 0
	for _, c := range stored {
		if c > 1 {
			twice++
		}
	}
	missing := 0
	for i := range s.Requests {
		r := scaleRequest(s, i)
		if stored[v1.MsgID(r.Tenant, r.RequestID)] == 0 {
			missing++
		}
	}
	if twice > 0 || missing > 0 || len(stored) != s.Requests {
		t.Errorf("%s: %d results stored for %d requests: %d requests without a result, %d with more than one",
			topo.label, ri.State.Msgs, s.Requests, missing, twice)
	}
	if len(digests) != s.Keys {
		t.Errorf("%s: results name %d keys, want %d", topo.label, len(digests), s.Keys)
	}
	after := streamSizes(ctx, js)

	// Workers down: their Jobs and figures.
	jobs := map[string]int{}
	jobsLeft := 0
	var rss, wcpu []float64
	metrics := map[string]float64{}
	var slotSamples [][]slotSample
	for _, w := range workers {
		rep := w.stop(t, time.Minute)
		for name, c := range rep.Jobs {
			jobs[name] += c
		}
		jobsLeft += rep.JobsLeft
		rss = append(rss, rep.RSSMiB)
		wcpu = append(wcpu, rep.CPUSeconds)
		slotSamples = append(slotSamples, rep.Slots)
		for k, v := range rep.Metrics {
			metrics[k] += v
		}
		for _, e := range rep.Errors {
			t.Errorf("%s: emulated kubelet: %s", rep.Name, e)
		}
	}
	created, multi := 0, 0
	for _, c := range jobs {
		created += c
		if c > 1 {
			multi++
		}
	}
	if len(jobs) != s.Keys || multi > 0 {
		t.Errorf("%s: %d Jobs created for %d keys (%d keys had more than one)", topo.label, created, s.Keys, multi)
	}
	if jobsLeft > 0 {
		t.Errorf("%s: %d Jobs left behind", topo.label, jobsLeft)
	}
	_ = nc.Drain()

	// NATS down: store size and figures.
	var natsRSS, natsCPU, store []float64
	natsMetrics := map[string]float64{}
	for i, n := range nodes {
		rep := n.stop(t, time.Minute)
		natsRSS = append(natsRSS, rep.RSSMiB)
		natsCPU = append(natsCPU, rep.CPUSeconds)
		for k, v := range rep.Metrics {
			natsMetrics[k] += v
		}
		store = append(store, float64(duBytes(filepath.Join(dir, fmt.Sprintf("store-%d", i))))/(1<<20))
	}
	parentCPU := cpuSeconds() - parentCPU0

	// Figures.
	rate := func(from, to int) float64 {
		if to >= len(arrivals) || from >= to {
			return 0
		}
		return float64(to-from) / arrivals[to].Sub(arrivals[from]).Seconds()
	}
	n := len(arrivals)
	row("requests answered", "requests", float64(n))
	row("wall time", "s", wall.Seconds())
	row("throughput", "requests/s", float64(n)/wall.Seconds())
	for q := range 4 {
		row(fmt.Sprintf("throughput, answers %d–%d%%", 25*q, 25*(q+1)), "requests/s", rate(n*q/4, min(n*(q+1)/4, n-1)))
	}
	// What an answer costs in CPU, all processes together: a cost that
	// rises as the buckets and streams grow is what stops scaling; a rate
	// that falls at a flat cost is the machine's other load.
	cost := func(a, b int) float64 {
		return 1000 * cpuBetween(cpuSamples, arrivals[a], arrivals[b]) / float64(b-a)
	}
	for q := range 4 {
		if a, b := n*q/4, min(n*(q+1)/4, n-1); a < b {
			row(fmt.Sprintf("CPU per answer, all processes, answers %d–%d%%", 25*q, 25*(q+1)), "ms", cost(a, b))
		}
	}
	// How busy the slots were: all slots in use means the answers wait on
	// the builds (or on the handlers); idle slots with a backlog mean they
	// wait on what feeds the slots.
	busy := func(from, to time.Time) float64 {
		var used, n float64
		for _, ss := range slotSamples {
			for _, x := range ss {
				if at := time.UnixMilli(x.At); !at.Before(from) && at.Before(to) {
					used += float64(x.Busy)
					n++
				}
			}
		}
		if n == 0 {
			return 0
		}
		return 100 * used / n / float64(s.InFlight)
	}
	for q := range 4 {
		if a, b := n*q/4, min(n*(q+1)/4, n-1); a < b {
			row(fmt.Sprintf("worker slots in use, answers %d–%d%%", 25*q, 25*(q+1)), "%", busy(arrivals[a], arrivals[b]))
		}
	}
	row("publish time (all requests stored)", "s", publishTook.Seconds())
	row("Jobs created", "Jobs", float64(created))
	row("answers from a build", "requests", float64(origins[v1.OriginBuild]))
	row("answers joining a build in flight", "requests", float64(origins[v1.OriginInflight]))
	row("answers from the index", "requests", float64(origins[v1.OriginCache]))
	for _, o := range []v1.Origin{v1.OriginBuild, v1.OriginInflight, v1.OriginCache} {
		if hs := handling[o]; len(hs) > 0 {
			row(fmt.Sprintf("handling time of an answer %s, p50", originLabel[o]), "ms", benchfmt.Percentile(hs, 50))
			row(fmt.Sprintf("handling time of an answer %s, p99", originLabel[o]), "ms", benchfmt.Percentile(hs, 99))
		}
	}
	row(fmt.Sprintf("a build's time from its claim to its outcome (emulated build: %s), p50", s.Build), "ms", benchfmt.Percentile(buildMs, 50))
	row("results published again (same result, dropped by the stream)", "publishes", float64(republished))
	row("requests parked", "requests", metrics["buildq_parked_requests_total"])
	row("transient retries", "retries", metrics["buildq_retries_total"])
	row("worker peak RSS, max", "MiB", slices.Max(rss))
	row("worker peak RSS, mean", "MiB", mean(rss))
	row("NATS peak RSS, max node", "MiB", slices.Max(natsRSS))
	row("NATS store on disk, max node", "MiB", slices.Max(store))
	if topo.nodes > 1 {
		row("NATS store on disk, all nodes", "MiB", sum(store))
	}
	for _, st := range scaleStreams {
		b, a := before[st.stream], after[st.stream]
		if strings.HasPrefix(st.stream, "KV_") {
			row(st.label+" messages, before", "messages", float64(b.msgs))
			row(st.label+" bytes, before", "MiB", float64(b.bytes)/(1<<20))
		}
		row(st.label+" messages, after", "messages", float64(a.msgs))
		row(st.label+" bytes, after", "MiB", float64(a.bytes)/(1<<20))
		row(st.label+" writes per request", "writes", float64(a.lastSeq-b.lastSeq)/float64(max(n, 1)))
	}
	row("messages into the NATS servers per request (clients and routes)", "messages", natsMetrics["in_msgs"]/float64(max(n, 1)))
	row("messages out of the NATS servers per request", "messages", natsMetrics["out_msgs"]/float64(max(n, 1)))
	ledger := after["KV_"+v1.RequestsBucket]
	row("ledger bytes per request", "B", float64(ledger.bytes)/float64(max(n, 1)))
	row("CPU, NATS (all nodes)", "CPU-s", sum(natsCPU))
	row("CPU, workers (all)", "CPU-s", sum(wcpu))
	row("CPU, harness (registry, publisher, result reader)", "CPU-s", parentCPU)
	machine := (cpuSamples[len(cpuSamples)-1].cpu - cpuSamples[0].cpu) / (cpuSamples[len(cpuSamples)-1].at.Sub(cpuSamples[0].at).Seconds() * float64(benchfmt.ThisMachine().CPUs))
	row("CPU of the machine used by this benchmark's processes", "%", 100*machine)
	row("CPU of the machine busy (all processes, /proc/stat)", "%", machineBusy)

	// What bounds it.
	total := sum(natsCPU) + sum(wcpu) + parentCPU
	// The first answers include every build (the first request of each key);
	// the second quarter on are answered mostly from the index.
	second, last := rate(n/4, n/2), rate(n-n/4, n-1)
	out.notes = append(out.notes, fmt.Sprintf(
		"%s: %d requests answered in %.0f s (%.0f/s; answers 25–50%%: %.0f/s, 75–100%%: %.0f/s); CPU: NATS %.0f%%, workers %.0f%%, harness %.0f%% of %.0f CPU-s; the machine was %.0f%% busy (%.0f%% by these processes).",
		topo.label, n, wall.Seconds(), float64(n)/wall.Seconds(), second, last,
		100*sum(natsCPU)/total, 100*sum(wcpu)/total, 100*parentCPU/total, total, machineBusy, 100*machine))
	// What stops scaling first: the CPU each kind of process spends per
	// answer. Workers scale out; a NATS server's share does not, and on a
	// cluster its busiest node (the leaders of the hottest streams) bounds.
	if n > 0 {
		natsPer := 1000 * slices.Max(natsCPU) / float64(n)
		workerPer := 1000 * sum(wcpu) / float64(n)
		out.notes = append(out.notes, fmt.Sprintf(
			"%s: what stops scaling: per answer (whole run, builds included), the busiest NATS node spent %.2f ms of CPU and the workers %.2f ms together. Workers scale out; that NATS node does not: at one core of its own it would answer at most about %.0f requests/s, the ceiling of this topology whatever the number of workers. Worker memory stayed flat (peak RSS %.0f MiB at most); the NATS node's grew with what it stores (peak %.0f MiB for a %.0f MiB store).",
			topo.label, natsPer, workerPer, 1000/natsPer, slices.Max(rss), slices.Max(natsRSS), slices.Max(store)))
	}
	// The builds: the first answers, one per key.
	if hs := handling[v1.OriginBuild]; len(hs) > 0 && n >= 4 {
		slots := s.Workers * s.InFlight
		used := busy(arrivals[0], arrivals[n/4])
		held := benchfmt.Percentile(hs, 50)
		out.notes = append(out.notes, fmt.Sprintf(
			"%s: the builds come first (the first request of every key): %d slots (%d workers × %d) were %.0f%% in use during the first quarter of the answers and a build held its slot %.0f ms (p50; %s emulated, %.0f ms from claim to outcome), so builds ran at about %.0f/s: bound by slots × build time, not by the queue.",
			topo.label, slots, s.Workers, s.InFlight, used, held, s.Build, benchfmt.Percentile(buildMs, 50), float64(slots)*used/100/(held/1000)))
	}
	// What grows with the traffic: the ledger and the results are kept for
	// --results-max-age (7 days by default), one entry each per request.
	res := after[v1.ResultsStream]
	perReq := float64(ledger.bytes+res.bytes) / float64(max(n, 1))
	out.notes = append(out.notes, fmt.Sprintf(
		"%s: kept per request: %.0f B of ledger and %.0f B of result; at this run's %.0f requests/s sustained, the default 7-day retention (--results-max-age) would hold %.0f GiB per replica — linear in traffic × retention, the first thing to size.",
		topo.label, float64(ledger.bytes)/float64(max(n, 1)), float64(res.bytes)/float64(max(n, 1)), float64(n)/wall.Seconds(),
		perReq*float64(n)/wall.Seconds()*7*24*3600/(1<<30)))
	// Compared: the last quarter of the answers with the first of the
	// second and third that began after the last request was published
	// (before, publishing and intake share the CPU).
	base := 0
	for q := 1; q <= 2 && n >= 8; q++ {
		if arrivals[n*q/4].After(start.Add(publishTook)) {
			base = q
			break
		}
	}
	// The CPU is sampled every second: quarters shorter than 10 s are
	// not compared.
	long := func(a, b int) bool { return arrivals[b].Sub(arrivals[a]) >= 10*time.Second }
	if base > 0 && long(n*base/4, n*(base+1)/4) && long(n-n/4, n-1) {
		c2, c4 := cost(n*base/4, n*(base+1)/4), cost(n-n/4, n-1)
		second := rate(n*base/4, n*(base+1)/4)
		which := map[int]string{1: "second", 2: "third"}[base]
		switch {
		case c4 > 1.2*c2:
			out.notes = append(out.notes, fmt.Sprintf(
				"%s: an answer's CPU cost (all processes) rose %.0f%% from the %s quarter of the answers to the last (%.1f → %.1f ms) while the ledger grew to %d entries (%.1f MiB) and the results stream to %d: the cost grows with the stored state.",
				topo.label, 100*(c4/c2-1), which, c2, c4, ledger.msgs, float64(ledger.bytes)/(1<<20), res.msgs))
		default:
			out.notes = append(out.notes, fmt.Sprintf(
				"%s: an answer's CPU cost (all processes) went from %.1f ms in the %s quarter of the answers to %.1f ms in the last while the ledger grew to %d entries (%.1f MiB) and the results stream to %d: nothing here costs more as the stored state grows; the rate (%.0f → %.0f/s) followed the CPU the machine's other load left over.",
				topo.label, c2, which, c4, ledger.msgs, float64(ledger.bytes)/(1<<20), res.msgs, second, last))
		}
	}
	if topo.nodes > 1 {
		var leaders []string
		for _, st := range scaleStreams {
			if l := after[st.stream].leader; l != "" {
				leaders = append(leaders, st.label+" on "+strings.TrimPrefix(l, topo.name+"-"))
			}
		}
		var per []string
		for i, c := range natsCPU {
			per = append(per, fmt.Sprintf("nats-%d %.0f", i, c))
		}
		out.notes = append(out.notes, fmt.Sprintf(
			"%s: every stream and bucket is one Raft group whose leader takes all its writes (%.1f ledger writes per request); stream leaders: %s; CPU-s by node: %s.",
			topo.label, float64(ledger.lastSeq)/float64(max(n, 1)), strings.Join(leaders, ", "), strings.Join(per, ", ")))
	}
	return out
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
	for _, name := range s.Topologies {
		o := runScale(t, s, scaleTopologies[name])
		res.Rows = append(res.Rows, o.rows...)
		res.Series = append(res.Series, o.series)
		res.Notes = append(res.Notes, o.notes...)
		if t.Failed() {
			break
		}
	}
	res.Notes = append(res.Notes, fmt.Sprintf(
		"Emulated: each worker process has its own fake Kubernetes API server (the test world's, worker/world_api_test.go: client-go's fake clientset on one object store with resource versions and resumable watches, so its informers see only its own Jobs) and the test world's node (worker/world_node_test.go), which ends every Job %s after its creation: it pushes a small random image to the Job's destinations, then writes the Pod with the digest as the kaniko container's termination message and the Job's Complete condition. Real: the worker package with the kaniko Job backend, %d slots per worker, production defaults (AckWait and lease 30 s), NATS over TCP with file storage, go-containerregistry's registry (in memory, in the harness process, over TLS) for the preflight, the index checks and the pushes. Requests are published as one backlog, key i mod %d, so the %d requests of a key are spread over the whole run.",
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
