package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// A request with several platforms is one run of its own key (the key
// covers the sorted set of platforms) whose work is not a Job: each
// platform is built as a build of its own — the request's inputs with that
// one platform, its own key — through the same state machine as any
// request (build.go): answered from the index when that platform was built
// before, joined when it is being built, claimed and run otherwise. Once
// every platform has its image, the run pushes an OCI image index of them
// to the request's destinations. So platforms are deduplicated and shared
// one by one, a later one-platform request is a cache hit, and a failing
// platform leaves the others' images in the cache.

// PlatformChecker is a Backend that can tell, before anything is built,
// whether it can build each platform (a node runs it): a multi-platform
// request is refused at once for a platform it cannot, instead of after
// its other platforms were built.
type PlatformChecker interface {
	CheckPlatform(ctx context.Context, req *v1.Request) error
}

// extraSlotsKey carries, in a handler's context, how to take one more of
// its tenant's concurrency slots for its request (fairq.ExtraSlots.Take).
type extraSlotsKey struct{}

func withExtraSlots(ctx context.Context, take func(context.Context) (release func(), ok bool)) context.Context {
	return context.WithValue(ctx, extraSlotsKey{}, take)
}

// platformSlots runs at most as many of an index's platform builds at once
// as its request holds concurrency slots: the handler's own, and one more
// for each further platform while the tenant has slots free. A slot no
// longer needed (fewer platforms left than slots, after a platform's build
// ended) is given back at once; the rest stay with the request until its
// handler is done, and are kept for it if its builds may still run
// (fairq.ExtraSlots).
type platformSlots struct {
	tokens chan struct{}
	mu     sync.Mutex
	extras []func()
	left   int
}

func takePlatformSlots(ctx context.Context, n int) *platformSlots {
	ps := &platformSlots{tokens: make(chan struct{}, n), left: n}
	ps.tokens <- struct{}{}
	if take, ok := ctx.Value(extraSlotsKey{}).(func(context.Context) (func(), bool)); ok {
		for range n - 1 {
			release, ok := take(ctx)
			if !ok {
				break
			}
			ps.extras = append(ps.extras, release)
			ps.tokens <- struct{}{}
		}
	}
	return ps
}

// acquire waits for a slot (false: ctx ended first).
func (ps *platformSlots) acquire(ctx context.Context) bool {
	select {
	case <-ps.tokens:
		return true
	case <-ctx.Done():
		return false
	}
}

// done ends one platform's build on its slot; ended says its run ended
// (no Job of it runs on), so a slot no longer needed may go.
func (ps *platformSlots) done(ended bool) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.left--
	if !ended {
		// Its run was let go (an error, the handler stopping): its Job
		// may run on, on this slot, which stays taken.
		return
	}
	if n := len(ps.extras); n > 0 && ps.left < 1+n {
		ps.extras[n-1]()
		ps.extras = ps.extras[:n-1]
		return
	}
	ps.tokens <- struct{}{}
}

// multiPlatform reports whether r builds an image index.
func multiPlatform(r *v1.Request) bool { return len(r.Platforms) > 1 }

// platformOf is the one platform a request builds, for its progress
// events ("" for the default platform or an image index).
func platformOf(r *v1.Request) string {
	if len(r.Platforms) == 1 {
		return r.Platforms[0]
	}
	return ""
}

// platformSub is platform p's build of index run b, made by req's
// handler: the run's inputs (its claimer's source and timeout) narrowed to
// p, as req's own request — its tenant, name and id, so the platform's
// claim, waiter entry and Job are the handler's request's, whoever
// claimed the index.
func platformSub(req *v1.Request, b Build, p string) *v1.Request {
	sub := platformRequest(b.Request, p)
	sub.Tenant, sub.Name, sub.RequestID = req.Tenant, req.Name, req.RequestID
	return sub
}

type platformPartKey struct{}

