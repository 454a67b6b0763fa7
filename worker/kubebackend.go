package worker

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/workqueue"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// KubeBackend runs builds as kaniko Jobs and observes them through
// informers.
type KubeBackend struct {
	client   kubernetes.Interface
	watcher  *kube.Watcher
	cfg      kaniko.Config
	identity string
	// digestGrace: how long a finished Job's Pod may lag behind it in
	// the cache before the run ends without it (podGone).
	digestGrace time.Duration
	presign     Presigner
	// logSource reads pods/log; log is the backend's logger.
	logSource kube.LogSource
	log       *zap.Logger
	// finished holds the names of finished Jobs from the informers (their
	// initial list, every event, every relist) for reconciliation: a
	// client-go workqueue, so a name is queued once however many events
	// name it, none is dropped, a transient failure is retried with
	// backoff and a claim that still looks alive is looked at again later.
	finished workqueue.TypedRateLimitingInterface[string]
	// podless: when the reconciler first found each succeeded Job
	// without its Pod (podGrace); its goroutine's alone.
	podless map[types.UID]time.Time
	// prepared are Jobs made ahead of their runs (kubeprepare.go).
	prepared preparedJobs
}

// Presigner makes a credential-free GET URL for one S3 object, valid for
// ttl, addressed as the build Pods reach the store (s3store.Store.PresignGet).
type Presigner func(ctx context.Context, bucket, key string, ttl time.Duration) (string, error)

// WithPresigner sets how the fetch-context init container's URL is made
// (kaniko.Config.FetchImage).
func (k *KubeBackend) WithPresigner(p Presigner) *KubeBackend {
	k.presign = p
	return k
}

// WithLogger sets the backend's logger.
func (k *KubeBackend) WithLogger(l *zap.Logger) *KubeBackend {
	k.log = l
	return k
}

// NewKubeBackend takes a client and a watcher whose informers the caller
// starts. cfg gets its defaults applied.
func NewKubeBackend(client kubernetes.Interface, watcher *kube.Watcher, cfg kaniko.Config) (*KubeBackend, error) {
	cfg = cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("kaniko config: %w", err)
	}
	k := &KubeBackend{client: client, watcher: watcher, cfg: cfg, identity: "kaniko@" + cfg.ExecutorImage,
		digestGrace: 10 * time.Second, logSource: kube.NewLogSource(client, cfg.Namespace), log: zap.NewNop()}
	k.finished = workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](reconcileRetryFloor, reconcileRetryMax),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "buildq-finished-jobs"})
	watcher.OnFinished(func(job *batchv1.Job) { k.finished.Add(job.Name) })
	return k, nil
}

// Identity is the pinned executor image: another executor image is another
// build.
func (k *KubeBackend) Identity() string { return k.identity }

// PerTenantCache reports whether a run reads kaniko's layer cache from its
// claimer's tenant's own repository (--cache-repo with {tenant}): the
// image a build makes then depends on that tenant, and its key names it
// (KeyIdentity).
func (k *KubeBackend) PerTenantCache() bool { return strings.Contains(k.cfg.CacheRepo, "{tenant}") }

// ChecksFirstTag implements TagChecker: a build of a context in the
// object store, fetched by fetch-context, whose Pod asks the registry for
// its first tag before kaniko runs (kaniko.Spec.Absent).
func (k *KubeBackend) ChecksFirstTag(req *v1.Request) bool {
	return req.Source.S3 != nil && k.cfg.FetchImage != "" && k.presign != nil
}

