package worker

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// The key's claim, sent beside the request's ledger entry's create
// (docs/design.md §2d, item 3; P1 in docs/benchmarks.md). A request about
// to be taken straight from intake whose key the worker knows nothing of,
// and whose build Pod checks its own tag (checksTagBeside), is claimed by
// its handler as its first look (build.go, claimFirst) once its entry's
// create is in. That claim depends on nothing the create tells but
// whether the request is still unanswered, so intake sends it too, beside
// the create, and the handler takes its outcome instead of writing its
// own:
//
//   - only the handler of the same message (tenant, request id and stream
//     sequence) takes it, only on the claim-first path, and only within
//     lookAheadFresh of its sending (the same window in which the entry as
//     created stands for "unanswered");
//   - a claim nobody takes is withdrawn (runs.Withdraw: a delete at the
//     claim's revision, which fires the "run ended" hook): the handler
//     withdraws it on every other way out — the request was answered,
//     canceled, reused an id, or its walk reads afresh (a requeued
//     request's too, whose new message was claimed for) — and so do a
//     timer, 2×lookAheadFresh after the sending, for a request that was
//     held or queued after all, and a worker that stops. No Job is ever created under a claim
//     before its handler took it, so a withdrawn claim built nothing, and
//     the requests that saw it (parked, joined, held at intake) look
//     again at an absent key and claim it with their own inputs;
//   - a failed withdrawal, or a worker killed before it, leaves a claim
//     whose lease lapses, as one killed right after its handler claimed:
//     the request's redelivery, or any request of the key, takes the run
//     over.

// claimAhead is a claim intake sent; done closes when its outcome is in.
type claimAhead struct {
	seq   uint64
	sent  time.Time
	claim *v1.BuildRecord
	done  chan struct{}
	rev   uint64
	ok    bool
	err   error

	mu sync.Mutex
	// taken by the handler, or withdrawn (gone closes once the
	// withdrawal's write is done): never both.
	taken, withdrawn bool
	gone             chan struct{}
}

// intakeClaims are the claims intake sent, by ledger key.
type intakeClaims struct {
	mu sync.Mutex
	m  map[string]*claimAhead
}

// claimAheadTimeout bounds a claim sent ahead and its withdrawal.
const claimAheadTimeout = 15 * time.Second

// sendClaim claims key for req's message at seq now, in its own
// goroutine, for its handler to take (takeClaim).
func (w *builder) sendClaim(ctx context.Context, req *v1.Request, key, repo string, dests []string, seq uint64) {
	if mutant.On("no-claim-ahead") {
		return
	}
	c := &claimAhead{seq: seq, sent: time.Now(), claim: w.newClaim(req, key, repo, dests, seq), done: make(chan struct{})}
	lk := ledger.Key(req.Tenant, req.RequestID)
	w.claims.mu.Lock()
	if w.claims.m == nil || len(w.claims.m) >= maxIntakeLooks {
		// Forgotten, not lost: each claim's own timer withdraws it.
		w.claims.m = map[string]*claimAhead{}
	}
	old := w.claims.m[lk]
	w.claims.m[lk] = c
	w.claims.mu.Unlock()
	if old != nil {
		w.withdrawClaim(old, "another message of the same request id came")
	}
	go func() {
		defer close(c.done)
		defer func() {
			if r := recover(); r != nil {
				c.ok, c.err = false, fmt.Errorf("claim sent ahead panicked: %v", r)
			}
		}()
		// The worker's context, not intake's deadline: the claim
		// outlives the admission, as the handler's own would.
		ctx, cancel := context.WithTimeout(ctx, claimAheadTimeout)
		defer cancel()
		c.rev, c.ok, c.err = w.runs.Claim(ctx, c.claim)
	}()
	time.AfterFunc(2*lookAheadFresh, func() {
		w.withdrawClaim(c, "its request's handler did not take it in time (held or queued at intake, or slow)")
	})
}

