package worker

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/fairq"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// Held at intake (docs/design.md §2d). A request whose key is being built
// for another request, or whose key has no record yet while another
// request of the same tenant and at least its priority is queued to build
// it (a pending mark, internal/ledger/pending.go), is a cache hit a little
// later. Queued, it would cost the queue's hop (a publish, a wake-up, a
// fetch, a delete and an ack) and wait for a slot behind the builds;
// parked by its handler, a waiter entry written and deleted and a
// decision updated. Instead intake holds its message here, unacked and
// heartbeaten on buildq-workers, with nothing written for it; every
// worker watches the build records, and when the key's record changes
// from building, its held requests are answered the way intake answers
// a hit (the entry created with its decision, the result published, the
// message acked) — or, when that answer is not a plain one (the build
// failed, the record went, a copy or attestation is due), admitted to
// the queue as intake would have admitted them at first. Nothing is
// decided by the hold: the record's state decides, through the same
// path as every intake answer.
//
// Bounds: a worker holds at most maxHeldAtIntake requests (past that,
// requests are queued as before); a request held --hold-at-intake (2
// minutes) is admitted; only a first delivery is held (a redelivery may follow an
// admission whose ack was lost); and on a stop every held request is
// handed back (Nak), to be admitted by the worker that takes it next. A
// worker that dies holding requests loses nothing: their messages come
// back after AckWait and are admitted then.
//
// Fair share and priorities hold: a request is held on a pending mark
// only when the mark's request is of its own tenant and at least its
// priority, so it could not have been taken before that request anyway;
// a build already running is what parking waits on too.

const (
	// maxHeldAtIntake bounds what one worker holds.
	maxHeldAtIntake = 8192
	// heldAnswering bounds the held requests answered or admitted at once.
	heldAnswering = 16
)

// intakeRoom holds requests at intake until their key's build ends.
type intakeRoom struct {
	w *Worker

	mu    sync.Mutex
	open  bool // the records' watch runs: requests may be held
	byKey map[string]*heldKey
	n     int
	// updated: when the watch showed each key's record change, for a
	// look that began about when a change the watch showed before the
	// request was held (kept a second).
	updated map[string]time.Time
	ctx     context.Context // the worker's work context: answers and admissions run in it
	sem     chan struct{}
}

// heldKey is what the room holds on one build key.
type heldKey struct {
	reqs []*heldReq
	// building: a record of the key was seen building; changed is when it
	// was last seen to change (or first held on), and lapse how long the
	// run may sit unchanged before its held requests go to the queue,
	// whose handler takes a lapsed run over (as the sweep lets go of a
	// lapsed run's parked requests, §2c).
	building bool
	changed  time.Time
	lapse    time.Duration
	// mark, without a record: the pending mark's request, looked up
	// every lease/2 (checked): decided or gone, it builds nothing.
	mark    ledger.Pending
	checked time.Time
}

// heldReq is one held request.
type heldReq struct {
	msg         jetstream.Msg
	since, beat time.Time
	admit       func(context.Context)
}

func newIntakeRoom(w *Worker) *intakeRoom {
	return &intakeRoom{w: w, byKey: map[string]*heldKey{}, updated: map[string]time.Time{}, sem: make(chan struct{}, heldAnswering)}
}

// Hold is fairq.Holder: intake asks it about a first delivery it could
// not answer.
func (h queueHandler) Hold(ctx context.Context, in fairq.Incoming, admit func(context.Context)) bool {
	return h.w.room.hold(ctx, in.Msg, in.TakenAtOnce, admit)
}

