package worker

// The fault simulation's world: the test world (world_test.go) — NATS,
// restarted by the schedule; the API server, each worker with a client of
// its own that faults are injected into; the node, whose builds end by
// themselves at seeded times (simPlanner) with a TTL controller; the
// registry — and, around it, the simulation's record of the node's Jobs
// (simNode), the producer, and the worker slots, each behind a TCP proxy
// of its own.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/static"
	ggcrtypes "github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/publisher"
)

// Timing of the simulated world. Lease and AckWait are the worker's
// validated minimums.
const (
	simLease      = time.Second
	simAckWait    = time.Second
	simMaxDeliver = 20
	simTTL        = 4 * time.Second // the fake TTL controller
	simBuildFloor = 200 * time.Millisecond
	simBuildSpan  = 1800 * time.Millisecond
)

// simTrace is what happened, for a failing seed's report.
type simTrace struct {
	mu      sync.Mutex
	t0      time.Time
	lines   []string
	dropped int
}

const simTraceMax = 500

func (tr *simTrace) rel() time.Duration {
	tr.mu.Lock()
	t0 := tr.t0
	tr.mu.Unlock()
	return time.Since(t0)
}

// since is t on the trace's clock (t0 = 0).
func (tr *simTrace) since(t time.Time) time.Duration {
	tr.mu.Lock()
	t0 := tr.t0
	tr.mu.Unlock()
	return t.Sub(t0)
}

func (tr *simTrace) add(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	tr.mu.Lock()
	line := fmt.Sprintf("%7.3fs  %s", time.Since(tr.t0).Seconds(), msg)
	defer tr.mu.Unlock()
	if len(tr.lines) >= simTraceMax {
		tr.dropped++
		return
	}
	tr.lines = append(tr.lines, line)
}

// simLogBuffer keeps the workers' logs (printed with BUILDQ_SIM_LOGS=1).
type simLogBuffer struct {
	mu    sync.Mutex
	lines []string
}

