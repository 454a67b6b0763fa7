package worker

import (
	"context"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/fairq"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// Who deletes a run's Job (docs/design.md §2 step 6): the handler whose
// own walk ended the run, once its end is stored, whatever becomes of
// its message; a decision read back from the ledger only once its run's
// record is final.

// runEnded reports whether run of key has ended: its record is final, or
// holds another run, or is gone. A record that cannot be read says no.
func (w *Worker) runEnded(ctx context.Context, key, run string) bool {
	if mutant.On("ended-job-of-any-decision") {
		return true
	}
	rec, _, err := w.runs.Get(ctx, key)
	return err == nil && (rec == nil || rec.Run != run || rec.Final())
}

// endedRun is the run a handler ended (its end stored, or being stored
// beside the decision: end), named by its key and run id.
type endedRun struct {
	key, run string
	end      *endAhead
}

// endedJobWait bounds how long a retried or postponed handler holds its
// slot waiting for its run's end, stored ahead; past it the wait goes on
// in the background.
const endedJobWait = time.Second

// endedJobGone makes the deletion of the Job of the run this handler's
// walk ended part of act, whatever act is. The decision the handler
// delivers is not always its own: another message of the same request (a
// parked request's requeued copy, a redelivery) may have been decided
// first, by this worker or another, and that decision names no run to
// clean up; or the delivery is retried, and the redelivery — which did
// not end the run — has none either. The run's end is stored, so no one
// needs the Job: it goes now rather than when the janitor comes back to
// it. An end stored ahead is waited for when the message is settled;
// otherwise for endedJobWait at most with the slot held (a retry or a
// look later must not hold it for long), and then in the background, the
// Job deleted once the end is stored; a run whose end failed to be stored
// keeps its Job for the take-over. An action whose own After deletes the
// same run's Job is left as it is (a Settle whose decision names that
// run; a last delivery's failed publish, which has no After, is not); a
// message handed back at shutdown leaves the Job to the janitor.
func (w *Worker) endedJobGone(act fairq.Action, ended endedRun, cleansOwn bool, d ledger.Decision, log *zap.Logger) fairq.Action {
	if ended.key == "" || w.cfg.KeepJobs || act.Kind == fairq.HandBack || mutant.On("ended-job-left-to-decision") {
		return act
	}
	if cleansOwn && d.CleanupKey == ended.key && d.CleanupRun == ended.run {
		return act
	}
	settle := act.Kind == fairq.Settle
	after := act.After
	cleanup := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := w.backend.Cleanup(ctx, ended.key, ended.run); err != nil {
			log.Warn("deleting the Job of the run this handler ended failed; ttlSecondsAfterFinished or the janitor removes it",
				zap.String("key", ended.key), zap.String("run", ended.run), zap.Error(err))
		}
	}
	act.After = func() {
		if after != nil {
			after()
		}
		switch {
		case mutant.On("ended-job-without-its-end"):
		case settle:
			if !ended.end.settled() {
				return
			}
		case !ended.end.settledWithin(endedJobWait):
			if mutant.On("ended-job-given-up") {
				return
			}
			// Not stored, or still being written (a NATS hiccup, its
			// retries): the slot goes back now, and the Job once the
			// end is stored. Nobody else would delete it: a redelivery
			// finds the request decided by another message, whose
			// decision names no run.
			w.bg.Add(1)
			go func() {
				defer w.bg.Done()
				if ended.end.settled() {
					cleanup()
				}
			}()
			return
		}
		cleanup()
	}
	return act
}

// refusedJobGone deletes the Job of r, the stored end of a run that
// built nothing (refusedRun), when the informer cache still shows it: an
// end stored by whoever did not delete the Job after it (the owner, whose
// write landed but whose reply was lost; the reconciler) leaves it to the
// claimer, who comes back to the run to look again. From the cache only:
// no API request for a Job that is gone.
func (w *builder) refusedJobGone(ctx context.Context, r *v1.BuildRecord) {
	j, ok := w.backend.(jobJanitor)
	if !ok || w.cfg.KeepJobs || mutant.On("refused-job-left") {
		return
	}
	for _, ref := range j.BuildJobs() {
		if ref.Key != r.Key || ref.Run != r.Run || r.Run == "" {
			continue
		}
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		if err := j.DeleteJob(dctx, ref.Name, ref.UID); err != nil {
			w.log.Info("deleting the Job of a run that built nothing failed; the janitor deletes it", zap.String("key", r.Key), zap.String("run", r.Run), zap.Error(err))
		}
		cancel()
	}
}