// Run implements Backend.
func (k *KubeBackend) Run(ctx context.Context, b Build, started Started) (Outcome, error) {
	if err := k.placeable(ctx, b); err != nil {
		// No node runs the platform: refused before any Job exists, not
		// left Pending until the deadline (invariant 6). A failed record
		// is built again by the next request, so a node added later
		// serves it.
		return Outcome{Reason: v1.ReasonInvalidRequest, Message: err.Error()}, nil
	}
	job := k.prepared.take(b)
	if job == nil {
		var err error
		if job, err = k.makeJob(ctx, b); err != nil {
			return Outcome{}, err
		}
	}
	name := job.Name
	// Subscribe before creating so no event is missed.
	signal, cancel := k.watcher.Subscribe(name)
	defer cancel()

	created, createdUID, err := k.create(ctx, job, b, signal)
	if err != nil {
		return Outcome{}, err
	}
	if created {
		started(name, true, b.Request.RequestID)
	}
	// The build's log, followed as it goes; an outcome waits a moment for
	// its last lines.
	capture := func(time.Duration) {}
	if created {
		capture = k.startCapture(ctx, name, b.Log)
	}
	defer func() { capture(0) }()
	drained := func(o Outcome, err error) (Outcome, error) {
		capture(logDrain)
		capture = func(time.Duration) {}
		return o, err
	}

	seen := false
	jobUID := createdUID
	// grace: how long a finished Job's Pod may lag behind it (once).
	var (
		grace      <-chan time.Time
		graceTimer *time.Timer
	)
	defer func() {
		if graceTimer != nil {
			graceTimer.Stop()
		}
	}()
	// A Job created and deleted while the informer's watch was broken never
	// reaches the cache, and a relist does not report it either. While the
	// Job has not been seen, ask the API server now and then whether it
	// still exists; once seen, the informer alone decides.
	unseen := time.NewTicker(k.digestGrace)
	defer unseen.Stop()
	var attempts podAttempts
	for {
		cur, pods, ok := k.watcher.Get(k.cfg.Namespace, name)
		if ok && created && cur.UID != createdUID {
			// The cache still shows the stale Job this build replaced.
			ok = false
		}
		switch {
		case ok && cur.Annotations[kaniko.AnnotationKey] != b.Key:
			return Outcome{}, fmt.Errorf("job %s exists but belongs to build key %s", name, cur.Annotations[kaniko.AnnotationKey])
		case ok && cur.Annotations[kaniko.AnnotationRun] != b.Run:
			// Our run's Job is gone and another run's stands in its place:
			// the record has moved on, which the caller finds out.
			if seen {
				return k.deleted(name), nil
			}
		case ok:
			if !seen && !created {
				started(name, false, cur.Annotations[kaniko.AnnotationRequestID])
				capture = k.startCapture(ctx, name, b.Log)
			}
			seen = true
			if cur.DeletionTimestamp != nil {
				return k.deleted(name), nil
			}
			jobUID = cur.UID
			attempts.see(name, pods, b.Progress)
			o := kube.JobOutcome(cur, pods)
			// A failure's log tail is on its Pod, which can reach the cache
			// after the Job: wait for it as for a success's digest.
			podLag := o.Done && !o.Succeeded && len(pods) == 0
			if o.Done && !o.Pending && !podLag {
				return drained(k.outcome(ctx, name, jobUID, o))
			}
			if (o.Pending || podLag) && grace == nil {
				graceTimer = time.NewTimer(k.digestGrace)
				grace = graceTimer.C
			}
		case seen, created && k.watcher.Deleted(k.cfg.Namespace, name, createdUID):
			// Gone: seen and then not, or deleted before this goroutine
			// ever read it from the cache (the informer saw it go).
			return k.deleted(name), nil
		}
		select {
		case <-signal:
		case <-unseen.C:
			if !seen {
				if _, err := k.client.BatchV1().Jobs(k.cfg.Namespace).Get(ctx, name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
					return k.deleted(name), nil
				}
			}
		case <-grace:
			// Finished, but its Pod never reached the cache: it was
			// deleted, and a success's digest with it.
			o := kube.JobOutcome(cur, pods)
			if o.Pending {
				return drained(podGone(name, jobUID, b.Destinations[0], o), nil)
			}
			return drained(k.outcome(ctx, name, jobUID, o))
		case <-ctx.Done():
			return Outcome{}, ctx.Err()
		}
	}
}

// nodeSyncWait bounds the one wait for the Node cache (placeable).
const nodeSyncWait = 10 * time.Second

// placeable checks that some node takes the build Pod of b's platform
// (its node selector and the job template's tolerations) from the
// watcher's Node cache; a request without one platform, a run whose Job
// already exists (adopted after a restart: its Pod may run on a node
// cordoned since), or a cache that cannot tell, passes (kube.Nodes.Check).
func (k *KubeBackend) placeable(ctx context.Context, b Build) error {
	r := b.Request
	platform := kaniko.Platform(r)
	if platform == "" {
		return nil
	}
	if cur, _, ok := k.watcher.Get(k.cfg.Namespace, kaniko.JobName(b.Key)); ok && cur.Annotations[kaniko.AnnotationRun] == b.Run {
		return nil
	}
	// Once, while the worker starts, CheckPlatform waits a moment for the
	// node list rather than let a platform no node runs through.
	return k.CheckPlatform(ctx, r)
}

