package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/registry"
)

// Build is one unique build: the request that claimed the key, the key,
// and the references to push.
type Build struct {
	Request      *v1.Request
	Key          string
	Destinations []string
	// Fresh: a new build of the key (first, or a retry after a failure or
	// a cancel), not the take-over of a build whose owner went away. A
	// fresh build never adopts a finished Job of an earlier one.
	Fresh bool
}

// Outcome is the end of a build as a backend reports it.
type Outcome struct {
	Succeeded bool
	Digest    string
	Reason    string
	Message   string
	LogTail   string
	Job       string
	// JobUID identifies the run (the Job's UID) for Cleanup.
	JobUID     string
	StartedAt  time.Time
	FinishedAt time.Time
}

// Started tells the worker that a build is running: created is false when
// the backend adopted a build that already existed, creator names the
// request that started it.
type Started func(job string, created bool, creator string)

// Backend runs builds. The worker holds the build key's claim around Run.
type Backend interface {
	// Identity names the executor in build keys.
	Identity() string
	// Run starts the build, or adopts the one already running for its key,
	// and waits for its outcome. It returns ctx.Err() when ctx ends first;
	// a *TransientError for trouble worth retrying; any other error is
	// terminal for the request.
	Run(ctx context.Context, b Build, started Started) (Outcome, error)
	// Cleanup removes what a build left behind once its results are
	// stored, or stops it (cancel). run names the build (Outcome.JobUID);
	// empty means whatever runs for the key.
	Cleanup(ctx context.Context, key, run string) error
}

// TransientError is trouble worth retrying later (the API server, the
// registry or storage unavailable).
type TransientError struct{ Err error }

func (e *TransientError) Error() string { return e.Err.Error() }

// Unwrap returns the cause.
func (e *TransientError) Unwrap() error { return e.Err }

// Transient wraps err as a *TransientError.
func Transient(err error) error { return &TransientError{Err: err} }

// IsTransient reports whether err is worth retrying.
func IsTransient(err error) bool {
	var t *TransientError
	return errors.As(err, &t)
}

// KubeBackend runs builds as kaniko Jobs and observes them through
// informers.
type KubeBackend struct {
	client      kubernetes.Interface
	watcher     *kube.Watcher
	cfg         kaniko.Config
	identity    string
	digestGrace time.Duration
	resolve     func(ctx context.Context, ref string) (string, error)
	// finished receives the names of finished Jobs from the informers
	// (their initial list, every event, every relist): reconciliation.
	finished chan string
}

// DigestResolver looks up the digest of a pushed reference in the registry.
type DigestResolver func(ctx context.Context, ref string) (string, error)

// WithDigestResolver sets how the digest of a succeeded Job is found when
// its Pod is gone before the worker saw its termination message.
func (k *KubeBackend) WithDigestResolver(r DigestResolver) *KubeBackend {
	k.resolve = r
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
		digestGrace: 10 * time.Second, finished: make(chan string, 256)}
	watcher.OnFinished(func(job *batchv1.Job) {
		select {
		case k.finished <- job.Name:
		default:
			// Full: the hint is dropped, not the build. The requests of
			// that build are still in the stream and recover it through
			// redelivery and the claim's lease.
		}
	})
	return k, nil
}

// Identity is the pinned executor image: another executor image is another
// build.
func (k *KubeBackend) Identity() string { return k.identity }

