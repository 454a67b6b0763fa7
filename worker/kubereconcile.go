package worker

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// The kube backend's reconciler: the outcome of a finished Job whose
// owner is gone, stored by whichever worker sees it.

// Backoff of a finished Job whose outcome could not be read (a transient
// API error): retried from reconcileRetryFloor, doubling up to
// reconcileRetryMax.
const (
	reconcileRetryFloor = 500 * time.Millisecond
	reconcileRetryMax   = time.Minute
)

// Reconcile is level-triggered reconciliation: for every finished Job the
// informers show (at start, on events, after every relist) that no goroutine
// of this worker waits on, it reads the outcome and hands it to finish,
// which stores it if the build's owner is gone. It returns when ctx ends,
// and runs once per backend (its queue is shut down then).
func (k *KubeBackend) Reconcile(ctx context.Context, finish func(ctx context.Context, key string, out Outcome) time.Duration) {
	stop := context.AfterFunc(ctx, k.finished.ShutDown)
	defer stop()
	for {
		name, quit := k.finished.Get()
		if quit {
			return
		}
		again, retry := k.reconcileJob(ctx, name, finish)
		switch {
		case retry:
			k.finished.AddRateLimited(name)
		case again > 0:
			// The claim still looks alive: look again once it could
			// have lapsed.
			k.finished.Forget(name)
			k.finished.AddAfter(name, again)
		default:
			k.finished.Forget(name)
		}
		k.finished.Done(name)
	}
}

// reconcileJob hands the outcome of finished Job name to finish when no
// build of this worker waits on it. It returns when to look again, or
// retry when the outcome could not be read.
func (k *KubeBackend) reconcileJob(ctx context.Context, name string, finish func(ctx context.Context, key string, out Outcome) time.Duration) (again time.Duration, retry bool) {
	if k.watcher.Subscribers(name) > 0 {
		return 0, false // a build of this worker waits on it
	}
	job, pods, ok := k.watcher.Get(k.cfg.Namespace, name)
	if !ok || job.DeletionTimestamp != nil {
		return 0, false
	}
	key := job.Annotations[kaniko.AnnotationKey]
	o := kube.JobOutcome(job, pods)
	if key == "" || !o.Done {
		return 0, false
	}
	var out Outcome
	if o.Pending {
		// Succeeded, and its Pod not (yet) in the cache: looked at
		// again once the grace a run's own watch gives the Pod is over
		// (Pod events reach only the runs' own watches, not this
		// queue), when a Pod that came tells the digest and one gone
		// for good ends the run (podGone), so that no orphaned run's
		// Job stands until a request of the key comes back to take the
		// run over.
		wait, over := k.podGrace(job.UID)
		if !over {
			return wait, false
		}
		out = podGone(name, job.UID, job.Annotations[kaniko.AnnotationImage], o)
	} else {
		var err error
		if out, err = k.outcome(ctx, name, job.UID, o); err != nil {
			return 0, ctx.Err() == nil
		}
	}
	out.Run = job.Annotations[kaniko.AnnotationRun]
	secrets := kaniko.SecretValues(job)
	out.Message, out.LogTail = maskSecrets(out.Message, secrets), maskSecrets(out.LogTail, secrets)
	return finish(ctx, key, out), false
}

// podGrace reports whether the succeeded Job uid has waited digestGrace
// for its Pod since the reconciler first found it without one, and if
// not, how much longer. Only the reconciler's goroutine calls it.
func (k *KubeBackend) podGrace(uid types.UID) (wait time.Duration, over bool) {
	if mutant.On("pod-gone-left-standing") {
		return 0, false
	}
	now := time.Now()
	if k.podless == nil {
		k.podless = map[types.UID]time.Time{}
	}
	since, ok := k.podless[uid]
	if !ok {
		// Jobs gone, or whose Pod came, are swept here: the map holds
		// the podless Jobs of the last ten minutes.
		for u, t := range k.podless {
			if now.Sub(t) > podlessKept {
				delete(k.podless, u)
			}
		}
		k.podless[uid] = now
		return k.digestGrace, false
	}
	if wait := k.digestGrace - now.Sub(since); wait > 0 {
		return wait, false
	}
	// Kept: a run whose claim still looks alive is looked at again
	// (finishOrphan), and its grace is over already.
	return 0, true
}

// podlessKept: how long podGrace remembers a podless Job.
const podlessKept = 10 * time.Minute