// CheckPlatform implements PlatformChecker: some node takes the build Pod
// of req's one platform.
func (k *KubeBackend) CheckPlatform(ctx context.Context, req *v1.Request) error {
	platform := kaniko.Platform(req)
	if platform == "" {
		return nil
	}
	k.watcher.Nodes().WaitForSync(ctx, nodeSyncWait)
	_, overridden := k.cfg.PlatformNodeSelectors[platform]
	return k.watcher.Nodes().Check(platform, kaniko.NodeSelector(req, k.cfg), k.cfg.Tolerations, overridden)
}

// podAttempts follows the Pods of one build's Job, to say when the Job
// runs the build again in a new Pod and why the last one ended (its
// executor killed, the Pod disrupted or deleted): each retry inside the
// Job is a progress event with its reason.
type podAttempts struct {
	// last is the newest Pod seen, and what was last seen of it.
	last, why string
	seen      map[string]bool
}

func (a *podAttempts) see(job string, pods []*corev1.Pod, progress func(string)) {
	sorted := slices.Clone(pods)
	slices.SortStableFunc(sorted, func(x, y *corev1.Pod) int {
		return cmp.Or(x.CreationTimestamp.Compare(y.CreationTimestamp.Time), strings.Compare(x.Name, y.Name))
	})
	for _, p := range sorted {
		if a.seen[p.Name] {
			if p.Name == a.last {
				a.why = podEnd(p)
			}
			continue
		}
		if a.seen == nil {
			a.seen = map[string]bool{}
		}
		if a.last != "" && progress != nil {
			progress(fmt.Sprintf("job %s runs the build again in pod %s: %s", job, p.Name, a.why))
		}
		a.seen[p.Name], a.last, a.why = true, p.Name, podEnd(p)
	}
}

// podEnd says how a build Pod ended, as far as its status shows.
func podEnd(p *corev1.Pod) string {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.DisruptionTarget && c.Status == corev1.ConditionTrue {
			return fmt.Sprintf("pod %s was disrupted (%s: %s)", p.Name, c.Reason, c.Message)
		}
	}
	for _, cs := range p.Status.ContainerStatuses {
		if t := cs.State.Terminated; cs.Name == kaniko.ContainerName && t != nil {
			return fmt.Sprintf("the executor in pod %s exited %d (%s)", p.Name, t.ExitCode, t.Reason)
		}
	}
	if p.DeletionTimestamp != nil {
		return fmt.Sprintf("pod %s was deleted", p.Name)
	}
	return fmt.Sprintf("pod %s ended (%s)", p.Name, cmp.Or(string(p.Status.Phase), "gone"))
}

func (k *KubeBackend) deleted(name string) Outcome {
	return Outcome{Reason: v1.ReasonJobDeleted, Job: name, Message: fmt.Sprintf("job %s was deleted before it finished", name)}
}

// podGone is the end of a run whose Job succeeded but whose Pod was gone
// before the cache showed its status, and with it the digest kaniko
// reported (o.Pending past digestGrace). The image now at the run's first
// tag (dest) cannot be shown to be this build's: anyone who may push
// there may have pushed since. So nothing is recorded as built and the
// run answers nobody, as a run whose Pod found its tag taken
// (v1.ReasonTagTaken): every request of it looks again, the claimer's own
// check answers it with the image at its tag (origin cache, never written
// to the index), and a request whose tag is free builds.
func podGone(name string, uid types.UID, dest string, o kube.Outcome) Outcome {
	if mutant.On("pod-gone-push-failed") {
		return Outcome{Reason: v1.ReasonPushFailed, Job: name, JobUID: string(uid), Message: fmt.Sprintf("job %s succeeded but its pod reported no image digest", name)}
	}
	return Outcome{
		Reason: v1.ReasonTagTaken, Job: name, JobUID: string(uid), StartedAt: o.StartedAt, FinishedAt: o.FinishedAt,
		Message: fmt.Sprintf("job %s succeeded, but its pod was gone before the worker read the digest it pushed: the image now at %s cannot be shown to be this build's; nothing is recorded, and every request of the run looks again", name, dest),
	}
}