func (b *simLogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.lines) < 5000 {
		b.lines = append(b.lines, strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (b *simLogBuffer) Sync() error { return nil }

// simJob is the simulation's record of one Job (by UID).
type simJob struct {
	key, name, uid, creator string
	run, tenant             string
	content                 string
	created                 time.Duration
	finished                time.Duration // 0: not finished
	succeeded               bool
	deleted                 time.Duration // 0: not deleted
	deleteCause             string
}

// simDeletion is a Job deletion the workers did not make (external, TTL).
type simDeletion struct {
	key   string
	at    time.Duration
	cause string
}

// simFailure is a build the node failed.
type simFailure struct {
	key string
	at  time.Duration
}

// simNode is the simulation's record of what the world's node (a
// fakeNode: world_node_test.go) did with the Jobs: every creation,
// deletion and end, on the trace's clock, in the API server's order.
type simNode struct {
	w        *simWorld
	mu       sync.Mutex
	jobs     map[string]*simJob // by UID
	order    []*simJob
	failures []simFailure
	deletes  []simDeletion
	twoJobs  []string
}

// observe records a Job's creation or deletion (the node's observe hook,
// under the API mutex).
func (n *simNode) observe(ev apiEvent, cause string, plan buildPlan) {
	job := ev.obj.(*batchv1.Job)
	w := n.w
	n.mu.Lock()
	defer n.mu.Unlock()
	switch ev.typ {
	case watch.Added:
		key := job.Annotations[kaniko.AnnotationKey]
		j := &simJob{key: key, name: job.Name, uid: string(job.UID), creator: cause, content: simContentOf(job), created: w.trace.rel(),
			run: job.Annotations[kaniko.AnnotationRun], tenant: job.Labels[kaniko.LabelTenant]}
		for _, o := range n.order {
			if o.key == key && o.deleted == 0 {
				n.twoJobs = append(n.twoJobs, fmt.Sprintf("job %s (%s) of key %s created by %s at %.3fs while job %s (%s, created by %s at %.3fs) still existed",
					j.name, j.uid, w.keyName(key), cause, j.created.Seconds(), o.name, o.uid, o.creator, o.created.Seconds()))
			}
		}
		n.jobs[j.uid] = j
		n.order = append(n.order, j)
		w.trace.add("job   %s %s %s created by %s (run %d: will %s after %s)", w.keyName(key), j.name[:14], j.uid, cause, plan.seq,
			map[bool]string{true: "succeed", false: "fail"}[plan.succeed], plan.after)
	case watch.Deleted:
		j := n.jobs[string(job.UID)]
		if j == nil {
			return
		}
		j.deleted, j.deleteCause = w.trace.rel(), cause
		if !strings.HasPrefix(cause, "w") {
			n.deletes = append(n.deletes, simDeletion{key: j.key, at: j.deleted, cause: cause})
		}
		state := "running"
		if j.finished != 0 {
			state = map[bool]string{true: "succeeded", false: "failed"}[j.succeeded]
		}
		w.trace.add("job   %s %s %s deleted by %s (%s)", w.keyName(j.key), j.name[:14], j.uid, cause, state)
	}
}

// ended records a build's end (the node's ended hook, under the API
// mutex).
func (n *simNode) ended(job *batchv1.Job, ok bool) {
	w := n.w
	n.mu.Lock()
	j := n.jobs[string(job.UID)]
	if j != nil {
		j.finished, j.succeeded = w.trace.rel(), ok
		if !ok {
			n.failures = append(n.failures, simFailure{key: j.key, at: j.finished})
		}
	}
	n.mu.Unlock()
	if j != nil {
		w.trace.add("job   %s %s %s %s", w.keyName(j.key), j.name[:14], j.uid, map[bool]string{true: "succeeded", false: "FAILED"}[ok])
	}
}

// simContentOf is what decides a Job's image: the executor arguments that
// change the content, not where it is pushed.
func simContentOf(job *batchv1.Job) string {
	if len(job.Spec.Template.Spec.Containers) == 0 {
		return ""
	}
	return simContentArgs(job.Spec.Template.Spec.Containers[0].Args)
}

func simContentArgs(args []string) string {
	var keep []string
	for _, a := range args {
		for _, p := range []string{"--context=", "--context-sub-path=", "--dockerfile=", "--build-arg=", "--target=", "--label=", "--custom-platform="} {
			if strings.HasPrefix(a, p) {
				keep = append(keep, a)
			}
		}
	}
	sort.Strings(keep)
	return strings.Join(keep, "\n")
}

// simPlanner plans the simulation's builds: the n-th Job of a key runs
// for a time and succeeds or fails as a hash of the seed, the key and n
// says (failing with probability failProb of the key).
type simPlanner struct {
	seed     int64
	failProb func(key string) float64

	mu   sync.Mutex
	runs map[string]int
}

func newSimPlanner(seed int64, failProb func(key string) float64) *simPlanner {
	return &simPlanner{seed: seed, failProb: failProb, runs: map[string]int{}}
}

func (p *simPlanner) plan(job *batchv1.Job) buildPlan {
	key := job.Annotations[kaniko.AnnotationKey]
	p.mu.Lock()
	run := p.runs[key]
	p.runs[key]++
	p.mu.Unlock()
	h := simHash(p.seed, key, run)
	return buildPlan{
		auto:    true,
		after:   simBuildFloor + time.Duration(h/1000%uint64(simBuildSpan/time.Millisecond))*time.Millisecond,
		succeed: float64(h%1000)/1000 >= p.failProb(key),
		seq:     run,
	}
}

// simNodeOptions is the simulation's node: builds that end by themselves
// as the planner says, each pushing its content's image (simImageFor), and
// a TTL controller (simTTL) unless ttl is false.
func simNodeOptions(p *simPlanner, ttl bool) nodeOptions {
	o := nodeOptions{
		plan: p.plan,
		image: func(job *batchv1.Job) (ggcrv1.Image, error) {
			im, err := simImageFor(simContentOf(job))
			return im.img, err
		},
	}
	if ttl {
		o.ttl = simTTL
	}
	return o
}

// deleteExternally deletes a Job (or a Pod) as an operator would; it
// prefers a Job still running.
func (w *simWorld) deleteExternally(pods bool, pick int) {
	api := w.world.api
	_ = api.do(func() error {
		if pods {
			l, err := api.tracker.List(podsGVR, kindOf(podsGVR), testNamespace)
			if err != nil {
				return err
			}
			items := l.(*corev1.PodList).Items
			if len(items) == 0 {
				w.trace.add("fault pod-delete: no pod to delete")
				return nil
			}
			p := items[pick%len(items)]
			w.trace.add("fault pod-delete: %s", p.Name)
			return api.removeLocked(podsGVR, testNamespace, p.Name, "external")
		}
		l, err := api.tracker.List(jobsGVR, kindOf(jobsGVR), testNamespace)
		if err != nil {
			return err
		}
		var running, all []batchv1.Job
		for _, j := range l.(*batchv1.JobList).Items {
			if j.DeletionTimestamp != nil {
				continue
			}
			all = append(all, j)
			if done, _ := kube.Finished(&j); !done {
				running = append(running, j)
			}
		}
		if len(running) > 0 {
			all = running
		}
		if len(all) == 0 {
			w.trace.add("fault job-delete: no job to delete")
			return nil
		}
		j := all[pick%len(all)]
		w.trace.add("fault job-delete: %s %s", w.keyName(j.Annotations[kaniko.AnnotationKey]), j.UID)
		return api.deleteJobLocked(testNamespace, j.Name, metav1.DeleteOptions{}, "external")
	})
}

func simHash(seed int64, key string, run int) uint64 {
	var b bytes.Buffer
	_ = binary.Write(&b, binary.LittleEndian, seed)
	b.WriteString(key)
	_ = binary.Write(&b, binary.LittleEndian, int64(run))
	sum := hex64(b.String())
	var h uint64
	for _, c := range sum[:15] {
		h = h*16 + uint64(strings.IndexRune("0123456789abcdef", c))
	}
	return h
}

// simImages are the deterministic images of the simulation: one per
// content (the executor arguments that decide an image).
type simImages struct {
	mu sync.Mutex
	m  map[string]simImage
}

type simImage struct {
	digest string
	img    ggcrv1.Image
}

var simImageCache = &simImages{m: map[string]simImage{}}

func simImageFor(content string) (simImage, error) {
	simImageCache.mu.Lock()
	defer simImageCache.mu.Unlock()
	if im, ok := simImageCache.m[content]; ok {
		return im, nil
	}
	img, err := mutate.AppendLayers(empty.Image, static.NewLayer([]byte(content), ggcrtypes.OCILayer))
	if err != nil {
		return simImage{}, err
	}
	d, err := img.Digest()
	if err != nil {
		return simImage{}, err
	}
	im := simImage{digest: d.String(), img: img}
	simImageCache.m[content] = im
	return im, nil
}

// simProc is one running worker process.
type simProc struct {
	id     string
	slot   *simSlot
	nc     *nats.Conn
	client *apiClient
	cancel context.CancelFunc
	done   chan struct{}
	killed atomic.Bool
}

// simSlot is a place in the pool: a worker, and its replacements.
type simSlot struct {
	idx  int
	skew time.Duration
	// proxy carries the slot's workers' NATS traffic (lag, partition).
	proxy   *simProxy
	mu      sync.Mutex
	gen     int
	proc    *simProc
	pending *time.Timer
	pauses  map[string][]time.Duration
	// stallNext: the next handler to read a build record cuts the worker
	// off NATS and blocks this long ("stall").
	stallNext time.Duration
}

func (s *simSlot) takePause(hook string) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.pauses[hook]
	if len(q) == 0 {
		return 0
	}
	s.pauses[hook] = q[1:]
	return q[0]
}

// simWorld is one schedule's world.
type simWorld struct {
	t       *testing.T
	seed    int64
	sc      *simSchedule
	trace   *simTrace
	logs    *simLogBuffer
	metrics *Metrics

	// world: NATS, the API server, the node, the registry.
	world    *world
	node     *simNode // the record of the node's Jobs
	obs      *nats.Conn
	js       jetstream.JetStream
	pub      *publisher.Client
	identity string
	slots    []*simSlot
	procs    []*simProc

	setupMu  sync.Mutex
	faultsOn atomic.Bool
	lostAcks atomic.Int32
	ops      sync.WaitGroup

	keyNames map[string]string

	mu        sync.Mutex
	subs      []*simSub
	subByID   map[string]*simSub
	cancels   []*simCancel
	published []simPublish // results seen on the core subscription
	apiFaults int
	notes     []string

	finalStored []simStored
	// records: the build records' revisions, as the observer saw them.
	records []simRecordRev
	events  []simEvent
	ingest  []simIngest
	// ledger: the accepted requests' ledger entries once settled.
	ledger   map[string]*v1.RequestEntry
	quiet    time.Duration
	registry map[string]string // image → digest (or error) at the end
	// indexed: every succeeded record's Repository@Digest → nil when the
	// registry has it at the end, else the error of its HEAD.
	indexed map[string]error
}

// simSub is one submission: a request id and what the producer saw.
type simSub struct {
	id       string
	req      *v1.Request
	key      string
	content  string
	label    string
	start    time.Duration // publish started
	accepted bool          // a PubAck came back (stored once)
	reacc    int           // duplicate publishes the stream stored again
}

// simCancel is a cancel request and what came of it.
type simCancel struct {
	target, key, tenant, name string
	sent, done                time.Duration // done: reply received; simNever when unknown
	canceled                  bool
	reply                     string
}

// simPublish is one result publish seen on the core subscription.
type simPublish struct {
	id      string
	subject string
	at      time.Duration
	r       v1.Result
}

func (w *simWorld) now() time.Duration { return w.trace.rel() }

func (w *simWorld) keyName(key string) string {
	if n, ok := w.keyNames[key]; ok {
		return n
	}
	if len(key) > 8 {
		return "key:" + key[:8]
	}
	return "key:" + key
}

func (w *simWorld) note(format string, args ...any) {
	w.mu.Lock()
	w.notes = append(w.notes, fmt.Sprintf(format, args...))
	w.mu.Unlock()
}

func (w *simWorld) connect(name string) (*nats.Conn, error) {
	return w.connectTo(w.world.nats.url(), name)
}

func (w *simWorld) connectTo(url, name string) (*nats.Conn, error) {
	return nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
		nats.ReconnectJitter(10*time.Millisecond, 10*time.Millisecond), nats.RetryOnFailedConnect(true),
		nats.Timeout(2*time.Second))
}