// asPlatformPart marks the walk of one platform's build of an index run.
// Its image goes into an image index that is shared like any build
// (buildq-builds, joiners, other tenants' copies), so it must be buildq's
// own build of the platform's key: an image found at the platform's tag
// (pushed by hand, or left from an index lost) is not taken, as the
// preflight takes one for a request's own first tag (preflight). The
// index's own tag is looked at before its key is claimed, as any
// request's.
func asPlatformPart(ctx context.Context) context.Context {
	return context.WithValue(ctx, platformPartKey{}, true)
}

// isPlatformPart reports whether ctx is a platform's build of an index.
func isPlatformPart(ctx context.Context) bool {
	on, _ := ctx.Value(platformPartKey{}).(bool)
	return on && !mutant.On("platform-takes-found-tag")
}

// platformRequest is r narrowed to platform p: the build of p's image.
func platformRequest(r *v1.Request, p string) *v1.Request {
	sub := *r
	sub.Platforms = []string{p}
	return &sub
}

// platformBuild is one platform's part of an index run.
type platformBuild struct {
	platform, key string
	rec           *v1.BuildRecord
	origin        v1.Origin
	err           error
}

// buildIndex is the work of an index run b, claimed (or taken over) by
// req's handler (repo: req's own repository, where its platforms' builds
// push; seq: its message's sequence). b.Request is the run's request
// (runRequest): its claimer's inputs and tenant; b.Repository the run's,
// where the index is pushed.
func (w *builder) buildIndex(ctx context.Context, req *v1.Request, repo string, seq uint64, b Build) (Outcome, error) {
	plats := b.Request.PlatformsOrDefault()
	if pc, ok := w.backend.(PlatformChecker); ok {
		for _, p := range plats {
			if err := pc.CheckPlatform(ctx, platformRequest(b.Request, p)); err != nil {
				return Outcome{Reason: v1.ReasonInvalidRequest, Message: err.Error()}, nil
			}
		}
	}
	progress := func(msg string) {
		if b.Progress != nil {
			b.Progress(msg)
		}
	}
	progress(fmt.Sprintf("building %d platforms, each as a build of its own: %s", len(plats), strings.Join(plats, ", ")))
	// One failing platform does not stop the others: their images go to
	// the cache. An error (not a failed build) does: the run is retried.
	// When the run's context ends (a cancel, a shutdown, a lost claim),
	// a cancel first stops the platforms' builds nobody else waits on;
	// the builds others wait on are finished here, for them, on this
	// request's slots (the tenant's limit counts their Jobs as this
	// request's until their runs end: let go, a build would run on with
	// no slot of the tenant's while its waiters queue for one). After a
	// shutdown or a lost claim every platform's run is let go, which
	// requeues the requests parked on them.
	keys := make([]string, len(plats))
	for i, p := range plats {
		keys[i] = w.keyOf(platformSub(req, b, p))
	}
	subs := newPlatformStops(ctx, len(plats))
	defer subs.stopAll(context.Canceled)
	// started: the platform's build runs in this handler (only such a
	// build is kept for others: one still waiting for a slot of the
	// index never starts once the index is canceled).
	started := make([]atomic.Bool, len(plats))
	// decided: the platforms' builds were stopped, or kept, once the
	// index's context ended.
	done, decided := make(chan struct{}), make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-ctx.Done():
		case <-done:
			return
		}
		kept := false
		for _, i := range w.stopCanceledPlatforms(req, b, plats, keys) {
			if started[i].Load() {
				subs.keep(i)
				kept = true
			}
		}
		subs.stop(context.Cause(ctx))
		close(decided)
		if !kept {
			return
		}
		// The worker stopping lets the kept builds' runs go too (their
		// waiters take them over), as it lets go of any run it holds.
		life := context.Background()
		if l := w.life.Load(); l != nil {
			life = *l
		}
		select {
		case <-life.Done():
			subs.stopAll(errWorkerStopping)
		case <-done:
		}
	}()
	slots := takePlatformSlots(ctx, len(plats))
	parts := make([]platformBuild, len(plats))
	var wg sync.WaitGroup
	for i, p := range plats {
		wg.Go(func() {
			pctx := subs.ctxs[i]
			if !slots.acquire(pctx) {
				parts[i] = platformBuild{platform: p, key: keys[i], err: context.Cause(pctx)}
				return
			}
			// A platform that waited for a slot starts only while the
			// index run is still current: a cancel ends the run, and
			// stops its platforms, before its handler hears of it. The
			// others end when it does (by the cancel, or a lost claim).
			if !b.current(pctx) {
				parts[i] = platformBuild{platform: p, key: keys[i], err: errNotCurrent}
				slots.done(true)
				return
			}
			started[i].Store(true)
			parts[i] = w.buildPlatform(pctx, req, repo, seq, b, p, keys[i])
			if err := parts[i].err; err != nil {
				// The first error ends the others: it is the run's. Once
				// the index's context ended, what the others do is the
				// cancel's to decide (they may be kept for others'
				// waiters): the error is only noted.
				cause := fmt.Errorf("platform %s: %w", p, err)
				if ctx.Err() == nil {
					subs.stop(cause)
				} else {
					subs.note(cause)
				}
			}
			slots.done(parts[i].err == nil)
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		// A canceled index's platforms are stopped, and their Jobs gone,
		// or finished for their waiters, before its handler settles and
		// frees the request's slots.
		<-decided
		return Outcome{}, context.Cause(ctx)
	}
	if err := subs.cause(); err != nil {
		// Not the others' context.Canceled: the error that ended them
		// (a transient one retries the request).
		return Outcome{}, err
	}
	for _, pb := range parts {
		if errors.Is(pb.err, errNotCurrent) {
			return Outcome{}, errNotCurrent
		}
	}
	if out, failed := indexFailure(parts); failed {
		return out, nil
	}
	reg, err := w.tenantRegistry(b.Request.Tenant)
	if err != nil {
		return Outcome{}, err
	}
	if reg == nil {
		return Outcome{}, errors.New("a multi-platform build needs a registry client to push its image index")
	}
	digests := map[string]string{}
	children := make([]registry.IndexChild, 0, len(parts))
	for _, pb := range parts {
		digests[pb.platform] = pb.rec.Digest
		children = append(children, registry.IndexChild{Ref: b.Repository + "@" + pb.rec.Digest, Platform: pb.platform})
	}
	progress(fmt.Sprintf("pushing the image index of %d platforms", len(parts)))
	d, err := reg.PushIndex(ctx, children, b.Destinations)
	if err != nil {
		return Outcome{}, Transient(fmt.Errorf("push the image index: %w", err))
	}
	return Outcome{Succeeded: true, Digest: d, Platforms: digests}, nil
}

// stopCanceledPlatforms: when req was canceled and nobody else waits on
// its image index, the builds of its platforms that no other request
// waits on are stopped too (their runs end Canceled, their Jobs go), as a
// cancel stops a one-platform build; the others go on for the requests
// that wait on them, and their indexes are returned (built on by req's
// handler: buildIndex).
func (w *builder) stopCanceledPlatforms(req *v1.Request, b Build, plats, keys []string) (goOn []int) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	le, err := w.ledger.Get(ctx, req.Tenant, req.RequestID)
	if err != nil || le == nil || !le.E.Canceled {
		return nil // a shutdown, a lost claim: the platforms' runs are let go, not stopped
	}
	// The cancel ends the index run (when nobody else waits on it) a
	// moment after it tells this handler: a run it ended is over whoever
	// comes to wait on its key meanwhile (a resubmit starts a new run).
	ended := false
	for deadline := time.Now().Add(2 * time.Second); !ended && time.Now().Before(deadline); {
		cur, _, err := w.runs.Get(ctx, b.Key)
		if err == nil && (cur == nil || cur.Run != b.Run || cur.Final()) {
			ended = true
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !ended {
		if alone, err := w.api.Unwaited(ctx, req.Tenant, req.RequestID, b.Key); err != nil || !alone {
			return nil // the index goes on for others: whoever takes it over needs them
		}
	}
	for i, key := range keys {
		stopped, err := w.api.StopUnwaited(ctx, req.Tenant, req.RequestID, key)
		switch {
		case err != nil:
			w.log.Warn("cancel: stopping a platform's build failed", zap.String("key", key), zap.Error(err))
		case stopped:
			w.log.Info("cancel: stopped the build of a canceled index's platform", zap.String("key", key), zap.String("platform", plats[i]))
		default:
			// Stopped already (the cancel's own stop, on whichever
			// worker answered it, may still be deleting its Job): the
			// Job of a run ended Canceled goes now, before this
			// request's slots are freed for the tenant's next build.
			// Or others wait on it: a run this request holds is built
			// on for them, on its slots.
			rec, _, err := w.runs.Get(ctx, key)
			if err == nil && rec != nil && rec.Final() && rec.Reason == v1.ReasonCanceled && !w.cfg.KeepJobs {
				if err := w.backend.Cleanup(ctx, key, rec.Run); err != nil {
					w.log.Warn("cancel: removing a platform's build failed", zap.String("key", key), zap.Error(err))
				}
			}
			if err == nil && rec != nil && !rec.Final() && rec.Holder == RequestIndexKey(req.Tenant, req.RequestID) && !mutant.On("canceled-index-lets-shared-go") {
				goOn = append(goOn, i)
			}
		}
	}
	return goOn
}

// buildPlatform builds platform p of index run b: from the index, by
// joining, or by claiming p's own key, like any request (never parked: the
// index run holds its handler). Its image is then tagged in the run's
// repository, where the index references it.
func (w *builder) buildPlatform(ctx context.Context, req *v1.Request, repo string, seq uint64, b Build, p, key string) platformBuild {
	sub := platformSub(req, b, p)
	pb := platformBuild{platform: p, key: key}
	dests := naming.Destinations(repo, pb.key, nil)
	wr := &waiterReg{}
	rec, origin, owned, err := w.build(asPlatformPart(ctx), sub, pb.key, repo, dests, seq, wr)
	if wr.added {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		w.ledger.DropWaiter(dctx, pb.key, sub.Tenant, sub.RequestID)
		cancel()
	}
	if err != nil {
		pb.err = err
		return pb
	}
	pb.rec, pb.origin = rec, origin
	if owned && !w.cfg.KeepJobs {
		// The platform's run is ended and stored: its Job has done its
		// part. A run a cancel ended may have its Job still running: it
		// is gone before this platform's slot (an extra slot of the
		// tenant's) is given back, or its build would run beside the
		// request the slot lets in, over the tenant's limit.
		if rec.State == v1.StateFailed && rec.Reason == v1.ReasonCanceled {
			gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			w.jobGone(gctx, rec.Key, rec.Run)
			cancel()
		} else if cerr := w.backend.Cleanup(context.WithoutCancel(ctx), rec.Key, rec.Run); cerr != nil {
			w.log.Warn("cleanup of a platform's build failed", zap.String("key", rec.Key), zap.Error(cerr))
		}
	}
	if rec.State == v1.StateSucceeded {
		// In this request's repository, as any answer is; and in the
		// run's, where the index references it (another when the run is
		// another tenant's request's, taken over: written with that
		// tenant's credentials, as the index is).
		if err := w.ensureTags(ctx, sub.Tenant, rec, dests); err != nil {
			pb.err = err
			return pb
		}
		if _, err := w.answerAttestation(ctx, sub, rec, repo); err != nil {
			pb.err = err
			return pb
		}
		if b.Repository != repo {
			if err := w.ensureTags(ctx, b.Request.Tenant, rec, naming.Destinations(b.Repository, pb.key, nil)); err != nil {
				pb.err = err
				return pb
			}
			if _, err := w.answerAttestation(ctx, platformRequest(b.Request, p), rec, b.Repository); err != nil {
				pb.err = err
				return pb
			}
		}
	}
	word := map[v1.Origin]string{v1.OriginCache: "from the cache", v1.OriginInflight: "by a build in progress", v1.OriginBuild: "built"}[origin]
	msg := fmt.Sprintf("%s: %s %s", p, rec.State, word)
	if rec.State == v1.StateSucceeded {
		msg += " as " + rec.Digest
	} else {
		msg += ": " + failedWhy(rec)
	}
	if b.Log != nil {
		_ = b.Log.Own(ctx, fmt.Sprintf("%s (build %s)", msg, rec.Key))
	}
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: rec.Key, Phase: v1.PhaseRunning, Platform: p, Message: msg})
	return pb
}