// hold takes msg into the room when its key's build is under way for
// another request (see above); false leaves it untouched. atOnce: this
// worker's idle dispatcher is about to take the request (fairq's
// direct.go) — a key without a record is then built at once, by this
// request, with no pending mark written first (its look for one would
// come between the publish and the Job, P1).
func (r *intakeRoom) hold(ctx context.Context, msg jetstream.Msg, atOnce bool, admit func(context.Context)) (held bool) {
	w := r.w
	defer func() {
		if p := recover(); p != nil {
			w.log.Error("panic while holding a request at intake; it goes to the queue", zap.Any("panic", p), zap.Stack("stack"))
			held = false
		}
	}()
	if w.cfg.HoldAtIntake < 0 || !w.ledger.Ready() || !r.room() {
		return false
	}
	meta, err := msg.Metadata()
	if err != nil || meta.NumDelivered > 1 {
		return false
	}
	req, _, key, _, ok := w.plainCandidate(msg)
	if !ok || !w.builds.shownHeld(req) {
		return false
	}
	state, lookAt, lapse := w.builds.looks.seen(key)
	var mark ledger.Pending
	switch state {
	case "building":
	case "absent":
		if atOnce {
			return false
		}
		prio, _ := v1.PriorityOf(req.Priority)
		mctx, cancel := context.WithTimeout(ctx, intakeLookupTimeout)
		mine, cur, err := w.ledger.MarkPending(mctx, key, ledger.Pending{Tenant: req.Tenant, RequestID: req.RequestID, Priority: prio}, w.cfg.HoldAtIntake)
		cancel()
		if err != nil {
			w.log.Debug("pending mark not read; the request goes to the queue", zap.String("key", key), zap.Error(err))
			return false
		}
		if mine || cur.Tenant == "" {
			return false // this request builds the key: queued
		}
		if (cur.Tenant != req.Tenant || priorityRank(cur.Priority) > priorityRank(prio)) && !mutant.On("hold-behind-anyone") {
			// Held, it would wait behind another tenant's queue, or
			// behind a lower priority than its own.
			return false
		}
		mark = cur
	default:
		return false
	}
	now := time.Now()
	hr := &heldReq{msg: msg, since: now, beat: now, admit: admit}
	r.mu.Lock()
	if !r.open || r.n >= maxHeldAtIntake {
		r.mu.Unlock()
		return false
	}
	hk := r.byKey[key]
	if hk == nil {
		hk = &heldKey{changed: now, checked: now}
		r.byKey[key] = hk
	}
	if state == "building" && !hk.building {
		hk.building, hk.changed, hk.lapse = true, now, lapse
	}
	if !hk.building && hk.mark.Tenant == "" {
		hk.mark = mark
	}
	hk.reqs = append(hk.reqs, hr)
	r.n++
	n := r.n
	// Within a second before the look: a read served by a replica may
	// lag the watch's update by a moment.
	changed := r.updated[key].After(lookAt.Add(-time.Second))
	r.mu.Unlock()
	w.cfg.Metrics.heldAtIntake(n)
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseWaiting,
		Message: "held at intake: its key is being built for another request; answered when it ends"})
	if changed {
		// The record changed about when the look began, before the
		// request was held: its update may have passed it by.
		r.recheck(key)
	}
	return true
}

// priorityRank orders priorities, highest first.
func priorityRank(p string) int {
	switch p {
	case v1.PriorityHigh:
		return 0
	case v1.PriorityLow:
		return 2
	}
	return 1
}

// room reports whether requests may be held now.
func (r *intakeRoom) room() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.open && r.n < maxHeldAtIntake
}

// run watches the build records until ctx ends (intake stops), then
// hands every held request back.
func (r *intakeRoom) run(ctx, workCtx context.Context) {
	w := r.w
	defer r.close()
	for ctx.Err() == nil {
		watch, err := w.runs.Bucket().WatchAll(ctx, jetstream.UpdatesOnly())
		if err != nil {
			w.log.Warn("watching the build records failed; no request is held at intake until it works", zap.Error(err))
			select {
			case <-time.After(time.Second):
				continue
			case <-ctx.Done():
				return
			}
		}
		r.mu.Lock()
		r.open, r.ctx = true, workCtx
		keys := make([]string, 0, len(r.byKey))
		for k := range r.byKey {
			keys = append(keys, k)
		}
		r.mu.Unlock()
		// Held before the watch (re)started: their records may have
		// changed unseen.
		for _, k := range keys {
			r.recheck(k)
		}
		r.watch(ctx, watch)
		_ = watch.Stop()
		r.mu.Lock()
		r.open = false
		r.mu.Unlock()
	}
}

// watch acts on the records' updates until the watch ends or ctx does.
func (r *intakeRoom) watch(ctx context.Context, watch jetstream.KeyWatcher) {
	tick := time.NewTimer(r.tickEvery())
	defer tick.Stop()
	for {
		select {
		case e, ok := <-watch.Updates():
			if !ok {
				return
			}
			if e != nil {
				r.updatedKey(e)
			}
		case <-tick.C:
			r.tick()
			tick.Reset(r.tickEvery())
		case <-ctx.Done():
			return
		}
	}
}

// tickEvery is how often held requests are heartbeaten and their time
// looked at: often enough for a third of the AckWait.
func (r *intakeRoom) tickEvery() time.Duration {
	return min(time.Second, max(r.w.heartbeatEvery()/3, 50*time.Millisecond))
}

// updatedKey acts on one update of a record: the requests held on its
// key leave the room unless it is still building.
func (r *intakeRoom) updatedKey(e jetstream.KeyValueEntry) {
	key := e.Key()
	now := time.Now()
	r.mu.Lock()
	r.updated[key] = now
	hk := r.byKey[key]
	if hk == nil {
		r.mu.Unlock()
		return
	}
	if e.Operation() == jetstream.KeyValuePut {
		if rec := runs.Decode(key, e.Value()); rec.State == v1.StateBuilding || mutant.On("hold-until-success") && rec.State != v1.StateSucceeded {
			hk.building, hk.changed, hk.lapse = true, now, rec.LapseAfter()
			r.mu.Unlock()
			return
		}
	}
	r.mu.Unlock()
	r.letGo(key, hk, "")
}

