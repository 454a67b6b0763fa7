package worker

import (
	"context"
	"sync"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// firstLook is build's first look, read ahead (lookAhead): each read runs
// in its own goroutine from the start and is waited for only when asked.
// A later pass of the walk reads afresh.
type firstLook struct {
	sent      time.Time
	rec       func() recordRead
	pre       func() preflightRead
	ans       func() error
	preflight func(first bool) (*v1.BuildRecord, error)
	answered  func(first bool) error
	stop      context.CancelFunc
}

type recordRead struct {
	rec *v1.BuildRecord
	rev uint64
	err error
}

type preflightRead struct {
	found *v1.BuildRecord
	err   error
}

// lookAheadFresh is how long the first look's reads stand for the state
// they read: a possession check that took longer (a large context read
// from the store, a pause) leaves them stale, and the walk reads afresh —
// its answered check especially, which keeps a stalled handler from
// starting a build for a request answered meanwhile.
const lookAheadFresh = 250 * time.Millisecond

// fresh reports whether the reads sent ahead still stand (monotonic time:
// a paused process counts the pause).
func (f *firstLook) fresh() bool { return time.Since(f.sent) < lookAheadFresh }

func (f *firstLook) record() (*v1.BuildRecord, uint64, error) {
	r := f.rec()
	return r.rec, r.rev, r.err
}

// lookAhead sends the first look's reads. Its preflight and answered wait
// for the read sent ahead on the walk's first pass and read again on a
// later one; stop cancels what nobody waited for.
//
// created, when not zero, is when the request's ledger entry was created
// for this very message (intake's create, or the handler's own): the
// entry as created — undecided — stands for the first pass's answered
// check for lookAheadFresh from the create's sending, as any read of the
// first look does. Past that (a stall, a pause: monotonic time counts
// it), the check reads the entry.
//
// claimFirst: the walk claims before it looks (build.go), and reads the
// record only if the claim finds one: no read is sent ahead.
func (w *builder) lookAhead(ctx context.Context, req *v1.Request, key, repo string, dests []string, answered func() error, created time.Time, claimFirst bool) *firstLook {
	lctx, stop := context.WithCancel(ctx)
	f := &firstLook{stop: stop, sent: time.Now()}
	if claimFirst {
		var (
			once sync.Once
			r    recordRead
		)
		f.rec = func() recordRead {
			once.Do(func() {
				rec, rev, err := w.runs.Get(lctx, key)
				r = recordRead{rec, rev, err}
			})
			return r
		}
	} else if at, ok := w.looks.absentSince(key); ok {
		// Intake found no record a moment ago: that read is the first
		// look's, and stands for as long as one sent now would, counted
		// from its own start (intakelook.go).
		f.sent = at
		f.rec = func() recordRead { return recordRead{} }
	} else {
		f.rec = sendAhead(func() recordRead {
			rec, rev, err := w.runs.Get(lctx, key)
			return recordRead{rec, rev, err}
		})
	}
	preflight := func(ctx context.Context) preflightRead {
		found, err := w.preflight(ctx, req, key, repo, dests)
		return preflightRead{found, err}
	}
	// The preflight is the one look not sent ahead here: it is needed
	// only when the key is not built, and a HEAD per request (and a
	// Harbor project's creation) for every hit and join would undo the
	// shared, remembered registry checks. Intake sends it ahead for a
	// request about to be taken straight from intake whose key it found
	// no record of; the first pass takes that HEAD when it was sent
	// within lookAheadFresh.
	var (
		preOnce sync.Once
		pre     preflightRead
	)
	f.pre = func() preflightRead {
		preOnce.Do(func() {
			// A platform of an index takes no image found at its tag:
			// a HEAD sent ahead for a one-platform request of the same
			// tenant and tag found what that request may take, not what
			// the platform may (preflight).
			if p, ok := w.preflightSent(req, dests); ok && (!isPlatformPart(ctx) || mutant.On("platform-takes-found-tag-ahead")) {
				if r, ok := p.wait(ctx); ok {
					pre = r
					return
				}
			}
			pre = preflight(ctx)
		})
		return pre
	}
	if !created.IsZero() {
		f.ans = func() error {
			if time.Since(created) < lookAheadFresh {
				return nil
			}
			return answered()
		}
	} else {
		f.ans = sendAhead(answered)
	}
	f.preflight = func(first bool) (*v1.BuildRecord, error) {
		var r preflightRead
		if first && f.fresh() {
			r = f.pre()
		} else {
			r = preflight(ctx)
		}
		return r.found, r.err
	}
	f.answered = func(first bool) error {
		if first && f.fresh() {
			return f.ans()
		}
		return answered()
	}
	return f
}

// preflightBeside is the preflight of a build started without waiting
// for it (build.go, checksTagBeside): sent when called (or intake's
// taken, as preflight does), and waited for. own calls it once the
// build's Job is created.
func (f *firstLook) preflightBeside(first bool) func() preflightRead {
	return func() preflightRead {
		found, err := f.preflight(first)
		return preflightRead{found, err}
	}
}

// sendAhead runs f in its own goroutine now and returns the wait for its
// value; a panic in f is raised again in the goroutine that waits.
func sendAhead[T any](f func() T) func() T {
	type out struct {
		v T
		p any
	}
	ch := make(chan out, 1)
	go func() {
		var o out
		defer func() {
			if p := recover(); p != nil {
				o.p = p
			}
			ch <- o
		}()
		o.v = f()
	}()
	var (
		once sync.Once
		got  out
	)
	return func() T {
		once.Do(func() { got = <-ch })
		if got.p != nil {
			panic(got.p)
		}
		return got.v
	}
}