// indexFailure is the outcome of an index run some of whose platforms
// failed: the first failing platform's reason, message and log tail, with
// the platform named, and the other failures listed.
func indexFailure(parts []platformBuild) (Outcome, bool) {
	var failed []platformBuild
	for _, pb := range parts {
		if pb.rec.State != v1.StateSucceeded {
			failed = append(failed, pb)
		}
	}
	if len(failed) == 0 {
		return Outcome{}, false
	}
	first := failed[0]
	msg := fmt.Sprintf("platform %s: %s", first.platform, first.rec.Message)
	if first.rec.Message == "" {
		msg = fmt.Sprintf("platform %s failed (%s)", first.platform, first.rec.Reason)
	}
	if len(failed) > 1 {
		var also []string
		for _, pb := range failed[1:] {
			also = append(also, pb.platform+" ("+pb.rec.Reason+")")
		}
		msg += "; also failed: " + strings.Join(also, ", ")
	}
	built := map[string]string{}
	for _, pb := range parts {
		if pb.rec.State == v1.StateSucceeded {
			built[pb.platform] = pb.rec.Digest
		}
	}
	if len(built) == 0 {
		built = nil
	}
	return Outcome{Reason: first.rec.Reason, Message: msg, LogTail: first.rec.LogTail, Platforms: built}, true
}