// letGo takes key's held requests out of the room (when hk is still
// what it holds on key) and answers or admits them; why, when set, is
// logged.
func (r *intakeRoom) letGo(key string, hk *heldKey, why string) {
	r.mu.Lock()
	if r.byKey[key] != hk {
		r.mu.Unlock()
		return
	}
	delete(r.byKey, key)
	r.n -= len(hk.reqs)
	n := r.n
	r.mu.Unlock()
	r.w.cfg.Metrics.heldAtIntake(n)
	r.w.builds.looks.forget(key)
	if why != "" {
		r.w.log.Info("requests held at intake go to the queue", zap.String("key", key), zap.Int("requests", len(hk.reqs)), zap.String("why", why))
	}
	r.release(hk.reqs)
}

// recheck reads key's record and lets its held requests go unless it is
// still building. No record: the pending build has not started yet, or
// will not; the mark's check or the time limit tells.
func (r *intakeRoom) recheck(key string) {
	r.w.bg.Add(1)
	go func() {
		defer r.w.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if e, err := r.w.runs.Bucket().Get(ctx, key); err == nil {
			r.updatedKey(e)
		}
	}()
}

// checkMark lets key's held requests go when the request of their pending
// mark was decided (or aged out) without a record of the key: it builds
// nothing, and they would wait for their limit.
func (r *intakeRoom) checkMark(key string, hk *heldKey) {
	r.w.bg.Add(1)
	go func() {
		defer r.w.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		le, err := r.w.ledger.Get(ctx, hk.mark.Tenant, hk.mark.RequestID)
		if err != nil || le == nil || le.E.Result == nil || mutant.On("hold-ignores-mark-end") {
			// Unread; not taken yet (still queued: no entry); or taken
			// and undecided: its build may come.
			return
		}
		r.mu.Lock()
		building := hk.building
		r.mu.Unlock()
		if !building {
			r.letGo(key, hk, "the request of its pending mark was decided without building it")
		}
	}()
}

// tick heartbeats the held requests, admits those held --hold-at-intake,
// lets go of keys whose run lapsed or whose mark's request was decided,
// and forgets old updates.
func (r *intakeRoom) tick() {
	now := time.Now()
	pace := r.w.heartbeatEvery()
	var (
		beat, expired []*heldReq
		lapsed        []string
		check         []string
	)
	r.mu.Lock()
	for key, hk := range r.byKey {
		keep := hk.reqs[:0]
		for _, h := range hk.reqs {
			if now.Sub(h.since) >= r.w.cfg.HoldAtIntake && !mutant.On("hold-forever") {
				expired = append(expired, h)
				continue
			}
			if now.Sub(h.beat) >= pace {
				h.beat = now
				beat = append(beat, h)
			}
			keep = append(keep, h)
		}
		hk.reqs = keep
		switch {
		case len(keep) == 0:
			delete(r.byKey, key)
		case hk.building && now.Sub(hk.changed) >= hk.lapse && !mutant.On("hold-on-lapsed-run"):
			lapsed = append(lapsed, key)
		case !hk.building && hk.mark.Tenant != "" && now.Sub(hk.checked) >= r.w.cfg.Lease/2:
			hk.checked = now
			check = append(check, key)
		}
	}
	r.n -= len(expired)
	n := r.n
	for k, at := range r.updated {
		if now.Sub(at) > time.Second {
			delete(r.updated, k)
		}
	}
	hks := map[string]*heldKey{}
	for _, k := range append(slices.Clone(lapsed), check...) {
		hks[k] = r.byKey[k]
	}
	r.mu.Unlock()
	for _, h := range beat {
		_ = h.msg.InProgress()
	}
	if len(expired) > 0 {
		r.w.cfg.Metrics.heldAtIntake(n)
		r.w.log.Info("requests held at intake past the limit; admitting them", zap.Int("requests", len(expired)), zap.Duration("limit", r.w.cfg.HoldAtIntake))
		r.release(expired)
	}
	for _, k := range lapsed {
		r.letGo(k, hks[k], "its run's record sat unchanged past its lease: the queue's handler takes the run over")
	}
	for _, k := range check {
		r.checkMark(k, hks[k])
	}
}

// release answers each of list from the cache when the answer is a plain
// one, and admits the others to the queue.
func (r *intakeRoom) release(list []*heldReq) {
	r.mu.Lock()
	ctx := r.ctx
	r.mu.Unlock()
	for _, h := range list {
		r.w.bg.Add(1)
		go func() {
			defer r.w.bg.Done()
			r.sem <- struct{}{}
			defer func() { <-r.sem }()
			if ctx.Err() != nil {
				_ = h.msg.Nak() // stopping: handed back
				return
			}
			if ok, settle := r.w.answerAtIntake(ctx, h.msg, false, "held"); ok {
				settle()
				return
			}
			h.admit(ctx)
		}()
	}
}

// close ends holding: every held request is handed back, to be admitted
// by the worker that takes it next.
func (r *intakeRoom) close() {
	r.mu.Lock()
	r.open = false
	var all []*heldReq
	for _, hk := range r.byKey {
		all = append(all, hk.reqs...)
	}
	r.byKey, r.n = map[string]*heldKey{}, 0
	r.mu.Unlock()
	r.w.cfg.Metrics.heldAtIntake(0)
	for _, h := range all {
		_ = h.msg.Nak()
	}
}