func (w *simWorld) workerConfig(id string, slot int, skew time.Duration) Config {
	enc := zap.NewDevelopmentEncoderConfig()
	enc.TimeKey = ""
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w.logs), zapcore.InfoLevel)
	logger := zap.New(core)
	return Config{
		ID:              id,
		MaxInFlight:     4,
		AckWait:         w.sc.ackWaits[slot],
		MaxDeliver:      simMaxDeliver,
		Lease:           w.sc.leases[slot],
		ShutdownTimeout: 5 * time.Second,
		Naming:          naming.Policy{Registry: w.world.reg.host},
		Registry:        w.world.reg.client,
		Logger:          logger.Named(id),
		Metrics:         w.metrics,
		Now:             func() time.Time { return time.Now().Add(skew) },
		Fair:            w.fair(),
	}
}

// fair gives odd seeds fair-queueing rules: acme at most 2 requests at
// once across all workers, globex twice acme's share.
func (w *simWorld) fair() FairConfig {
	if w.seed%2 == 0 {
		return FairConfig{}
	}
	return FairConfig{Concurrency: map[string]int{"acme": 2}, Weights: map[string]int{"globex": 2}}
}

var simKaniko = func() kaniko.Config {
	kc := testKaniko
	kc.InsecureRegistries = nil
	return kc
}()