// takeClaim settles the claim intake sent for req's request id, if any,
// for the request's handler about to walk (build.go): with take (its
// claim-first path), a claim sent for this very message (seq) within
// lookAheadFresh is the handler's now and is returned; any other — sent
// for another message of the id, such as a requeued request's new one
// whose handler walks at the entry's first sequence — is withdrawn, and
// gone closes once the withdrawal is written (nil when there was nothing
// to withdraw), so that the walk does not find its own request's
// untaken claim and wait on it.
func (w *builder) takeClaim(req *v1.Request, seq uint64, take bool) (c *claimAhead, gone <-chan struct{}) {
	c = w.claimFor(req, seq, true)
	if c == nil {
		return nil, nil
	}
	if take && c.seq == seq && time.Since(c.sent) < lookAheadFresh {
		c.mu.Lock()
		if !c.withdrawn {
			c.taken = true
			c.mu.Unlock()
			return c, nil
		}
		c.mu.Unlock()
	}
	return nil, w.withdrawClaim(c, "its request's handler reads the key afresh")
}

// prepareClaimed has the backend prepare the build of the claim intake
// sent for req's message at seq (Preparer), while the claim and the
// entry's create are still in flight: the handler has nothing else to do
// then, and the claim's answer finds the Job ready to create. Nothing is
// taken or changed: a claim that is not taken, or is lost, leaves a
// prepared Job that Run never asks for.
func (w *builder) prepareClaimed(ctx context.Context, req *v1.Request, seq uint64) {
	p, ok := w.backend.(Preparer)
	if !ok || req == nil {
		return
	}
	lk := ledger.Key(req.Tenant, req.RequestID)
	w.claims.mu.Lock()
	c := w.claims.m[lk]
	w.claims.mu.Unlock()
	if c == nil || c.seq != seq || time.Since(c.sent) >= lookAheadFresh {
		return
	}
	select {
	case <-c.done:
		if !c.ok {
			return // lost, or failed: no build of this claim
		}
	default:
	}
	cl := c.claim
	p.Prepare(ctx, Build{Request: runRequest(req, cl), Key: cl.Key, Run: cl.Run, Repository: cl.Repository,
		Destinations: cl.Destinations, KeepFirstTag: true})
}

// claimFor removes and returns the claim intake sent for req's request
// id: only the one of the message at seq unless anySeq.
func (w *builder) claimFor(req *v1.Request, seq uint64, anySeq bool) *claimAhead {
	lk := ledger.Key(req.Tenant, req.RequestID)
	w.claims.mu.Lock()
	defer w.claims.mu.Unlock()
	c, ok := w.claims.m[lk]
	if !ok || (c.seq != seq && !anySeq) {
		return nil
	}
	delete(w.claims.m, lk)
	return c
}

// dropClaim withdraws the claim intake sent for req's message at seq
// unless its handler took it: the handler's way out of every path that
// did not reach the claim (a decided, canceled or refused request). Only
// that message's: a message that reuses the id of one in flight leaves
// that one's claim alone.
func (w *builder) dropClaim(req *v1.Request, seq uint64) {
	if req == nil {
		return
	}
	if c := w.claimFor(req, seq, false); c != nil {
		w.withdrawClaim(c, "its request was answered, canceled or refused before its walk")
	}
}

// withdrawPending withdraws every claim sent ahead that no handler took,
// and waits (up to ctx) until that is written: a worker that stops hands
// its requests back, and their redeliveries must not find claims of
// theirs standing until the lease lapses.
func (w *builder) withdrawPending(ctx context.Context) {
	w.claims.mu.Lock()
	pending := w.claims.m
	w.claims.m = nil
	w.claims.mu.Unlock()
	var gone []<-chan struct{}
	for _, c := range pending {
		gone = append(gone, w.withdrawClaim(c, "the worker is stopping"))
	}
	for _, g := range gone {
		select {
		case <-g:
		case <-ctx.Done():
			return
		}
	}
}

// wait is c's outcome once it is in. A handler that stops waiting (its
// request canceled, the worker stopping) hands the claim back, to be
// withdrawn once its outcome is in.
func (w *builder) waitClaim(ctx context.Context, c *claimAhead) (rev uint64, ok bool, err error) {
	select {
	case <-c.done:
		return c.rev, c.ok, c.err
	case <-ctx.Done():
		c.mu.Lock()
		c.taken = false
		c.mu.Unlock()
		w.withdrawClaim(c, "its request's handler stopped")
		return 0, false, ctx.Err()
	}
}

