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
	"k8s.io/client-go/kubernetes"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
)

// Build is one unique build: the request that claimed the key, the key,
// and the references to push.
type Build struct {
	Request      *v1.Request
	Key          string
	Destinations []string
}

// Outcome is the end of a build as a backend reports it.
type Outcome struct {
	Succeeded  bool
	Digest     string
	Reason     string
	Message    string
	LogTail    string
	Job        string
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
	// Cleanup removes what a finished build left behind once its results
	// are stored.
	Cleanup(ctx context.Context, key string) error
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
	return &KubeBackend{client: client, watcher: watcher, cfg: cfg, identity: "kaniko@" + cfg.ExecutorImage, digestGrace: 10 * time.Second}, nil
}

// Identity is the pinned executor image: another executor image is another
// build.
func (k *KubeBackend) Identity() string { return k.identity }

// Run implements Backend.
func (k *KubeBackend) Run(ctx context.Context, b Build, started Started) (Outcome, error) {
	runStart := time.Now()
	job, err := kaniko.Job(kaniko.Spec{Request: b.Request, Key: b.Key, Destinations: b.Destinations}, k.cfg)
	if err != nil {
		return Outcome{}, err
	}
	name := job.Name
	// Subscribe before creating so no event is missed.
	signal, cancel := k.watcher.Subscribe(name)
	defer cancel()

	created := true
	_, err = k.client.BatchV1().Jobs(k.cfg.Namespace).Create(ctx, job, metav1.CreateOptions{})
	switch {
	case err == nil:
		started(name, true, b.Request.RequestID)
	case apierrors.IsAlreadyExists(err):
		created = false // adopt it; who created it is read from the cache
	case ctx.Err() != nil:
		return Outcome{}, ctx.Err()
	case kube.IsTransient(err):
		return Outcome{}, Transient(fmt.Errorf("create job %s: %w", name, err))
	default:
		return Outcome{}, fmt.Errorf("create job %s: %w", name, err)
	}

	seen := false
	var grace <-chan time.Time
	// A Job created and deleted while the informer's watch was broken never
	// reaches the cache, and a relist does not report it either. While the
	// Job has not been seen, ask the API server now and then whether it
	// still exists; once seen, the informer alone decides.
	unseen := time.NewTicker(k.digestGrace)
	defer unseen.Stop()
	for {
		cur, pods, ok := k.watcher.Get(k.cfg.Namespace, name)
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
			o := kube.JobOutcome(cur, pods)
			// A failure's log tail is on its Pod, which can reach the cache
			// after the Job: wait for it as for a success's digest.
			podLag := o.Done && !o.Succeeded && len(pods) == 0
			if o.Done && !o.Pending && !podLag {
				return k.outcome(ctx, name, b.Destinations[0], o), nil
			}
			if (o.Pending || podLag) && grace == nil {
				t := time.NewTimer(k.digestGrace)
				defer t.Stop()
				grace = t.C
			}
		case seen, k.watcher.DeletedSince(k.cfg.Namespace, name, runStart):
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
			return k.outcome(ctx, name, b.Destinations[0], o), nil
		case <-ctx.Done():
			return Outcome{}, ctx.Err()
		}
	}
}

func (k *KubeBackend) deleted(name string) Outcome {
	return Outcome{Reason: v1.ReasonJobDeleted, Job: name, Message: fmt.Sprintf("job %s was deleted before it finished", name)}
}

func (k *KubeBackend) outcome(ctx context.Context, name, dest string, o kube.Outcome) Outcome {
	out := Outcome{
		Succeeded: o.Succeeded, Digest: o.Digest, Reason: o.Reason, Message: o.Message,
		LogTail: o.LogTail, Job: name, StartedAt: o.StartedAt, FinishedAt: o.FinishedAt,
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
		if err == nil {
			out.Digest = d
		}
	}
	if out.Succeeded && out.Digest == "" {
		out.Succeeded = false
		out.Reason = v1.ReasonPushFailed
		out.Message = fmt.Sprintf("job %s succeeded but its pod reported no image digest", name)
	}
	return out
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

// Cleanup deletes the build's Job and, first, its Pods (foreground): a
// canceled build stops before it can push.
func (k *KubeBackend) Cleanup(ctx context.Context, key string) error {
	fg := metav1.DeletePropagationForeground
	err := k.client.BatchV1().Jobs(k.cfg.Namespace).Delete(ctx, kaniko.JobName(key), metav1.DeleteOptions{PropagationPolicy: &fg})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete job %s: %w", kaniko.JobName(key), err)
	}
	return nil
}

// FinishedJobKey returns the build key of a finished buildq Job, for
// reconciliation.
func FinishedJobKey(job *batchv1.Job) string { return job.Annotations[kaniko.AnnotationKey] }