// Run implements Backend.
func (k *KubeBackend) Run(ctx context.Context, b Build, started Started) (Outcome, error) {
	job, err := kaniko.Job(kaniko.Spec{Request: b.Request, Key: b.Key, Destinations: b.Destinations}, k.cfg)
	if err != nil {
		return Outcome{}, err
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

	seen := false
	jobUID := createdUID
	var grace <-chan time.Time
	// A Job created and deleted while the informer's watch was broken never
	// reaches the cache, and a relist does not report it either. While the
	// Job has not been seen, ask the API server now and then whether it
	// still exists; once seen, the informer alone decides.
	unseen := time.NewTicker(k.digestGrace)
	defer unseen.Stop()
	for {
		cur, pods, ok := k.watcher.Get(k.cfg.Namespace, name)
		if ok && created && cur.UID != createdUID {
			// The cache still shows the stale Job this build replaced.
			ok = false
		}
		switch {
		case ok && cur.Annotations[kaniko.AnnotationKey] != b.Key:
			return Outcome{}, fmt.Errorf("job %s exists but belongs to build key %s", name, cur.Annotations[kaniko.AnnotationKey])
		case ok:
			if !seen && !created {
				started(name, false, cur.Annotations[kaniko.AnnotationRequestID])
			}
			seen = true
			if cur.DeletionTimestamp != nil {
				return k.deleted(name), nil
			}
			jobUID = cur.UID
			o := kube.JobOutcome(cur, pods)
			// A failure's log tail is on its Pod, which can reach the cache
			// after the Job: wait for it as for a success's digest.
			podLag := o.Done && !o.Succeeded && len(pods) == 0
			if o.Done && !o.Pending && !podLag {
				return k.outcome(ctx, name, jobUID, b.Destinations[0], o)
			}
			if (o.Pending || podLag) && grace == nil {
				t := time.NewTimer(k.digestGrace)
				defer t.Stop()
				grace = t.C
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
			// Succeeded, but its Pod (and so the digest) never reached the
			// cache: it was deleted. The registry has the answer.
			o := kube.JobOutcome(cur, pods)
			return k.outcome(ctx, name, jobUID, b.Destinations[0], o)
		case <-ctx.Done():
			return Outcome{}, ctx.Err()
		}
	}
}

func (k *KubeBackend) deleted(name string) Outcome {
	return Outcome{Reason: v1.ReasonJobDeleted, Job: name, Message: fmt.Sprintf("job %s was deleted before it finished", name)}
}

func (k *KubeBackend) outcome(ctx context.Context, name string, uid types.UID, dest string, o kube.Outcome) (Outcome, error) {
	out := Outcome{
		Succeeded: o.Succeeded, Digest: o.Digest, Reason: o.Reason, Message: o.Message,
		LogTail: o.LogTail, Job: name, JobUID: string(uid), StartedAt: o.StartedAt, FinishedAt: o.FinishedAt,
	}
	if o.NeedLogs && o.LogPod != "" {
		if tail, err := k.logTail(ctx, o.LogPod); err == nil && tail != "" {
			out.LogTail = tail
			if out.Reason == v1.ReasonBuildFailed {
				out.Reason = kube.ClassifyLog(tail)
			}
		}
	}
	if out.Succeeded && out.Digest == "" && k.resolve != nil {
		d, err := k.resolve(ctx, dest)
		switch {
		case err == nil:
			out.Digest = d
		case ctx.Err() != nil:
			return Outcome{}, ctx.Err()
		case !errors.Is(err, registry.ErrNotFound):
			// Only the registry saying "not there" makes this a failed
			// push; anything else is asked again later.
			return Outcome{}, Transient(fmt.Errorf("resolve the digest of %s: %w", dest, err))
		}
	}
	if out.Succeeded && out.Digest == "" {
		out.Succeeded = false
		out.Reason = v1.ReasonPushFailed
		out.Message = fmt.Sprintf("job %s succeeded but its pod reported no image digest", name)
	}
	return out, nil
}

// logTail reads the end of the kaniko container's log (pods/log), for
// failures whose termination message is empty.
func (k *KubeBackend) logTail(ctx context.Context, pod string) (string, error) {
	lines := int64(50)
	limit := int64(kube.MaxLogTail)
	rc, err := k.client.CoreV1().Pods(k.cfg.Namespace).GetLogs(pod, &corev1.PodLogOptions{
		Container: kaniko.ContainerName, TailLines: &lines, LimitBytes: &limit,
	}).Stream(ctx)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, limit))
	return kube.Tail(string(b), kube.MaxLogTail), err
}

