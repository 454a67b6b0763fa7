package worker

// The test world's node: the kubelet (with kaniko in it), the Job
// controller and the TTL controller, for the kaniko Jobs on the world's
// API server. A build ends on demand (the harness's tests say when and
// how: end, build) or by itself after a planned time (the simulation and
// the scale benchmark: nodeOptions.plan). A build that succeeds pushes its
// image to every --destination first, as kaniko does; then the node writes
// the Pod with the kaniko container's termination (the digest, or the
// error) and the Job's conditions, and — with a TTL controller — deletes
// the finished Job later.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

// buildPlan is how the node runs one Job by itself.
type buildPlan struct {
	auto    bool          // the node ends the build by itself (else on demand only)
	after   time.Duration // how long it runs
	succeed bool
	seq     int // the planner's count of the key's Jobs before this one (for traces)
}

// nodeOptions say how the node behaves. The zero value ends builds only on
// demand, pushes nothing by itself and has no TTL controller.
type nodeOptions struct {
	// plan decides, for each new Job, whether and how the node runs it
	// by itself. It is called under the API mutex, in creation order.
	// nil: builds end only on demand.
	plan func(job *batchv1.Job) buildPlan
	// registry is where a successful build pushes (nil: it pushes
	// nothing and succeeds with a made-up digest).
	registry *registry.Client
	// image is the image a successful build of job makes (nil: a random
	// one).
	image func(job *batchv1.Job) (ggcrv1.Image, error)
	// ttl: the TTL controller deletes a finished Job this long after it
	// finished (0: no TTL controller; the workers must delete their Jobs).
	ttl time.Duration
	// observe sees every Job created (with its plan) or deleted, under
	// the API mutex: the simulation's record of Jobs.
	observe func(ev apiEvent, cause string, plan buildPlan)
	// ended sees every build the node ended, under the API mutex, as its
	// status is written.
	ended func(job *batchv1.Job, succeeded bool)
	// pushing sees every build that is about to push (not under the API
	// mutex); checking sees each Pod's tag check (fetch-context's
	// --absent) as it begins.
	pushing  func(job *batchv1.Job)
	checking func(job *batchv1.Job)
	// logf traces what goes wrong (a failed push); nil: nothing.
	logf func(format string, args ...any)
}

// fakeNode is the node. It owns the API server's change hook.
type fakeNode struct {
	api  *apiServer
	opts nodeOptions
	// creates counts the Job creations that reached the API server, by
	// Job name.
	creates *counter

	mu     sync.Mutex
	closed bool
	timers map[*time.Timer]struct{}
	// checked: what each Job's Pod found at its tag check, by UID
	// ("" free, else the reason it refused).
	checked map[types.UID]string
	// errs: what went wrong (failed pushes and writes), the first 20.
	errs    []string
	running sync.WaitGroup
}

func newFakeNode(api *apiServer, opts nodeOptions) *fakeNode {
	n := &fakeNode{api: api, opts: opts, creates: &counter{n: map[string]int{}}, timers: map[*time.Timer]struct{}{}, checked: map[types.UID]string{}}
	api.onChange = n.onChange
	return n
}

// counter counts by name.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) inc(name string) {
	c.mu.Lock()
	c.n[name]++
	c.mu.Unlock()
}

func (c *counter) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := 0
	for _, v := range c.n {
		t += v
	}
	return t
}

// onChange is the API server's change hook (under the API mutex).
func (n *fakeNode) onChange(ev apiEvent, cause string) {
	if ev.gvr != jobsGVR || ev.typ == watch.Modified {
		return
	}
	job := ev.obj.(*batchv1.Job)
	var plan buildPlan
	if ev.typ == watch.Added {
		n.creates.inc(job.Name)
		if n.opts.plan != nil {
			plan = n.opts.plan(job)
		}
	}
	if n.opts.observe != nil {
		n.opts.observe(ev, cause, plan)
	}
	if plan.auto {
		ns, name, uid, ok := job.Namespace, job.Name, job.UID, plan.succeed
		if jobAbsent(job) != "" {
			// The Pod starts: fetch-context checks the tag before kaniko
			// builds (as a real Pod, once, at its start).
			n.later(min(podStart, plan.after/2), func() { n.checkAtStart(ns, name, uid) })
		}
		n.later(plan.after, func() { n.runOut(ns, name, uid, ok) })
	}
}