// start starts the slot's next worker.
func (w *simWorld) start(s *simSlot) {
	s.mu.Lock()
	id := fmt.Sprintf("w%d.%d", s.idx, s.gen)
	s.gen++
	s.pending = nil
	s.mu.Unlock()

	client := w.world.api.newClient(id, w.runtimeRand())
	client.onFault = func(verb, name string, err error) {
		w.trace.add("api   %s: %s job %s failed: %v", id, verb, name, err)
	}
	nc, err := w.connectTo(s.proxy.url(), id)
	if err != nil {
		w.t.Errorf("harness: connect %s: %v", id, err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &simProc{id: id, slot: s, nc: nc, client: client, cancel: cancel, done: make(chan struct{})}
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()
	w.mu.Lock()
	w.procs = append(w.procs, p)
	w.mu.Unlock()
	w.trace.add("work  %s started (clock %+v)", id, s.skew)

	factory := kube.NewInformerFactory(client, simKaniko.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		w.t.Errorf("harness: watcher: %v", err)
		cancel()
		close(p.done)
		return
	}
	backend, err := NewKubeBackend(client, watcher, simKaniko)
	if err != nil {
		w.t.Errorf("harness: backend: %v", err)
		cancel()
		close(p.done)
		return
	}
	backend.WithDigestResolver(func(ctx context.Context, ref string) (string, error) { return w.world.reg.client.Head(ctx, ref) })
	w.mu.Lock()
	if w.identity == "" {
		w.identity = backend.Identity()
	}
	w.mu.Unlock()
	factory.Start(ctx.Done())
	cfg := w.workerConfig(id, s.idx, s.skew)
	go func() {
		defer close(p.done)
		defer factory.Shutdown()
		defer nc.Close()
		sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
		synced := watcher.WaitForSync(sctx)
		scancel()
		if !synced {
			if ctx.Err() == nil {
				w.trace.add("work  %s: informers did not sync", id)
			}
			return
		}
		for ctx.Err() == nil {
			wk, err := New(nc, backend, cfg)
			if err != nil {
				w.t.Errorf("harness: New(%s): %v", id, err)
				return
			}
			wk.faults = &faultHooks{
				loseAck: func(requestID string) bool {
					if p.killed.Load() || !w.faultsOn.Load() {
						return false
					}
					for {
						n := w.lostAcks.Load()
						if n <= 0 {
							return false
						}
						if w.lostAcks.CompareAndSwap(n, n-1) {
							w.trace.add("fault %s: ack of %s lost", id, requestID)
							return true
						}
					}
				},
				beforeRenew: func(key string) {
					if d := s.takePause("renew"); d > 0 && !p.killed.Load() {
						w.trace.add("fault %s: paused %s before renewing %s", id, d, w.keyName(key))
						time.Sleep(d)
						w.trace.add("fault %s: resumed (renew %s)", id, w.keyName(key))
					}
				},
				beforeWalk: func(key string) {
					s.mu.Lock()
					d := s.stallNext
					s.mu.Unlock()
					if d == 0 || p.killed.Load() || !w.faultsOn.Load() || !w.claimable(key) {
						return
					}
					s.mu.Lock()
					d, s.stallNext = s.stallNext, 0
					s.mu.Unlock()
					if d > 0 {
						// Cut off, its heartbeats fail and its request is
						// redelivered elsewhere; it goes on afterwards
						// with what it knew.
						s.proxy.partition()
						w.trace.add("fault %s: a handler stalls %s before reading %s, the worker cut off NATS", id, d.Round(time.Millisecond), w.keyName(key))
						time.Sleep(d)
						s.proxy.heal()
						w.trace.add("fault %s: the stalled handler goes on (%s)", id, w.keyName(key))
					}
				},
				beforeFinalize: func(key string) {
					if d := s.takePause("finalize"); d > 0 && !p.killed.Load() {
						w.trace.add("fault %s: paused %s before finalizing %s", id, d, w.keyName(key))
						time.Sleep(d)
						w.trace.add("fault %s: resumed (finalize %s)", id, w.keyName(key))
					}
				},
			}
			// One Setup at a time in a world: nats-server 2.15 races
			// (-race) between a stream update and a consumer create
			// from two clients at once.
			w.setupMu.Lock()
			sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
			err = wk.Setup(sctx)
			scancel()
			w.setupMu.Unlock()
			if err == nil {
				err = wk.Run(ctx)
			}
			if ctx.Err() != nil {
				break
			}
			if !p.killed.Load() {
				w.trace.add("work  %s: Run returned %v; starting it again", id, err)
			}
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
			}
		}
		if !p.killed.Load() {
			w.trace.add("work  %s stopped", id)
		}
	}()
}

// kill is SIGKILL: the connection drops first (no hand-back, no ack), the
// API client dies, then everything is abandoned.
func (w *simWorld) kill(p *simProc) {
	p.killed.Store(true)
	p.nc.Close()
	p.client.dead.Store(true)
	w.world.api.breakWatches(p.client, false)
	p.cancel()
	w.trace.add("fault %s killed (SIGKILL)", p.id)
}

// term is SIGTERM: the worker hands its requests back and stops.
func (w *simWorld) term(p *simProc) {
	w.trace.add("fault %s terminated (SIGTERM)", p.id)
	p.cancel()
}

// replace stops the slot's worker and starts another after delay.
func (w *simWorld) replace(s *simSlot, hard bool, delay time.Duration) {
	s.mu.Lock()
	p := s.proc
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	if hard {
		w.kill(p)
	} else {
		w.term(p)
	}
	s.mu.Lock()
	s.pending = time.AfterFunc(delay, func() {
		s.mu.Lock()
		stale := s.pending == nil
		s.mu.Unlock()
		if !stale {
			w.start(s)
		}
	})
	s.mu.Unlock()
}

// restartNATS stops the server and starts it again on the same store and
// port after down.
func (w *simWorld) restartNATS(down time.Duration) {
	w.trace.add("fault nats-server stopped (down %s)", down)
	if err := w.world.nats.restart(down); err != nil {
		w.t.Errorf("harness: restart nats-server: %v", err)
		return
	}
	w.trace.add("fault nats-server started again")
}

// runtimeRand is a per-client random source for the runtime choices of
// injected faults; seeded, though timing decides which call draws what.
func (w *simWorld) runtimeRand() func() float64 {
	var mu sync.Mutex
	w.mu.Lock() // slots restart concurrently (replace's timers)
	n := len(w.procs)
	w.mu.Unlock()
	x := uint64(w.seed)*0x9E3779B97F4A7C15 + uint64(n+1)*0xBF58476D1CE4E5B9
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		return float64(x>>11) / float64(1<<53)
	}
}

