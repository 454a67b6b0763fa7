package worker

import (
	"context"
	"errors"
	"time"

	corev1 "k8s.io/api/core/v1"

	"go.uber.org/zap"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/worker/internal/buildlog"
)

// Capturing a kaniko build's log: the Pods of the run's Job are followed
// (pods/log, follow, timestamps) container after container and attempt
// after attempt, into the run's log (buildlog). The capture resumes
// where the stored log stands — after a broken stream, and when another
// worker takes the run over — so the log holds every line once.

// logCapturer is a backend that can capture the rest of a finished
// build's log (the reconciler's, for a run whose owner is gone).
type logCapturer interface {
	CaptureLog(ctx context.Context, key, run string, lw LogWriter)
}

const (
	// logDrain is how long a build's outcome waits for its log to be read
	// to its end.
	logDrain = 15 * time.Second
	// orphanLogDrain bounds the reconciler's capture of a finished Job.
	orphanLogDrain = 30 * time.Second
)

// errLogTruncated ends a capture whose log reached its cap.
var errLogTruncated = errors.New("the log reached its cap")

// CaptureLog reads the rest of the log of key's Job of run into lw.
func (k *KubeBackend) CaptureLog(ctx context.Context, key, run string, lw LogWriter) {
	name := kaniko.JobName(key)
	if job, _, ok := k.watcher.Get(k.cfg.Namespace, name); !ok || job.Annotations[kaniko.AnnotationRun] != run {
		return
	}
	k.capture(ctx, name, lw)
}

// startCapture follows Job name's log into lw until ctx ends or the log
// is read to its end; the returned wait waits for that up to d, then
// stops it.
func (k *KubeBackend) startCapture(ctx context.Context, name string, lw LogWriter) (wait func(d time.Duration)) {
	if lw == nil {
		return func(time.Duration) {}
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		k.capture(cctx, name, lw)
	}()
	return func(d time.Duration) {
		if d > 0 {
			t := time.NewTimer(d)
			select {
			case <-done:
			case <-t.C:
			}
			t.Stop()
		}
		cancel()
		<-done
	}
}

// capture follows Job name's Pods into lw, resuming at the stored
// position after a conflict (another writer) or a failure.
func (k *KubeBackend) capture(ctx context.Context, name string, lw LogWriter) {
	signal, unsub := k.watcher.Subscribe(name)
	defer unsub()
	if job, _, ok := k.watcher.Get(k.cfg.Namespace, name); ok {
		lw.AddMask(kaniko.SecretValues(job))
	}
	f := &kube.LogFollower{
		Namespace: k.cfg.Namespace,
		Job:       name,
		Logs:      k.logSource,
		Pods: func() []*corev1.Pod {
			_, pods, _ := k.watcher.Get(k.cfg.Namespace, name)
			return pods
		},
		Changed: signal,
		Finished: func() bool {
			job, _, ok := k.watcher.Get(k.cfg.Namespace, name)
			if !ok || job.DeletionTimestamp != nil {
				return true
			}
			done, _ := kube.Finished(job)
			return done
		},
	}
	resync := false
	for ctx.Err() == nil && !lw.Ended() {
		if resync {
			// After a failure the writer may hold lines it could not
			// store: drop them and take the stored state, which the
			// follower resumes from (it reads them again).
			if err := lw.Resync(ctx); err != nil {
				k.log.Warn("reading the build's stored log failed; retrying", zap.String("job", name), zap.Error(err))
				if !sleepCtx(ctx, time.Second) {
					return
				}
				continue
			}
			resync = false
		}
		pos := lw.Position()
		err := f.Follow(ctx, kube.LogPosition{Pod: pos.Pod, Container: pos.Container, Time: pos.Time, Count: pos.Count},
			func(e kube.PodLogEvent) error {
				if e.NewAttempt {
					return lw.Attempt(ctx, e.Pod, e.Attempt, e.Reason)
				}
				if err := lw.Line(ctx, e.Pod, e.Container, e.Attempt, e.Time, e.Text); err != nil {
					return err
				}
				if lw.Truncated() {
					return errLogTruncated
				}
				return nil
			})
		if err == nil || errors.Is(err, errLogTruncated) {
			err = lw.Flush(ctx)
			if err == nil {
				return
			}
		}
		switch {
		case errors.Is(err, buildlog.ErrConflict):
			// Another writer appended: resume where the stored log stands
			// (the writer has taken it).
		case ctx.Err() != nil:
			return
		default:
			k.log.Warn("following the build's log failed; resuming", zap.String("job", name), zap.Error(err))
			resync = true
			if !sleepCtx(ctx, time.Second) {
				return
			}
		}
	}
}

// sleepCtx waits d; false when ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