// podStart is how long after its Job's creation a planned build's Pod
// starts (and checks its tag).
const podStart = 100 * time.Millisecond

// checkAtStart is a planned build's Pod's tag check at its start.
func (n *fakeNode) checkAtStart(ns, name string, uid types.UID) {
	var job *batchv1.Job
	if n.api.do(func() error {
		var err error
		job, err = n.liveLocked(ns, name, uid)
		return err
	}) != nil {
		return
	}
	if err := n.checkTag(job); err != nil {
		n.fail("tag check of %s: %v", name, err)
	}
}

// checkTag is fetch-context's --absent check of job's Pod, done once: it
// records what the Pod found.
func (n *fakeNode) checkTag(job *batchv1.Job) error {
	n.mu.Lock()
	_, done := n.checked[job.UID]
	n.mu.Unlock()
	ref := jobAbsent(job)
	if done || ref == "" || n.opts.registry == nil {
		return nil
	}
	if n.opts.checking != nil {
		n.opts.checking(job)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	d, err := n.opts.registry.Head(ctx, ref)
	cancel()
	found := ""
	switch {
	case err == nil:
		found = "tag taken: " + ref + " holds " + d + " already; the build would push over it"
	case !registry.IsNotFound(err):
		// A Pod would be retried; the world's registry does not fail,
		// so this is the harness's own trouble.
		return fmt.Errorf("checking that %s holds no image yet: %w", ref, err)
	}
	n.mu.Lock()
	n.checked[job.UID] = found
	n.mu.Unlock()
	return nil
}

// later runs f after d unless the node closes first.
func (n *fakeNode) later(d time.Duration, f func()) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return
	}
	n.running.Add(1)
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		defer n.running.Done()
		n.mu.Lock()
		delete(n.timers, t)
		closed := n.closed
		n.mu.Unlock()
		if !closed {
			f()
		}
	})
	n.timers[t] = struct{}{}
}

// close ends the node: nothing more is started, and it waits for what
// runs.
func (n *fakeNode) close() {
	n.mu.Lock()
	n.closed = true
	for t := range n.timers {
		if t.Stop() {
			n.running.Done()
		}
	}
	n.timers = map[*time.Timer]struct{}{}
	n.mu.Unlock()
	n.running.Wait()
}

func (n *fakeNode) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	n.mu.Lock()
	if len(n.errs) < 20 {
		n.errs = append(n.errs, msg)
	}
	n.mu.Unlock()
	if n.opts.logf != nil {
		n.opts.logf("node  %s", msg)
	}
}

// errJobGone: the Job to end was deleted or replaced.
var errJobGone = errors.New("job gone")

// liveLocked is the Job called name with uid ("": any), unless it is gone
// or terminating. Called with the API mutex held.
func (n *fakeNode) liveLocked(ns, name string, uid types.UID) (*batchv1.Job, error) {
	cur, found := n.api.getJobLocked(ns, name)
	if !found || (uid != "" && cur.UID != uid) || cur.DeletionTimestamp != nil {
		return nil, fmt.Errorf("%w: %s", errJobGone, name)
	}
	return cur, nil
}

// runOut is a planned build's end: it builds (pushes) and ends the Job.
func (n *fakeNode) runOut(ns, name string, uid types.UID, ok bool) {
	var job *batchv1.Job
	if n.api.do(func() error {
		var err error
		job, err = n.liveLocked(ns, name, uid)
		return err
	}) != nil {
		return
	}
	if err := n.build(job, ok); err != nil && !errors.Is(err, errJobGone) && !strings.Contains(err.Error(), "api server stopped") {
		n.fail("end job %s: %v", name, err)
	}
}

