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
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/registry"
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
	request                 string   // its request-id annotation
	dests                   []string // its --destination arguments
	created                 time.Duration
	finished                time.Duration // 0: not finished
	succeeded               bool
	pushed                  time.Duration // when its build began pushing (0: never)
	checked                 time.Duration // when its Pod's tag check began (0: never)
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
		j := &simJob{key: key, name: job.Name, uid: string(job.UID), creator: cause, content: simContentOf(job), request: job.Annotations[kaniko.AnnotationRequestID], dests: jobDestinations(job), created: w.trace.rel(),
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
	// A Pod whose fetch-context found its tag taken built nothing: not a
	// failure of the key's build.
	refused := !ok && slices.ContainsFunc(job.Status.Conditions, func(c batchv1.JobCondition) bool {
		return strings.Contains(c.Message, "Container "+kaniko.FetchContainerName+" ")
	})
	if j != nil {
		j.finished, j.succeeded = w.trace.rel(), ok
		if !ok && !refused {
			n.failures = append(n.failures, simFailure{key: j.key, at: j.finished})
		}
	}
	n.mu.Unlock()
	if j != nil {
		how := map[bool]string{true: "succeeded", false: "FAILED"}[ok]
		if refused {
			how = "REFUSED by its Pod: its first tag holds an image"
		}
		w.trace.add("job   %s %s %s %s", w.keyName(j.key), j.name[:14], j.uid, how)
	}
}

// checking records when a build's Pod began its tag check (the node's
// checking hook).
func (n *simNode) checking(job *batchv1.Job) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if j := n.jobs[string(job.UID)]; j != nil {
		j.checked = n.w.trace.rel()
	}
}

// pushing records when a build began pushing (the node's pushing hook).
func (n *simNode) pushing(job *batchv1.Job) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if j := n.jobs[string(job.UID)]; j != nil {
		j.pushed = n.w.trace.rel()
	}
}

// simContentOf is what decides a Job's image: the executor arguments that
// change the content, not where it is pushed.
func simContentOf(job *batchv1.Job) string {
	if len(job.Spec.Template.Spec.Containers) == 0 {
		return ""
	}
	args := slices.Clone(job.Spec.Template.Spec.Containers[0].Args)
	// Through fetch-context the context is the object its --url names
	// (simPresign: the object's s3:// address itself).
	for _, c := range job.Spec.Template.Spec.InitContainers {
		if i := slices.Index(c.Args, "--url"); c.Name == kaniko.FetchContainerName && i >= 0 && i+1 < len(c.Args) {
			for k, a := range args {
				if strings.HasPrefix(a, "--context=dir://") {
					args[k] = "--context=" + c.Args[i+1]
				}
			}
		}
	}
	return simContentArgs(args)
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
	// decidedAt: when each request's decision was first stored in its
	// ledger entry (request id → since the schedule began).
	decidedAt map[string]time.Duration
	events    []simEvent
	ingest    []simIngest
	// ledger: the accepted requests' ledger entries once settled.
	ledger   map[string]*v1.RequestEntry
	quiet    time.Duration
	registry map[string]string // image → digest (or error) at the end
	// indexed: every succeeded record's Repository@Digest → nil when the
	// registry has it at the end, else the error of its HEAD.
	indexed map[string]error
	// handTags: the tags pushed by hand before the schedule ran
	// ("hand-tags"), each to the digest pushed there.
	handTags map[string]string
	// lateHand: the tags pushed by hand while it ran ("late-hand-tags"),
	// each to the digest pushed there and when the push was done.
	lateHand map[string]simHandPush
	// lateHandPushing: the tags a late push by hand was started for.
	lateHandPushing map[string]bool
	// stalls: the seconds in which the machine could not keep up
	// (sim_stalls_test.go): no stretch near one is calm.
	stalls simStalls
}

// simHandPush is an image pushed by hand to a tag while the schedule ran.
type simHandPush struct {
	digest string
	at     time.Duration
}

// simSub is one submission: a request id and what the producer saw.
type simSub struct {
	id  string
	req *v1.Request
	key string
	// content decides a one-platform request's image; an image index's is
	// made of its platforms' (each a build of its own key).
	content   string
	platforms []simPlatform
	label     string
	start     time.Duration // publish started
	accepted  bool          // a PubAck came back (stored once)
	reacc     int           // duplicate publishes the stream stored again
}

// simPlatform is one platform's build of an image index request.
type simPlatform struct{ platform, key, content string }

// want is the image a request's success must name: its content's, or the
// image index of its platforms' images (registry.NewIndex, as the worker
// makes it).
func (s *simSub) want() (simImage, error) {
	if len(s.platforms) == 0 {
		return simImageFor(s.content)
	}
	var images []registry.IndexImage
	for _, p := range s.platforms {
		im, err := simImageFor(p.content)
		if err != nil {
			return simImage{}, err
		}
		images = append(images, registry.IndexImage{Image: im.img, Platform: p.platform})
	}
	idx, err := registry.NewIndex(images)
	if err != nil {
		return simImage{}, err
	}
	d, err := idx.Digest()
	if err != nil {
		return simImage{}, err
	}
	return simImage{digest: d.String()}, nil
}

// answeredBy is the key whose failed result makes the failure of key (s's
// own, or one of its platforms') known to s: an image index's request
// joins an index run in progress, like any request its run, until that
// run's failure is published — a platform's failure published meanwhile
// (to that platform's own requests) is that run's to report. A new index
// run never takes a known failure: it builds the failed platform again.
func (s *simSub) answeredBy(key string) string {
	if len(s.platforms) > 0 {
		return s.key
	}
	return key
}

// keys are the build keys whose outcomes may answer s: its own, and its
// platforms'.
func (s *simSub) keys() []string {
	out := []string{s.key}
	for _, p := range s.platforms {
		out = append(out, p.key)
	}
	return out
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
	return w.connectTo(w.world.nats.URL(), name)
}

func (w *simWorld) connectTo(url, name string, opts ...nats.Option) (*nats.Conn, error) {
	return nats.Connect(url, append([]nats.Option{nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond),
		nats.ReconnectJitter(10*time.Millisecond, 10*time.Millisecond), nats.RetryOnFailedConnect(true),
		nats.Timeout(2 * time.Second)}, opts...)...)
}