// withdrawClaim withdraws c unless its handler took it; the channel
// closes once that is done (at once when c was taken).
func (w *builder) withdrawClaim(c *claimAhead, why string) <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.taken {
		done := make(chan struct{})
		close(done)
		return done
	}
	if c.withdrawn {
		return c.gone
	}
	c.withdrawn, c.gone = true, make(chan struct{})
	go func() {
		defer close(c.gone)
		<-c.done
		if !c.ok || mutant.On("claim-ahead-never-withdrawn") {
			return // nothing was claimed
		}
		ctx, cancel := context.WithTimeout(context.Background(), claimAheadTimeout)
		defer cancel()
		ok, err := w.runs.Withdraw(ctx, c.claim, c.rev)
		switch {
		case err != nil:
			// Its lease lapses: the request's redelivery, or any
			// request of the key, takes the run over.
			w.log.Warn("withdrawing a claim sent ahead failed; its lease lapses and the run is taken over",
				zap.String("key", c.claim.Key), zap.String("run", c.claim.Run), zap.Error(err))
		case ok:
			w.log.Debug("withdrew a claim sent ahead", zap.String("key", c.claim.Key), zap.String("run", c.claim.Run), zap.String("why", why))
		}
	}()
	return c.gone
}

// claimOf is the claim intake sent that the handler took (takeClaim), as
// the handler would make it for req now. answered: intake's claim was
// made (ok) or found the key holding a record (the walk then reads it);
// not answered when it is not the claim the handler would make (the
// worker's naming changed between intake and the handler: it is
// withdrawn, and the handler claims itself).
func (w *builder) claimOf(ctx context.Context, c *claimAhead, key, repo string, dests []string, seq uint64) (claim *v1.BuildRecord, rev uint64, ok, answered bool, err error) {
	rev, ok, err = w.waitClaim(ctx, c)
	if err != nil {
		return nil, 0, false, false, err
	}
	cl := c.claim
	if cl.Key != key || cl.Repository != repo || cl.Seq != seq || !slices.Equal(cl.Destinations, dests) {
		c.mu.Lock()
		c.taken = false
		c.mu.Unlock()
		select {
		case <-w.withdrawClaim(c, "it no longer matches its request"):
		case <-ctx.Done():
			return nil, 0, false, false, ctx.Err()
		}
		return nil, 0, false, false, nil
	}
	return cl, rev, ok, true, nil
}

// settleSentClaim settles, before a walk, the claim intake sent for req
// (takeClaim): the claim, taken on the claim-first path; or withdrew
// true once a claim not taken is withdrawn, when the walk must read
// afresh (its reads sent ahead may have found it).
func (w *builder) settleSentClaim(ctx context.Context, req *v1.Request, seq uint64, claimFirst bool) (sent *claimAhead, withdrew bool, err error) {
	sent, gone := w.takeClaim(req, seq, claimFirst)
	if gone == nil {
		return sent, false, nil
	}
	select {
	case <-gone:
		return nil, true, nil
	case <-ctx.Done():
		return nil, false, ctx.Err()
	}
}

// claimAtOnce claims key on the claim-first path: with the claim intake
// sent (sent, taken), or with the handler's own create when there was
// none or it is not the one the handler would make. ok false: the key
// has a record, which the walk reads.
func (w *builder) claimAtOnce(ctx context.Context, sent *claimAhead, req *v1.Request, key, repo string, dests []string, seq uint64) (claim *v1.BuildRecord, rev uint64, ok bool, err error) {
	if sent != nil {
		var answered bool
		claim, rev, ok, answered, err = w.claimOf(ctx, sent, key, repo, dests, seq)
		if answered || err != nil {
			return claim, rev, ok, err
		}
	}
	claim = w.newClaim(req, key, repo, dests, seq)
	rev, ok, err = w.runs.Claim(ctx, claim)
	return claim, rev, ok, err
}