// submit publishes a submission; a failed publish is retried with the same
// id (as a producer would) until a PubAck says it is stored.
func (w *simWorld) submit(s *simSub) {
	w.mu.Lock()
	s.start = w.now()
	w.mu.Unlock()
	ctx := context.Background()
	for attempt := range 40 {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		req := *s.req
		ack, err := w.pub.Publish(pctx, &req)
		cancel()
		if err == nil {
			w.mu.Lock()
			s.accepted = true
			w.mu.Unlock()
			extra := ""
			if attempt > 0 {
				extra = fmt.Sprintf(" after %d failed attempts", attempt)
			}
			if ack.Duplicate && attempt == 0 {
				extra += " (DUPLICATE?)"
			}
			w.trace.add("req   %s %s %s/%s %s published seq %d%s", s.id, s.label, s.req.Tenant, s.req.Name, w.keyName(s.key), ack.Sequence, extra)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	w.trace.add("req   %s: never stored (NATS unavailable)", s.id)
}

// republish publishes an accepted request again, same id and body.
func (w *simWorld) republish(s *simSub) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req := *s.req
	ack, err := w.pub.Publish(ctx, &req)
	switch {
	case err != nil:
		w.trace.add("fault duplicate publish of %s: %v", s.id, err)
	case ack.Duplicate:
		w.trace.add("fault duplicate publish of %s: dropped as duplicate", s.id)
	default:
		w.mu.Lock()
		s.reacc++
		w.mu.Unlock()
		w.trace.add("fault duplicate publish of %s: STORED AGAIN as seq %d (the stream forgot the id)", s.id, ack.Sequence)
		w.note("a duplicate publish of %s was stored again by the stream (seq %d)", s.id, ack.Sequence)
	}
}

// cancel sends a cancel for a key or request id and records the answer.
func (w *simWorld) cancel(target, key, tenant, name string) *simCancel {
	c := &simCancel{target: target, key: key, tenant: tenant, name: name, sent: w.now(), done: simNever}
	w.mu.Lock()
	w.cancels = append(w.cancels, c)
	w.mu.Unlock()
	what := w.keyName(key)
	if target != key {
		what = "request " + target
	}
	m, err := tenantAPIRequest(w.obs, tenant, v1.CancelSubject(tenant, name), target, 5*time.Second)
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		c.done, c.reply = c.sent, "no responders"
	case err != nil:
		c.canceled, c.reply = true, "unknown: "+err.Error()
	default:
		var rep v1.CancelReply
		_ = json.Unmarshal(m.Data, &rep)
		c.done, c.canceled, c.reply = w.now(), rep.Canceled, rep.Message
	}
	w.trace.add("fault cancel %s (%s/%s): canceled=%v %q", what, tenant, name, c.canceled, c.reply)
	return c
}