func (k *KubeBackend) outcome(ctx context.Context, name string, uid types.UID, o kube.Outcome) (Outcome, error) {
	out := Outcome{
		Succeeded: o.Succeeded, Digest: o.Digest, Reason: o.Reason, Message: o.Message,
		LogTail: o.LogTail, Job: name, JobUID: string(uid), StartedAt: o.StartedAt, FinishedAt: o.FinishedAt,
	}
	if o.NeedLogs && o.LogPod != "" {
		if tail, err := k.logTail(ctx, o.LogPod); err == nil && tail != "" {
			out.LogTail = tail
			if out.Reason == v1.ReasonBuildFailed {
				reason, message := kube.ClassifyFailure(tail)
				out.Reason = reason
				if message != "" {
					out.Message = message
				}
			}
		}
	}
	if out.Succeeded && out.Digest == "" {
		// Not handed here (a success without a digest is o.Pending,
		// waited for and then podGone); should one come, it is no
		// success.
		out.Succeeded = false
		out.Reason = v1.ReasonPushFailed
		out.Message = fmt.Sprintf("job %s succeeded but its pod reported no image digest", name)
	}
	return out, nil
}

// logTail reads the end of the kaniko container's log (pods/log), for
// failures whose termination message is empty.
// Enough lines to reach past kaniko's usage text (about 110 lines) to the
// error printed before it.
func (k *KubeBackend) logTail(ctx context.Context, pod string) (string, error) {
	lines := int64(200)
	limit := int64(64 << 10)
	rc, err := k.client.CoreV1().Pods(k.cfg.Namespace).GetLogs(pod, &corev1.PodLogOptions{
		Container: kaniko.ContainerName, TailLines: &lines, LimitBytes: &limit,
	}).Stream(ctx)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, limit))
	return kube.Tail(kube.StripUsage(string(b)), kube.MaxLogTail), err
}

// create creates the run's Job. AlreadyExists means a Job of the key is
// there: the run's own (a take-over, or this run's earlier attempt) is
// adopted (created false); any other run's is stale — its run ended when
// the record left it — and is deleted by UID and replaced.
// jobCreateTimeout bounds one Job create, which a stopped build does not
// cut off (create).
const jobCreateTimeout = 10 * time.Second

func (k *KubeBackend) create(ctx context.Context, job *batchv1.Job, b Build, signal <-chan struct{}) (bool, types.UID, error) {
	jobs := k.client.BatchV1().Jobs(k.cfg.Namespace)
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return false, "", err
		}
		// Not cut off in flight by the build being stopped (a cancel):
		// an aborted request whose write the API server already took
		// still creates the Job, which this run would then not know to
		// delete. Its outcome is waited for, and the run's end deletes
		// what it created.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), jobCreateTimeout)
		got, err := jobs.Create(cctx, job, metav1.CreateOptions{})
		cancel()
		switch {
		case err == nil:
			return true, got.UID, nil
		case apierrors.IsAlreadyExists(err):
			if attempt >= 5 {
				return false, "", Transient(fmt.Errorf("create job %s: a job of another run keeps standing in its place", job.Name))
			}
			own, err := k.removeStale(ctx, job.Name, b, signal)
			if err != nil {
				return false, "", err
			}
			if own {
				return false, "", nil // our run's Job: adopt it
			}
		case ctx.Err() != nil:
			return false, "", ctx.Err()
		case kube.IsTransient(err):
			return false, "", Transient(fmt.Errorf("create job %s: %w", job.Name, err))
		default:
			return false, "", fmt.Errorf("create job %s: %w", job.Name, err)
		}
	}
}