// build ends job's build now: on success the image is pushed to every
// destination first (a failed push fails the build, as kaniko's does).
// First, as the Pod's fetch-context init container does, the tag its
// --absent names is asked for — once, when the Pod starts (checkTag; now,
// for a build that ends before its Pod's check ran): an image there ends
// the build with that container's exit FetchExitTagTaken, and kaniko
// never runs. A tag pushed after the check is pushed over, as a real
// build's would be.
func (n *fakeNode) build(job *batchv1.Job, ok bool) error {
	if err := n.checkTag(job); err != nil {
		return err
	}
	n.mu.Lock()
	refused := n.checked[job.UID]
	n.mu.Unlock()
	if refused != "" {
		return n.endContainer(job, kaniko.FetchContainerName, kaniko.FetchExitTagTaken, refused)
	}
	msg := "error building image: error building stage: RUN make: exit status 2"
	exit := int32(1)
	if ok {
		if n.opts.pushing != nil {
			n.opts.pushing(job)
		}
		digest, err := n.push(job)
		if err != nil {
			n.fail("push of %s (%s) failed: %v", job.Name, job.UID, err)
			msg = "error pushing image: " + err.Error()
		} else {
			msg, exit = digest, 0
		}
	}
	return n.end(job, exit, msg)
}

// push pushes the image of job's build to its destinations and returns
// its digest.
func (n *fakeNode) push(job *batchv1.Job) (string, error) {
	var img ggcrv1.Image
	var err error
	if n.opts.image != nil {
		img, err = n.opts.image(job)
	} else {
		img, err = random.Image(512, 1)
	}
	if err != nil {
		return "", err
	}
	if n.opts.registry == nil {
		d, err := img.Digest()
		return d.String(), err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	return n.opts.registry.Push(ctx, img, jobDestinations(job))
}

// jobAbsent is the tag a Job's fetch-context init container checks is
// free (its --absent), or "".
func jobAbsent(job *batchv1.Job) string {
	for _, c := range job.Spec.Template.Spec.InitContainers {
		if c.Name != kaniko.FetchContainerName {
			continue
		}
		for i, a := range c.Args {
			if a == "--absent" && i+1 < len(c.Args) {
				return c.Args[i+1]
			}
		}
	}
	return ""
}

// jobDestinations are a Job's --destination arguments.
func jobDestinations(job *batchv1.Job) []string {
	var out []string
	if len(job.Spec.Template.Spec.Containers) == 0 {
		return nil
	}
	for _, a := range job.Spec.Template.Spec.Containers[0].Args {
		if d, ok := strings.CutPrefix(a, "--destination="); ok {
			out = append(out, d)
		}
	}
	return out
}

// end plays the kubelet and the Job controller for job's end: the Pod
// whose kaniko container terminated with exit and message, then the Job's
// conditions. job names the Job (its UID, when set, must still be the
// live one's); the status is written on the live object. It fails when
// the Job is gone or terminating.
func (n *fakeNode) end(job *batchv1.Job, exit int32, message string) error {
	return n.endContainer(job, kaniko.ContainerName, exit, message)
}

// endContainer is end with the Pod's container that terminated named:
// kaniko's, or the fetch-context init container's (which fails the Pod
// before kaniko runs).
func (n *fakeNode) endContainer(job *batchv1.Job, container string, exit int32, message string) error {
	return n.endJob(job, container, exit, message, true)
}

// endWithoutPod plays a build that succeeded and whose Pod was deleted
// before any informer saw it: the Job's conditions say it succeeded, and
// no Pod tells the digest kaniko pushed.
func (n *fakeNode) endWithoutPod(job *batchv1.Job) error {
	return n.endJob(job, kaniko.ContainerName, 0, "", false)
}

func (n *fakeNode) endJob(job *batchv1.Job, container string, exit int32, message string, withPod bool) error {
	ns, name, uid := job.Namespace, job.Name, job.UID
	if ns == "" {
		ns = testNamespace
	}
	var ended *batchv1.Job
	err := n.api.do(func() error {
		cur, err := n.liveLocked(ns, name, uid)
		if err != nil {
			return err
		}
		now := metav1.Now()
		podName := fmt.Sprintf("%s-%s", cur.Name, strings.TrimPrefix(string(cur.UID), "uid-"))
		for i := 2; ; i++ {
			if _, err := n.api.tracker.Get(podsGVR, ns, podName); apierrors.IsNotFound(err) {
				break
			}
			podName = fmt.Sprintf("%s-%s-%d", cur.Name, strings.TrimPrefix(string(cur.UID), "uid-"), i)
		}
		pod := jobPod(cur, podName, exit == 0)
		terminated := []corev1.ContainerStatus{{
			Name: container,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
				ExitCode: exit, Message: message, FinishedAt: now,
			}},
		}}
		if container == kaniko.ContainerName {
			pod.Status.ContainerStatuses = terminated
		} else {
			pod.Status.InitContainerStatuses = terminated
		}
		if withPod {
			if _, err := n.api.createLocked(podsGVR, pod, ns, "node"); err != nil {
				return err
			}
		}
		j := cur.DeepCopy()
		start := cur.CreationTimestamp
		j.Status.StartTime = &start
		if exit == 0 {
			j.Status.Succeeded = 1
			j.Status.CompletionTime = &now
			j.Status.Conditions = []batchv1.JobCondition{
				{Type: batchv1.JobSuccessCriteriaMet, Status: corev1.ConditionTrue, LastTransitionTime: now},
				{Type: batchv1.JobComplete, Status: corev1.ConditionTrue, LastTransitionTime: now},
			}
		} else {
			j.Status.Failed = 1
			// The Job controller's words when a FailJob rule matched.
			m := fmt.Sprintf("Container %s for pod %s/%s failed with exit code %d matching FailJob rule at index 0", container, ns, podName, exit)
			j.Status.Conditions = []batchv1.JobCondition{
				{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: m, LastTransitionTime: now},
				{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: m, LastTransitionTime: now},
			}
		}
		if err := n.api.updateLocked(jobsGVR, j, "node"); err != nil {
			return err
		}
		if n.opts.ended != nil {
			n.opts.ended(j, exit == 0)
		}
		ended = j
		return nil
	})
	if err != nil {
		return err
	}
	if n.opts.ttl > 0 {
		uid := ended.UID
		n.later(n.opts.ttl, func() {
			_ = n.api.do(func() error {
				cur, found := n.api.getJobLocked(ns, name)
				if !found || cur.UID != uid {
					return nil
				}
				return n.api.deleteJobLocked(ns, name, metav1.DeleteOptions{}, "ttl")
			})
		})
	}
	return nil
}

// jobPod is a Pod the Job controller would have made for job, called
// name, ended (succeeded or failed) with no container status yet.
func jobPod(job *batchv1.Job, name string, succeeded bool) *corev1.Pod {
	lbl := map[string]string{}
	for k, v := range job.Spec.Template.Labels {
		lbl[k] = v
	}
	lbl[batchv1.JobNameLabel] = job.Name
	lbl[batchv1.ControllerUidLabel] = string(job.UID)
	lbl["job-name"] = job.Name
	lbl["controller-uid"] = string(job.UID)
	ns := job.Namespace
	if ns == "" {
		ns = testNamespace
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ns, Labels: lbl,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "batch/v1", Kind: "Job", Name: job.Name, UID: job.UID}},
		},
		Spec: job.Spec.Template.Spec,
		Status: corev1.PodStatus{
			Phase: map[bool]corev1.PodPhase{true: corev1.PodSucceeded, false: corev1.PodFailed}[succeeded],
		},
	}
}
