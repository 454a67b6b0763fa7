package worker

import (
	"context"
	"errors"
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

// Held at intake (docs/design.md §2d, item 4). A request whose key is
// being built for another request of its tenant, or whose key has no
// record yet while another request of the same tenant and at least its
// priority is queued to build it (a pending mark,
// internal/ledger/pending.go), is a cache hit a little later. Queued, it
// would cost the queue's hop (a publish, a wake-up, a fetch, a delete and
// an ack) and wait for a slot behind the builds; parked by its handler, a
// waiter entry written and deleted and a decision updated. Instead intake
// holds its message here, unacked and heartbeaten on buildq-workers, with
// nothing written for it; every worker watches the build records, and
// when the key's record changes from building, its held requests are
// answered the way intake answers a hit (the entry created with its
// decision, the result published, the message acked) — or, when that
// answer is not a plain one (the build failed, the record went, a copy or
// attestation is due), admitted to the queue as intake would have
// admitted them at first. Nothing is decided by the hold: the record's
// state decides, through the same path as every intake answer.
//
// Held requests also go to the queue when their run's record sits
// unchanged past its lapse, when their mark's request was decided
// without a record, and when their hold reaches --hold-at-intake; they
// are handed back (Nak) on a stop. A request let go keeps its heartbeat
// until settled; one whose heartbeats lapsed is left to its redelivery.
// A worker holds at most maxHeldAtIntake, only first deliveries, nothing
// of a tenant with a queue-length limit, and nothing while buildq-workers
// has a MaxAckPending number.

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
	n     int // held, and let go but not yet settled
	// seen: the last revision of each key's record the watch showed, and
	// when (kept a minute): a request held on a look older than that
	// revision — a read served by a replica a moment behind — is let go
	// at once, not left for an update that already passed.
	seen map[string]seenRev
	// kept: the records kept in seen (seenRev.val); reconnects: the
	// connection's reconnects when they were last checked (connTrusted).
	kept       int
	reconnects uint64
	ctx        context.Context // the worker's work context: answers and admissions run in it
	sem        chan struct{}
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
	rev      uint64 // the last revision seen

	// mark, without a record: the pending mark's request. checked: when
	// the mark's request (or a quiet building record) was last looked up.
	mark    ledger.Pending
	checked time.Time
}

// heldReq is one held request; beat is when its last heartbeat went.
type heldReq struct {
	msg         jetstream.Msg
	since, beat time.Time
	admit       func(context.Context)
}

func newIntakeRoom(w *Worker) *intakeRoom {
	return &intakeRoom{w: w, byKey: map[string]*heldKey{}, seen: map[string]seenRev{}, sem: make(chan struct{}, heldAnswering)}
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
	if w.cfg.HoldAtIntake < 0 || !w.ledger.Ready() || w.ackPendingCapped.Load() || !r.room() {
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
	if w.cfg.Fair.QueueLimitOf(req.Tenant) > 0 && !mutant.On("hold-past-queue-limit") {
		// Held, its requests would not count against the limit: a tenant
		// with one queues them, and the limit is kept where it is kept.
		return false
	}
	look := w.builds.looks.seen(key)
	var mark ledger.Pending
	switch look.state {
	case "building":
		if look.tenant != req.Tenant && !mutant.On("hold-on-any-tenants-run") {
			// Another tenant's run: queued, its handler parks the request
			// in the waiter index, where a cancel of that tenant sees it
			// and spares the build for it (§3).
			return false
		}
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
		if (cur.Tenant != req.Tenant || v1.PriorityRank(cur.Priority) > v1.PriorityRank(prio)) && !mutant.On("hold-behind-anyone") {
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
	if look.state == "building" && !hk.building {
		hk.building, hk.changed, hk.lapse, hk.rev = true, now, look.lapse, look.rev
	}
	if !hk.building && hk.mark.Tenant == "" {
		hk.mark = mark
	}
	hk.reqs = append(hk.reqs, hr)
	r.n++
	n := r.n
	// The watch showed a revision the look did not (absent: any): the
	// record changed before the request was held, maybe for good.
	sr, ok := r.seen[key]
	passed := ok && sr.rev > look.rev
	r.mu.Unlock()
	w.cfg.Metrics.heldAtIntake(n)
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseWaiting,
		Message: "held at intake: its key is being built for another request; the cache answers it once that build is done"})
	if passed {
		r.recheck(key)
	}
	return true
}

// room reports whether requests may be held now.
func (r *intakeRoom) room() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.open && r.n < maxHeldAtIntake
}

