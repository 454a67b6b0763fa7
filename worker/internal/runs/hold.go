package runs

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// ErrLostClaim cancels the context of a run whose record another party
// changed: it is no longer this worker's run.
var ErrLostClaim = errors.New("build claim taken over by another worker")

// HoldOptions are the holder's identity, lease and clock.
type HoldOptions struct {
	// Owner is the holding worker's id, as the record names it.
	Owner string
	// Lease is how long the record stays this worker's without renewal;
	// it is renewed every third of it.
	Lease time.Duration
	Now   func() time.Time
	Log   *zap.Logger
	// BeforeRenew, when set, runs before each renewal (the fault
	// simulation pauses a renewer through it).
	BeforeRenew func(key string)
}

// Hold is a run this worker holds. The renewer, the re-check once the
// run's Job is started and Current are its three looks at the record, and
// they live together: whichever sees the record leave the run cancels the
// run's context with ErrLostClaim, so the build stops before it can push.
type Hold struct {
	store  *Store
	o      HoldOptions
	cancel context.CancelCauseFunc

	mu  sync.Mutex // guards rec, rev and sent against the renewer
	rec v1.BuildRecord
	rev uint64
	// sent is when the last write of the claim that landed was sent
	// (monotonic): the claim itself just before Hold, then each renewal.
	sent time.Time

	done, stopped chan struct{}
	stopOnce      sync.Once
}

// Hold starts holding the run of rec, written at rev: it renews the lease
// every Lease/3 until Stop. The returned context is the run's: canceled
// with ErrLostClaim when the record leaves the run, and when ctx ends.
func (s *Store) Hold(ctx context.Context, rec *v1.BuildRecord, rev uint64, o HoldOptions) (*Hold, context.Context) {
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
	runCtx, cancel := context.WithCancelCause(ctx)
	h := &Hold{store: s, o: o, cancel: cancel, rec: *rec, rev: rev, sent: time.Now(), done: make(chan struct{}), stopped: make(chan struct{})}
	go h.renew(runCtx)
	return h, runCtx
}

// renew renews the lease until Stop or the run's context ends.
func (h *Hold) renew(runCtx context.Context) {
	defer close(h.stopped)
	t := time.NewTicker(h.o.Lease / 3)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			if h.o.BeforeRenew != nil {
				h.o.BeforeRenew(h.rec.Key)
			}
			h.mu.Lock()
			c, crev := Renewed(&h.rec, h.o.Now(), h.o.Lease), h.rev
			h.mu.Unlock()
			sent := time.Now()
			nrev, ok, err := h.store.Renew(runCtx, c, crev)
			if !ok && err == nil {
				// Someone wrote the record — or our own earlier write
				// landed although its reply was lost. Only another run
				// or another owner means the claim is lost.
				cur, rrev, gerr := h.store.Get(runCtx, c.Key)
				if gerr == nil && cur != nil && cur.Run == c.Run && cur.Owner == h.o.Owner && !cur.Final() {
					nrev, ok = rrev, true
				}
			}
			switch {
			case err != nil:
				h.o.Log.Warn("lease renewal failed", zap.String("key", c.Key), zap.Error(err))
			case !ok:
				h.cancel(ErrLostClaim)
				return
			default:
				h.mu.Lock()
				h.rec.LeaseUntil, h.rev, h.sent = c.LeaseUntil, nrev, sent
				h.mu.Unlock()
			}
		case <-h.done:
			return
		case <-runCtx.Done():
			return
		}
	}
}

// Current reports whether the record is still on the held run and the
// run has not ended (what a backend asks before it creates the run's Job).
func (h *Hold) Current(ctx context.Context) bool {
	cur, _, err := h.store.Get(ctx, h.rec.Key)
	return err == nil && cur != nil && cur.Run == h.rec.Run && !cur.Final()
}

// Started records the run's Job and looks at the record once more: a
// cancel that came while the Job was being created found nothing to
// delete, so a run that ended or changed hands meanwhile is canceled now
// rather than at the next renewal.
func (h *Hold) Started(ctx context.Context, job string) {
	h.mu.Lock()
	h.rec.Job = job
	h.mu.Unlock()
	if cur, _, err := h.store.Get(ctx, h.rec.Key); err == nil && cur != nil && (cur.Final() || cur.Run != h.rec.Run || cur.Owner != h.o.Owner) {
		h.cancel(ErrLostClaim)
	}
}

// Held is the record as this worker last wrote it, and its revision.
func (h *Hold) Held() (v1.BuildRecord, uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.rec, h.rev
}

// SinceWrite is how long ago the last write of the claim that landed was
// sent. Nobody takes a run over before seeing its record unchanged for a
// lease and a half on their own clock, so while this is well under a
// lease the run is still this holder's alone.
func (h *Hold) SinceWrite() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return time.Since(h.sent)
}

// Stop stops renewing (idempotent) and returns the record as last
// written; the run's context is left to the caller's.
func (h *Hold) Stop() (v1.BuildRecord, uint64) {
	h.stopOnce.Do(func() { close(h.done); <-h.stopped })
	return h.Held()
}

// Close stops renewing and releases the run's context.
func (h *Hold) Close() {
	h.Stop()
	h.cancel(nil)
}
