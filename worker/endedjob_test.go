package worker

// endedJobGone, action by action: when the Job of the run a handler ended
// goes, and when it stays for a take-over (endedjob.go).

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/buildq/buildq/worker/internal/fairq"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/runs"
)

// cleanupRecorder is a backend whose Cleanup calls are counted; nothing
// else of it is used.
type cleanupRecorder struct {
	Backend
	calls chan [2]string
}

func (c cleanupRecorder) Cleanup(_ context.Context, key, run string) error {
	c.calls <- [2]string{key, run}
	return nil
}

// endStoredAfter is an end stored ahead whose write returns err after d.
func endStoredAfter(d time.Duration, err error) *endAhead {
	ea := &endAhead{}
	ea.start(func() endResult {
		time.Sleep(d)
		return endResult{err: err}
	})
	return ea
}

func TestTheJobOfAnEndedRunGoesOnlyOnceItsEndIsStored(t *testing.T) {
	t.Parallel()
	conflict := errors.New("wrong last sequence")
	for _, tc := range []struct {
		name string
		kind fairq.ActionKind
		// the run's end: its write returns err after delay, from when
		// the subtest starts
		delay   time.Duration
		err     error
		deleted bool
		// later: deleted only after the action's After returned, once
		// the end is stored.
		later bool
	}{
		{"settled, the end stored", fairq.Settle, 0, nil, true, false},
		{"settled, the end stored after 2s: waited for", fairq.Settle, 2 * time.Second, nil, true, false},
		{"settled, a newer run stored over it", fairq.Settle, 0, runs.ErrSuperseded, true, false},
		{"settled, the end not stored", fairq.Settle, 0, conflict, false, false},
		{"retried, the end stored", fairq.Retry, 0, nil, true, false},
		{"retried, the end not stored", fairq.Retry, 0, conflict, false, false},
		{"retried, the end not stored after endedJobWait", fairq.Retry, 3 * endedJobWait, conflict, false, false},
		{"retried, the end stored after endedJobWait", fairq.Retry, 3 * endedJobWait, nil, true, true},
		{"looked at later, the end stored", fairq.Later, 0, nil, true, false},
		{"looked at later, the end stored after endedJobWait", fairq.Later, 3 * endedJobWait, nil, true, true},
		{"handed back at shutdown", fairq.HandBack, 0, nil, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rec := cleanupRecorder{calls: make(chan [2]string, 1)}
			w := &Worker{backend: rec}
			ran := false
			end := endStoredAfter(tc.delay, tc.err)
			act := w.endedJobGone(fairq.Action{Kind: tc.kind, After: func() { ran = true }}, endedRun{key: "k", run: "r1", end: end}, false, ledger.Decision{}, zap.NewNop())
			if act.Kind != tc.kind {
				t.Fatalf("the action's kind changed from %v to %v", tc.kind, act.Kind)
			}
			if act.After != nil {
				start := time.Now()
				act.After()
				if !ran {
					t.Fatal("the action's own After did not run")
				}
				if tc.kind != fairq.Settle && time.Since(start) > endedJobWait+2*time.Second {
					t.Fatalf("a %v action's After took %v; it holds its slot for the run's end endedJobWait (%v) at most", tc.kind, time.Since(start), endedJobWait)
				}
			}
			if tc.later {
				select {
				case got := <-rec.calls:
					select {
					case <-end.stored:
						rec.calls <- got // after the end (a stalled test): checked below
					default:
						t.Fatalf("the Job of run %s was deleted before the run's end was stored", got[1])
					}
				default:
				}
			}
			// Whatever is deleted in the background is, once the end's
			// write has returned.
			<-end.stored
			w.bg.Wait()
			select {
			case got := <-rec.calls:
				if !tc.deleted {
					t.Fatalf("the Job of run %s was deleted; its end is not stored, so a take-over may still need it", got[1])
				}
				if got != [2]string{"k", "r1"} {
					t.Fatalf("deleted %v, want the ended run k/r1", got)
				}
			default:
				if tc.deleted {
					t.Fatal("the Job of the run the handler ended was not deleted")
				}
			}
		})
	}
}

// A settled decision that names the very run the handler ended deletes
// its Job in its own After: endedJobGone adds no second deletion. One
// naming another run does not spare the ended run's Job.
func TestTheDecisionsOwnCleanupIsNotDoubled(t *testing.T) {
	t.Parallel()
	rec := cleanupRecorder{calls: make(chan [2]string, 2)}
	w := &Worker{backend: rec}
	ended := endedRun{key: "k", run: "r1", end: endStoredAfter(0, nil)}
	own := fairq.Action{Kind: fairq.Settle}
	if act := w.endedJobGone(own, ended, true, ledger.Decision{CleanupKey: "k", CleanupRun: "r1"}, zap.NewNop()); act.After != nil {
		t.Fatal("a decision that cleans up the ended run got a second cleanup")
	}
	act := w.endedJobGone(own, ended, true, ledger.Decision{CleanupKey: "k", CleanupRun: "r0"}, zap.NewNop())
	if act.After == nil {
		t.Fatal("a decision naming another run spared the ended run's Job")
	}
	act.After()
	if got := <-rec.calls; got != [2]string{"k", "r1"} {
		t.Fatalf("deleted %v, want k/r1", got)
	}
}