// existing returns the Job called name: from the informer cache, or — when
// the cache has not shown it within a moment (a watch gap) — from the API
// server. nil when there is none.
func (k *KubeBackend) existing(ctx context.Context, name string, signal <-chan struct{}) (*batchv1.Job, error) {
	if j, _, ok := k.watcher.Get(k.cfg.Namespace, name); ok {
		return j, nil
	}
	select {
	case <-signal:
	case <-time.After(k.digestGrace):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if j, _, ok := k.watcher.Get(k.cfg.Namespace, name); ok {
		return j, nil
	}
	got, err := k.client.BatchV1().Jobs(k.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, Transient(fmt.Errorf("get job %s: %w", name, err))
	}
	return got, nil
}

// removeStale looks at the Job called name. It reports true when the Job is
// run's own, to adopt. Otherwise it deletes the Job (UID precondition) and
// waits, on the informer cache, until it is gone, then reports false: the
// caller creates its own.
func (k *KubeBackend) removeStale(ctx context.Context, name string, b Build, signal <-chan struct{}) (bool, error) {
	old, err := k.existing(ctx, name, signal)
	if err != nil || old == nil {
		return false, err
	}
	if (old.Annotations[kaniko.AnnotationRun] == b.Run || mutant.On("adopt-any-run")) && old.DeletionTimestamp == nil {
		return true, nil
	}
	// The Job seen is of another run. It is stale only if this run is
	// still the current one (checked after seeing the Job: a run id is
	// never reused, so a Job seen before that check cannot be of a run
	// that starts after it).
	if !b.current(ctx) {
		return false, errNotCurrent
	}
	uid := old.UID
	if old.DeletionTimestamp == nil {
		if err := k.deleteJob(ctx, name, uid); err != nil {
			return false, err
		}
	}
	deadline := time.NewTimer(2 * time.Minute)
	defer deadline.Stop()
	for {
		cur, _, ok := k.watcher.Get(k.cfg.Namespace, name)
		if !ok || cur.UID != uid || k.watcher.Deleted(k.cfg.Namespace, name, uid) {
			return false, nil
		}
		select {
		case <-signal:
		case <-deadline.C:
			return false, Transient(fmt.Errorf("the previous job %s is still being deleted", name))
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

func (k *KubeBackend) deleteJob(ctx context.Context, name string, uid types.UID) error {
	fg := metav1.DeletePropagationForeground
	opts := metav1.DeleteOptions{PropagationPolicy: &fg}
	if uid != "" {
		opts.Preconditions = &metav1.Preconditions{UID: &uid}
	}
	err := k.client.BatchV1().Jobs(k.cfg.Namespace).Delete(ctx, name, opts)
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		if kube.IsTransient(err) {
			return Transient(fmt.Errorf("delete job %s: %w", name, err))
		}
		return fmt.Errorf("delete job %s: %w", name, err)
	}
	return nil
}

// Cleanup deletes the Job of run — and first its Pods (foreground), so a
// canceled build stops before it can push — with a UID precondition:
// never a newer run's Job of the same name. The Job is read from the
// informer cache, and from the API server only when the cache has not
// shown it yet (a cancel right after the create).
func (k *KubeBackend) Cleanup(ctx context.Context, key, run string) error {
	name := kaniko.JobName(key)
	job, _, ok := k.watcher.Get(k.cfg.Namespace, name)
	if !ok {
		got, err := k.client.BatchV1().Jobs(k.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("get job %s: %w", name, err)
		}
		job = got
	}
	if job.Annotations[kaniko.AnnotationRun] != run || job.DeletionTimestamp != nil {
		return nil
	}
	return k.deleteJob(ctx, name, job.UID)
}

// WaitGone waits, on the informer cache, until the Job of run of key is
// gone — removed, not only marked for deletion: a foreground deletion
// leaves the Job while its Pods terminate, and until then its build may
// still run. No Job, or another run's, is gone already. A Job the cache
// does not show is asked of the API server: one created a moment ago
// (a build stopped as it started) may not have reached the cache yet.
// Those asks back off (250 ms doubling to 4 s): a cache that stays behind
// does not turn one waiter into a steady stream of GETs.
func (k *KubeBackend) WaitGone(ctx context.Context, key, run string) error {
	name := kaniko.JobName(key)
	signal, stop := k.watcher.Subscribe(name)
	defer stop()
	const firstLook, lastLook = 250 * time.Millisecond, 4 * time.Second
	look := firstLook
	for {
		job, _, ok := k.watcher.Get(k.cfg.Namespace, name)
		asked := false
		if !ok && !mutant.On("wait-gone-trusts-cache") {
			got, err := k.client.BatchV1().Jobs(k.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
			switch {
			case apierrors.IsNotFound(err):
				return nil
			case err != nil:
				return fmt.Errorf("get job %s: %w", name, err)
			}
			job, ok, asked = got, true, true
		}
		if !ok || job.Annotations[kaniko.AnnotationRun] != run || k.watcher.Deleted(k.cfg.Namespace, name, job.UID) {
			return nil
		}
		wait := firstLook // the cache alone: an event missed, look again
		if asked {
			wait, look = look, min(2*look, lastLook)
		}
		select {
		case <-signal:
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Executor implements ExecutorDescriber: the kaniko executor image, by
// the digest it is pinned to.
func (k *KubeBackend) Executor() attest.Dependency { return ExecutorOf(k.cfg.ExecutorImage) }
