package worker

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// The janitor: no Job is left behind. A run's owner deletes its run's Job
// once the result is stored, and a cancel deletes the Job of the run it
// ended; either delete can fail (an API server error, a worker killed
// after recording the outcome and before deleting), and nothing else
// comes back to that Job: a finished Job sends no more events, and
// ttlSecondsAfterFinished is only a safety net (a cluster may not run the
// TTL controller, and it never removes a Job still running). So every
// worker looks, every lease, at the Jobs its informer cache holds, and
// deletes (by UID) each one whose run no longer builds — its record ended
// or moved on to another run, or is gone — once it saw it so for a whole
// lease on its own clock (the owner's own delete normally comes first).
// The fault simulation found a Job left behind when the owner's delete
// failed under injected API errors and no TTL controller ran.

// JobRef is a build Job as the janitor sees it.
type JobRef struct {
	Name     string
	UID      types.UID
	Key, Run string
	// Finished: the Job reached a terminal condition.
	Finished bool
}

// jobJanitor is a backend whose Jobs the janitor can list (from a cache:
// no API request) and delete.
type jobJanitor interface {
	BuildJobs() []JobRef
	DeleteJob(ctx context.Context, name string, uid types.UID) error
}

// BuildJobs lists the build Jobs of the informer cache that are not being
// deleted already.
func (k *KubeBackend) BuildJobs() []JobRef {
	var out []JobRef
	for _, j := range k.watcher.Jobs() {
		if j.DeletionTimestamp != nil {
			continue
		}
		done, _ := kube.Finished(j)
		out = append(out, JobRef{Name: j.Name, UID: j.UID, Key: j.Annotations[kaniko.AnnotationKey],
			Run: j.Annotations[kaniko.AnnotationRun], Finished: done})
	}
	return out
}

// DeleteJob deletes a Job by name, only if it is still the one with uid
// (its Pods first: a Job still running stops before it can push).
func (k *KubeBackend) DeleteJob(ctx context.Context, name string, uid types.UID) error {
	return k.deleteJob(ctx, name, uid)
}

// janitor remembers, by Job UID, when this worker first saw a Job whose
// run no longer builds.
type janitor struct {
	mu      sync.Mutex
	garbage map[types.UID]time.Time
}

// sweepJobs deletes the Jobs left behind (see above). With KeepJobs,
// finished Jobs are kept (for inspection) and only Jobs still running for
// a run that ended are stopped.
func (w *Worker) sweepJobs(ctx context.Context) {
	b, ok := w.backend.(jobJanitor)
	if !ok {
		return
	}
	now := w.cfg.Now()
	seen := map[types.UID]bool{}
	for _, j := range b.BuildJobs() {
		if j.Key == "" || j.Run == "" || (w.cfg.KeepJobs && j.Finished) {
			continue
		}
		rec, _, err := w.runs.Get(ctx, j.Key)
		if err != nil {
			continue // look again at the next sweep
		}
		if rec != nil && rec.Run == j.Run && rec.State == v1.StateBuilding {
			continue // its run builds: the owner (or a taker) minds it
		}
		seen[j.UID] = true
		w.jobs.mu.Lock()
		if w.jobs.garbage == nil {
			w.jobs.garbage = map[types.UID]time.Time{}
		}
		first, known := w.jobs.garbage[j.UID]
		if !known {
			w.jobs.garbage[j.UID] = now
		}
		w.jobs.mu.Unlock()
		if !known || now.Sub(first) < w.cfg.Lease {
			continue
		}
		if err := b.DeleteJob(ctx, j.Name, j.UID); err != nil {
			w.log.Debug("janitor: deleting a Job left behind failed; trying again later", zap.String("job", j.Name), zap.Error(err))
			continue
		}
		w.log.Info("janitor: deleted a Job left behind", zap.String("job", j.Name), zap.String("key", j.Key), zap.String("run", j.Run), zap.Bool("finished", j.Finished))
	}
	w.jobs.mu.Lock()
	for uid := range w.jobs.garbage {
		if !seen[uid] {
			delete(w.jobs.garbage, uid)
		}
	}
	w.jobs.mu.Unlock()
}

// stopBuild deletes the Job of a run the tenant API's cancel ended.
func (w *Worker) stopBuild(ctx context.Context, key, run string) error {
	if jj, ok := w.backend.(jobJanitor); ok && mutant.On("cancel-by-name") {
		return jj.DeleteJob(ctx, kaniko.JobName(key), "")
	}
	return w.backend.Cleanup(ctx, key, run)
}