// create creates the build's Job. AlreadyExists means another worker runs
// this build: adopt it (created false) — unless this is a fresh build (a
// retry after a failure or a cancel) and the Job there is the previous
// build's, finished or being deleted; that one is removed and replaced.
func (k *KubeBackend) create(ctx context.Context, job *batchv1.Job, b Build, signal <-chan struct{}) (bool, types.UID, error) {
	jobs := k.client.BatchV1().Jobs(k.cfg.Namespace)
	for attempt := 0; ; attempt++ {
		got, err := jobs.Create(ctx, job, metav1.CreateOptions{})
		switch {
		case err == nil:
			return true, got.UID, nil
		case apierrors.IsAlreadyExists(err):
			if !b.Fresh || attempt >= 3 {
				return false, "", nil
			}
			stale, err := k.removeStale(ctx, job.Name, signal)
			if err != nil {
				return false, "", err
			}
			if !stale {
				return false, "", nil // a live build: adopt it
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

// removeStale deletes a finished or terminating Job of an earlier build and
// waits until it is gone, reading both from the informer cache (signal
// fires on every event for the name). It reports false for a Job still
// running, which the caller adopts. Only a Job the cache has not shown
// within a while (a watch gap) is read from the API server.
func (k *KubeBackend) removeStale(ctx context.Context, name string, signal <-chan struct{}) (bool, error) {
	deadline := time.NewTimer(2 * time.Minute)
	defer deadline.Stop()
	wait := func() error {
		select {
		case <-signal:
			return nil
		case <-deadline.C:
			return Transient(fmt.Errorf("the previous job %s is still being deleted", name))
		case <-ctx.Done():
			return ctx.Err()
		}
	}

	old, _, ok := k.watcher.Get(k.cfg.Namespace, name)
	if !ok {
		// AlreadyExists, yet not cached: give the informer a moment, then
		// ask the API server once.
		select {
		case <-signal:
		case <-time.After(k.digestGrace):
		case <-ctx.Done():
			return false, ctx.Err()
		}
		if old, _, ok = k.watcher.Get(k.cfg.Namespace, name); !ok {
			got, err := k.client.BatchV1().Jobs(k.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return true, nil
			}
			if err != nil {
				return false, Transient(fmt.Errorf("get job %s: %w", name, err))
			}
			old = got
		}
	}
	if done, _ := kube.Finished(old); !done && old.DeletionTimestamp == nil {
		return false, nil
	}
	uid := old.UID
	if old.DeletionTimestamp == nil {
		if err := k.deleteJob(ctx, name, uid); err != nil {
			return false, err
		}
	}
	for {
		cur, _, ok := k.watcher.Get(k.cfg.Namespace, name)
		if !ok || cur.UID != uid || k.watcher.Deleted(k.cfg.Namespace, name, uid) {
			return true, nil
		}
		if err := wait(); err != nil {
			return false, err
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

// Cleanup deletes the build's Job and, first, its Pods (foreground): a
// canceled build stops before it can push. With a uid, only that Job is
// deleted (a precondition), never a newer build's Job of the same name.
func (k *KubeBackend) Cleanup(ctx context.Context, key, uid string) error {
	return k.deleteJob(ctx, kaniko.JobName(key), types.UID(uid))
}

// Reconcile is level-triggered reconciliation: for every finished Job the
// informers show (at start, on events, after every relist) that no goroutine
// of this worker waits on, it reads the outcome and hands it to finish,
// which stores it if the build's owner is gone. It returns when ctx ends.
func (k *KubeBackend) Reconcile(ctx context.Context, finish func(ctx context.Context, key string, out Outcome)) {
	for {
		select {
		case <-ctx.Done():
			return
		case name := <-k.finished:
			if k.watcher.Subscribers(name) > 0 {
				continue // a build of this worker waits on it
			}
			job, pods, ok := k.watcher.Get(k.cfg.Namespace, name)
			if !ok || job.DeletionTimestamp != nil {
				continue
			}
			key := job.Annotations[kaniko.AnnotationKey]
			o := kube.JobOutcome(job, pods)
			if key == "" || !o.Done || o.Pending {
				continue
			}
			out, err := k.outcome(ctx, name, job.UID, job.Annotations[kaniko.AnnotationImage], o)
			if err != nil {
				continue // transient: the next event or the redelivery retries
			}
			finish(ctx, key, out)
		}
	}
}

// Reconciler is a backend with reconciliation to run beside the worker.
type Reconciler interface {
	Reconcile(ctx context.Context, finish func(ctx context.Context, key string, out Outcome))
}