// run watches the build records until ctx ends (intake stops), then
// hands every held request back. The heartbeats and time limits run on
// their own, whether the watch runs or not.
func (r *intakeRoom) run(ctx, workCtx context.Context) {
	w := r.w
	r.mu.Lock()
	r.ctx = workCtx
	r.mu.Unlock()
	ticks := make(chan struct{})
	go func() {
		defer close(ticks)
		r.beats(ctx)
	}()
	defer func() {
		<-ticks
		r.close()
	}()
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
		r.watchStarted()
		r.open = true
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
	for {
		select {
		case e, ok := <-watch.Updates():
			if !ok {
				return
			}
			if e != nil {
				r.updatedKey(e, true)
			}
		case <-ctx.Done():
			return
		}
	}
}

// beats runs tick until ctx ends.
func (r *intakeRoom) beats(ctx context.Context) {
	t := time.NewTimer(r.tickEvery())
	defer t.Stop()
	for {
		select {
		case <-t.C:
			r.tick()
			t.Reset(r.tickEvery())
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
// key leave the room unless it is still building. watched: the update
// came from the watch, whose record intake's looks may take (a read's
// record may be older than what the watch shows next, once it started).
func (r *intakeRoom) updatedKey(e jetstream.KeyValueEntry, watched bool) {
	key := e.Key()
	now := time.Now()
	r.mu.Lock()
	trusted := watched && r.connTrusted() // before cur is read: it may forget records
	if cur, ok := r.seen[key]; !ok || e.Revision() > cur.rev {
		sr := seenRev{rev: e.Revision(), at: now}
		if trusted && e.Operation() == jetstream.KeyValuePut && (cur.val != nil || r.kept < maxWatchedRecords || mutant.On("watched-records-uncapped")) {
			sr.val = e.Value()
		}
		r.keep(key, cur, sr)
	}
	hk := r.byKey[key]
	if hk == nil {
		r.mu.Unlock()
		return
	}
	if e.Operation() == jetstream.KeyValuePut {
		if rec := runs.Decode(key, e.Value()); rec.State == v1.StateBuilding || mutant.On("hold-until-success") && rec.State != v1.StateSucceeded {
			if !hk.building || e.Revision() > hk.rev {
				// Changed (a read of the same revision is no sign of life).
				hk.building, hk.changed, hk.lapse, hk.rev = true, now, rec.LapseAfter(), e.Revision()
			}
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
	r.mu.Unlock()
	r.w.builds.looks.forget(key)
	if why != "" {
		r.w.log.Info("requests held at intake go to the queue", zap.String("key", key), zap.Int("requests", len(hk.reqs)), zap.String("why", why))
	}
	r.release(hk.reqs, why != "")
}

// recheck reads key's record and lets its held requests go unless it is
// still building. No record: the pending build has not started yet, or
// will not; the mark's check or the time limit tells — unless the key
// was seen building: then its run's record went (a claim sent ahead and
// withdrawn, intakeclaim.go; the bucket's TTL), and they go.
func (r *intakeRoom) recheck(key string) {
	r.w.bg.Add(1)
	go func() {
		defer r.w.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		e, err := r.w.runs.Bucket().Get(ctx, key)
		switch {
		case err == nil:
			r.updatedKey(e, false)
		case errors.Is(err, jetstream.ErrKeyNotFound):
			r.mu.Lock()
			hk := r.byKey[key]
			gone := hk != nil && hk.building
			r.mu.Unlock()
			if gone {
				r.letGo(key, hk, "")
			}
		}
	}()
}

// checkMark lets key's held requests go when the request of their pending
// mark was decided without a record of the key: it builds nothing, and
// they would wait for their limit.
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
		if e, err := r.w.runs.Bucket().Get(ctx, key); err == nil {
			r.updatedKey(e, false) // a record after all: it decides
			return
		}
		r.letGo(key, hk, "the request of its pending mark was decided without building it")
	}()
}

// tick heartbeats the held requests, admits those held --hold-at-intake,
// lets go of keys whose run lapsed or whose mark's request was decided,
// looks again at records quiet for a third of their lapse, and forgets
// old revisions.
func (r *intakeRoom) tick() {
	now := time.Now()
	pace := r.w.heartbeatEvery()
	var (
		beat, expired  []*heldReq
		lapsed, marked []string
		quiet          []string
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
		case hk.building && now.Sub(hk.changed) >= hk.lapse/3 && now.Sub(hk.checked) >= hk.lapse/3:
			// A live run is renewed every third of its lease: a record
			// this quiet may have ended unseen (a watch that missed it).
			hk.checked = now
			quiet = append(quiet, key)
		case !hk.building && hk.mark.Tenant != "" && now.Sub(hk.checked) >= r.w.cfg.Lease/2:
			hk.checked = now
			marked = append(marked, key)
		}
	}
	for k, sr := range r.seen {
		if now.Sub(sr.at) > seenKeep {
			r.keep(k, sr, seenRev{})
		}
	}
	hks := map[string]*heldKey{}
	for _, k := range slices.Concat(lapsed, marked) {
		hks[k] = r.byKey[k]
	}
	r.mu.Unlock()
	for _, h := range beat {
		if !mutant.On("hold-unbeaten") {
			_ = h.msg.InProgress()
		}
	}
	if len(expired) > 0 {
		r.w.log.Info("requests held at intake past the limit; admitting them", zap.Int("requests", len(expired)), zap.Duration("limit", r.w.cfg.HoldAtIntake))
		r.release(expired, true)
	}
	for _, k := range lapsed {
		r.letGo(k, hks[k], "its run's record sat unchanged past its lease: the queue's handler takes the run over")
	}
	for _, k := range quiet {
		r.recheck(k)
	}
	for _, k := range marked {
		r.checkMark(k, hks[k])
	}
}

// release answers each of list from the cache when the answer is a plain
// one, and admits the others to the queue (toQueue: admits them all),
// heartbeating each until it is settled. A request whose last heartbeat
// is older than two thirds of the AckWait may have been delivered again
// meanwhile (a pause, a NATS outage): it is left alone, its redelivery
// is the request now.
func (r *intakeRoom) release(list []*heldReq, toQueue bool) {
	r.mu.Lock()
	ctx := r.ctx
	r.mu.Unlock()
	for _, h := range list {
		r.w.bg.Add(1)
		go func() {
			defer r.w.bg.Done()
			defer r.settled()
			r.mu.Lock()
			last := h.beat
			r.mu.Unlock()
			if time.Since(last) >= 2*r.w.heartbeatEvery() && !mutant.On("hold-acts-on-a-lapsed-delivery") {
				r.w.log.Warn("a request held at intake went unbeaten for two thirds of its AckWait; its redelivery is the request now",
					zap.Duration("since", time.Since(last)))
				return
			}
			stop := r.w.heartbeat(h.msg, 0)
			defer stop()
			r.sem <- struct{}{}
			defer func() { <-r.sem }()
			if ctx == nil || ctx.Err() != nil {
				// Stopping (or not started): handed back, once intake's
				// cut pull can no longer take it (IntakeQuiet).
				r.w.fq.IntakeQuiet()
				_ = h.msg.Nak()
				return
			}
			if toQueue {
				r.w.event2queue(h.msg)
			} else if ok, settle := r.w.answerAtIntake(ctx, h.msg, false, "held"); ok {
				settle()
				return
			} else {
				r.w.event2queue(h.msg)
			}
			h.admit(ctx)
		}()
	}
}

// settled counts one let-go request as settled (or left to its
// redelivery): it no longer takes room.
func (r *intakeRoom) settled() {
	r.mu.Lock()
	r.n--
	n := r.n
	r.mu.Unlock()
	r.w.cfg.Metrics.heldAtIntake(n)
}

// event2queue tells the request's watchers it left intake's hold for the
// queue.
func (w *Worker) event2queue(msg jetstream.Msg) {
	req, err := w.decode(msg)
	if err != nil {
		return
	}
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: w.builds.keyOf(req), Phase: v1.PhaseWaiting,
		Message: "left intake's hold for the queue"})
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
	r.byKey = map[string]*heldKey{}
	r.n -= len(all)
	n := r.n
	r.mu.Unlock()
	r.w.cfg.Metrics.heldAtIntake(n)
	if mutant.On("hold-not-handed-back") {
		return
	}
	if len(all) > 0 {
		r.w.fq.IntakeQuiet() // held requests came from intake's pulls
	}
	for _, h := range all {
		_ = h.msg.Nak()
	}
}