// watchResults records every result publish (core NATS sees repeats the
// stream drops).
func (w *simWorld) watchResults() error {
	_, err := w.obs.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil {
			return
		}
		id := strings.TrimPrefix(m.Header.Get(v1.MsgIDHeader), r.Data.Tenant+"/")
		w.mu.Lock()
		w.published = append(w.published, simPublish{id: id, subject: m.Subject, at: w.now(), r: r})
		w.mu.Unlock()
		d := r.Data
		extra := d.Reason
		if d.Digest != "" {
			extra = d.Digest[7:19]
		}
		w.trace.add("res   %s %s/%s %s %s by %s", id, d.Status, d.Origin, w.keyName(d.Key), extra, strings.TrimPrefix(r.Source, "/buildq/worker/"))
	})
	if err != nil {
		return err
	}
	return w.obs.Flush()
}

// storedResults reads every message of BUILDQ_RESULTS.
type simStored struct {
	id      string
	subject string
	r       v1.Result
}

func (w *simWorld) storedResults(ctx context.Context) ([]simStored, error) {
	var out []simStored
	err := w.streamMsgs(ctx, v1.ResultsStream, func(m *jetstream.RawStreamMsg) error {
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil {
			return fmt.Errorf("result seq %d: %w", m.Sequence, err)
		}
		out = append(out, simStored{id: strings.TrimPrefix(m.Header.Get(v1.MsgIDHeader), r.Data.Tenant+"/"), subject: m.Subject, r: r})
		return nil
	})
	return out, err
}