// errWorkerStopping: the worker stops; the runs it holds are let go.
var errWorkerStopping = errors.New("the worker is stopping")

// platformStops holds the contexts of an index run's platform builds
// (buildIndex): stop ends them all but those kept, built on for other
// requests' waiters once the index was canceled; stopAll ends them all.
type platformStops struct {
	ctxs    []context.Context
	cancels []context.CancelCauseFunc
	mu      sync.Mutex
	kept    []bool
	err     error
}

func newPlatformStops(ctx context.Context, n int) *platformStops {
	s := &platformStops{ctxs: make([]context.Context, n), cancels: make([]context.CancelCauseFunc, n), kept: make([]bool, n)}
	for i := range n {
		s.ctxs[i], s.cancels[i] = context.WithCancelCause(context.WithoutCancel(ctx))
	}
	return s
}

// keep spares platform i's build from every later stop (not stopAll).
func (s *platformStops) keep(i int) {
	s.mu.Lock()
	s.kept[i] = true
	s.mu.Unlock()
}

// stop ends the platforms' builds not kept, with cause (the first cause
// noted is kept: cause()).
func (s *platformStops) stop(cause error) { s.end(cause, false) }

// stopAll ends every platform's build, kept or not.
func (s *platformStops) stopAll(cause error) { s.end(cause, true) }

// note keeps cause as the first, if none came before, and ends nothing.
func (s *platformStops) note(cause error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		s.err = cause
	}
}

func (s *platformStops) end(cause error, all bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil {
		s.err = cause
	}
	for i, c := range s.cancels {
		if all || !s.kept[i] {
			c(cause)
		}
	}
}

// cause is what stopped the platforms' builds first (nil: nothing yet).
func (s *platformStops) cause() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}