// streamMsgs hands each message stored in stream to f, in order.
func (w *simWorld) streamMsgs(ctx context.Context, stream string, f func(m *jetstream.RawStreamMsg) error) error {
	s, err := w.js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.Msgs == 0 {
		return err
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return err
		}
		if err := f(m); err != nil {
			return err
		}
	}
	return nil
}

// queueState is the requests' state: messages left in intake and the
// tenants' queues, those waiting, and those held.
func (w *simWorld) queueState(ctx context.Context) (msgs uint64, pending uint64, ackPending int, err error) {
	q, err := ReadQueueState(ctx, w.js)
	if err != nil {
		return 0, 0, 0, err
	}
	return q.Messages, q.Waiting, q.Held, nil
}

// liveJobs lists the Jobs that exist now.
func (w *simWorld) liveJobs() []string {
	var out []string
	_ = w.world.api.do(func() error {
		l, err := w.world.api.tracker.List(jobsGVR, kindOf(jobsGVR), testNamespace)
		if err != nil {
			return err
		}
		for _, j := range l.(*batchv1.JobList).Items {
			done, ok := kube.Finished(&j)
			state := "running"
			if done {
				state = map[bool]string{true: "succeeded", false: "failed"}[ok]
			}
			if j.DeletionTimestamp != nil {
				state += ", terminating"
			}
			out = append(out, fmt.Sprintf("%s %s %s (%s)", w.keyName(j.Annotations[kaniko.AnnotationKey]), j.Name, j.UID, state))
		}
		return nil
	})
	slices.Sort(out)
	return out
}

// claimable reports whether key's build record would let a handler claim
// a new run (absent, or failed): a stall there is one after which a
// handler that forgot to check its request's answer would build again.
func (w *simWorld) claimable(key string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	kv, err := w.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		return false
	}
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return true
	}
	if err != nil {
		return false
	}
	var r v1.BuildRecord
	return json.Unmarshal(e.Value(), &r) == nil && r.State == v1.StateFailed
}
