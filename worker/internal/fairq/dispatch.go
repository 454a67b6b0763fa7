package fairq

// Fair queueing (docs/design.md §2d). Requests arrive on BUILDQ_REQUESTS,
// the contract's work queue, and are admitted from it by intake: a cheap
// step that applies the tenant's queue-length limit and moves each request
// to BUILDQ_QUEUE under buildq.queue.<tenant>.<priority>. Build slots are
// filled from there by each worker's dispatcher, which picks the tenant
// with the fewest running requests per weight among those with work and
// below their concurrency limit, and within the tenant the highest
// priority first.

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// ---- the dispatcher ----

// dispatcher fills this worker's free build slots from the queue.
type dispatcher struct {
	q *Queue

	mu     sync.Mutex
	view   map[string]map[string]uint64 // tenant → priority → queued
	viewAt time.Time
	dry    map[string]bool // fetched nothing since the last look
	// full: tenants found at their concurrency limit, until when they are
	// skipped without asking the slots bucket again (a freed slot's
	// announcement clears it sooner).
	full    map[string]time.Time
	running map[string]int // this worker's requests per tenant
	vtime   map[string]float64
	vnow    float64
	cons    map[string]jetstream.Consumer
	wake    chan struct{}
	// woke: admissions announced while a look's read is in flight (nil
	// when none is); the read may predate them: they are added to it.
	woke map[string]map[string]uint64
	// looking is closed when the look in flight ends (nil: none is).
	looking chan struct{}
	// read reads the queue's per-subject counts (the queue stream's
	// info); poll is how often an idle dispatcher looks again.
	read func(context.Context) (map[string]uint64, error)
	poll time.Duration
}

func newDispatcher(q *Queue) *dispatcher {
	d := &dispatcher{q: q, view: map[string]map[string]uint64{}, dry: map[string]bool{}, full: map[string]time.Time{}, running: map[string]int{},
		vtime: map[string]float64{}, cons: map[string]jetstream.Consumer{}, wake: make(chan struct{}, 1), poll: idlePoll}
	d.read = func(ctx context.Context) (map[string]uint64, error) {
		info, err := d.q.queue.Info(ctx, jetstream.WithSubjectFilter(v1.QueuePrefix+".>"))
		if err != nil {
			return nil, err
		}
		return info.State.Subjects, nil
	}
	return d
}

// order returns the tenants with queued work, the one most owed a slot
// first: fewest running per weight, then least served lately.
func (d *dispatcher) order() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var ts []string
	for t, ps := range d.view {
		if d.dry[t] || time.Now().Before(d.full[t]) {
			continue
		}
		for _, n := range ps {
			if n > 0 {
				ts = append(ts, t)
				break
			}
		}
	}
	share := func(t string) float64 { return float64(d.running[t]) / float64(d.q.cfg.Fair.Weight(t)) }
	vt := func(t string) float64 {
		if v, ok := d.vtime[t]; ok && v > d.vnow {
			return v
		}
		return d.vnow
	}
	slices.SortFunc(ts, func(a, b string) int {
		if mutant.On("ignore-shares") {
			return strings.Compare(a, b)
		}
		if c := cmp.Compare(share(a), share(b)); c != 0 {
			return c
		}
		if c := cmp.Compare(vt(a), vt(b)); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	return ts
}

// started counts a request of tenant taken by this worker; finished undoes it.
func (d *dispatcher) started(tenant, prio string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.count(tenant)
	if n := d.view[tenant][prio]; n > 0 {
		d.view[tenant][prio] = n - 1
	}
}

// startedDirect counts a request of tenant taken straight from intake:
// running and served like any, but never in the queue's view.
func (d *dispatcher) startedDirect(tenant string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.count(tenant)
}

// count records a request of tenant taken (d.mu held).
func (d *dispatcher) count(tenant string) {
	d.running[tenant]++
	v := max(d.vtime[tenant], d.vnow)
	d.vnow = v
	d.vtime[tenant] = v + 1/float64(d.q.cfg.Fair.Weight(tenant))
}

func (d *dispatcher) finished(tenant string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.running[tenant]--; d.running[tenant] <= 0 {
		delete(d.running, tenant)
	}
}

// consumer returns (creating it if needed) the consumer of tenant's prio.
func (d *dispatcher) consumer(ctx context.Context, tenant, prio string) (jetstream.Consumer, error) {
	name := DispatchConsumer(tenant, prio)
	// At least the AckWait every worker's heartbeats follow now:
	// buildq-workers' as the server has it (workers with different
	// --ack-wait share both). A dispatch consumer's AckWait is only ever
	// raised, never lowered: a request taken under AckWait X is
	// heartbeaten every X/3 for as long as it runs, which a lower AckWait
	// set under it would outrun.
	ackWait := d.q.cfg.AckWait
	if a := d.q.consumerAckWait(); a > 0 {
		ackWait = a
	}
	d.mu.Lock()
	c := d.cons[name]
	d.mu.Unlock()
	if c != nil && c.CachedInfo().Config.AckWait >= ackWait {
		return c, nil
	}
	// Another worker may have raised it further than this one knows.
	if cur, err := d.q.js.Consumer(ctx, v1.QueueStream, name); err == nil && cur.CachedInfo().Config.AckWait >= ackWait {
		c = cur
	} else {
		var err error
		c, err = d.q.js.CreateOrUpdateConsumer(ctx, v1.QueueStream, jetstream.ConsumerConfig{
			Durable:       name,
			Description:   "buildq dispatch: tenant " + tenant + ", priority " + prio,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       ackWait,
			MaxDeliver:    -1,
			FilterSubject: QueueSubject(tenant, prio),
		})
		if err != nil {
			return nil, err
		}
	}
	d.mu.Lock()
	d.cons[name] = c
	d.mu.Unlock()
	return c, nil
}

func (d *dispatcher) forget(tenant, prio string) {
	d.mu.Lock()
	delete(d.cons, DispatchConsumer(tenant, prio))
	d.mu.Unlock()
}

// taken is a request the dispatcher took from the queue.
type taken struct {
	msg     jetstream.Msg
	tenant  string
	prio    string
	slot    *slot
	ackWait time.Duration
	// direct: handed over by intake (dispatchDirect), msg is the
	// request's own message in BUILDQ_REQUESTS; it has no queue copy.
	direct bool
}

// next waits for requests to run on n free slots of this worker. It
// returns at least one and at most n, all of one tenant: the first in
// fair order, up to its weight's share of the n slots (one when the
// tenant has a concurrency limit). Taking several in one fetch keeps the
// dispatcher from being the bottleneck when requests are short (cache
// hits) — one fetch per request would cap a worker at one request per
// round trip to the server — while the share keeps a burst of free slots
// from going to one tenant.
func (d *dispatcher) next(ctx context.Context, n int) ([]*taken, bool) {
	for ctx.Err() == nil {
		d.mu.Lock()
		stale := time.Since(d.viewAt) > viewMaxAge
		d.mu.Unlock()
		if stale {
			<-d.look(ctx)
		}
		order := d.order()
		total := 0
		for _, t := range order {
			total += d.q.cfg.Fair.Weight(t)
		}
		for _, t := range order {
			share := max(1, n*d.q.cfg.Fair.Weight(t)/max(total, 1))
			if tks := d.tryTenant(ctx, t, share); len(tks) > 0 {
				return tks, true
			}
		}
		if tk := d.idle(ctx); tk != nil {
			return []*taken{tk}, true
		}
	}
	return nil, false
}

// tryTenant takes up to n of tenant's next requests, highest priority
// first, if the tenant is below its concurrency limit (then one, with its
// slot, recorded in the slot before it is handled); otherwise it marks it
// full.
func (d *dispatcher) tryTenant(ctx context.Context, tenant string, n int) []*taken {
	var s *slot
	if limit := d.q.cfg.Fair.ConcurrencyOf(tenant); limit > 0 && !mutant.On("ignore-concurrency") {
		var ok bool
		if s, ok = d.q.acquireSlot(ctx, tenant, limit); !ok {
			// At its limit: it waits, nothing is fetched, and its slots
			// are not scanned again until one is freed (announced) or a
			// holder could have lapsed.
			d.markFull(tenant)
			return nil
		}
		if s.reserved {
			return d.takeReserved(ctx, tenant, s)
		}
		n = 1 // one slot, one request
	}
	var out []*taken
	prios := v1.Priorities
	if mutant.On("ignore-priority") {
		prios = slices.Clone(prios)
		slices.Reverse(prios)
	}
	for _, p := range prios {
		if len(out) >= n {
			break
		}
		d.mu.Lock()
		queued := d.view[tenant][p]
		d.mu.Unlock()
		if queued == 0 {
			continue
		}
		c, err := d.consumer(ctx, tenant, p)
		if err != nil {
			d.q.log.Warn("creating a dispatch consumer failed", zap.String("tenant", tenant), zap.String("priority", p), zap.Error(err))
			continue
		}
		want := n - len(out)
		if uint64(want) > queued {
			want = int(queued)
		}
		batch, err := c.FetchNoWait(want)
		if err != nil {
			d.forget(tenant, p)
			continue
		}
		got := 0
		for m := range batch.Messages() {
			got++
			out = append(out, &taken{msg: m, tenant: tenant, prio: p, slot: s, ackWait: c.CachedInfo().Config.AckWait})
		}
		if err := batch.Error(); err != nil && errors.Is(err, jetstream.ErrConsumerNotFound) {
			d.forget(tenant, p)
		}
		if got < want {
			d.mu.Lock()
			if d.view[tenant] != nil {
				d.view[tenant][p] = 0 // nothing more deliverable now (held, or waiting to be retried)
			}
			d.mu.Unlock()
		}
	}
	if len(out) > 0 && s != nil {
		tk := out[0]
		meta, err := tk.msg.Metadata()
		if err == nil {
			err = s.hold(ctx, tk.msg.Subject(), meta.Sequence.Stream)
		}
		if err != nil {
			// Unrecorded, the slot would not be kept for the request
			// were this worker to die while its build runs: it is not
			// run now, and goes back at once.
			d.q.log.Warn("recording a request in its concurrency slot failed; handing it back", zap.String("tenant", tenant), zap.Error(err))
			_ = tk.msg.Nak()
			s.release()
			d.markFull(tenant)
			return nil
		}
	}
	if len(out) > 0 {
		return out
	}
	s.release()
	d.markDry(tenant)
	return nil
}

// takeReserved takes a kept slot with the request it is kept for, and
// with no other: it fetches the next message of that request's subject
// and takes the slot if it is that request (redelivered: handed back, its
// retry delay over, or its holder's AckWait passed). Any other message
// goes back at once (Nak) and the tenant waits. A lapsed holder's request
// is redelivered only once its consumer's AckWait has passed since the
// holder's last heartbeat, a retried one after its delay: nothing is
// fetched before this worker watched the slot unchanged that long (and,
// for a lapse, half a lease more).
func (d *dispatcher) takeReserved(ctx context.Context, tenant string, s *slot) []*taken {
	want := s.reservedFor
	p, ok := v1.PriorityOf(strings.TrimPrefix(want.Subject, v1.QueuePrefix+"."+tenant+"."))
	if !ok || QueueSubject(tenant, p) != want.Subject {
		d.markFull(tenant) // not its queue: only KeepSlots frees it, when its request is finished
		return nil
	}
	c, err := d.consumer(ctx, tenant, p)
	if err != nil {
		d.markFull(tenant)
		return nil
	}
	ackWait := c.CachedInfo().Config.AckWait
	if (!want.HandedBack && s.watched < ackWait+want.lease(d.q.cfg.Lease)/2) ||
		(want.HandedBack && s.watched < time.Duration(want.RetryMs)*time.Millisecond) {
		d.markFull(tenant)
		return nil
	}
	batch, err := c.FetchNoWait(1)
	if err != nil {
		d.forget(tenant, p)
		d.markFull(tenant)
		return nil
	}
	var m jetstream.Msg
	for x := range batch.Messages() {
		m = x
	}
	if m == nil {
		d.markFull(tenant)
		return nil
	}
	meta, err := m.Metadata()
	if err != nil || meta.Sequence.Stream != want.QueueSeq {
		// Not redelivered yet, or still held by a holder whose renewals
		// fail: another request must not run on its slot.
		_ = m.Nak()
		d.markFull(tenant)
		return nil
	}
	if err := s.take(ctx); err != nil {
		_ = m.Nak()
		d.markFull(tenant)
		return nil
	}
	return []*taken{{msg: m, tenant: tenant, prio: p, slot: s, ackWait: ackWait}}
}

// markFull skips tenant, at its limit, for a third of the lease (or until
// a freed slot is announced).
func (d *dispatcher) markFull(tenant string) {
	d.mu.Lock()
	d.full[tenant] = time.Now().Add(d.q.cfg.Lease / 3)
	d.mu.Unlock()
}

func (d *dispatcher) markDry(tenant string) {
	d.mu.Lock()
	d.dry[tenant] = true
	d.mu.Unlock()
}

// dispatchLoop runs requests from the queue on this worker's free slots
// until ctx ends.
func (q *Queue) dispatchLoop(ctx, workCtx context.Context, wg *sync.WaitGroup) {
	d := newDispatcher(q)
	// A look in flight when ctx ends is over before the loop is: nothing
	// of the dispatcher outlives Run.
	defer d.lookEnded()
	sub, err := q.nc.Subscribe(wakeSubject, d.woken)
	if err != nil {
		q.log.Warn("subscribing to queue announcements failed; the queue is polled", zap.Error(err))
	} else {
		defer func() { _ = sub.Unsubscribe() }()
	}
	for {
		select {
		case q.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		n := 1
	more:
		for n < cap(q.sem) {
			select {
			case q.sem <- struct{}{}:
				n++
			default:
				break more
			}
		}
		tks, ok := d.next(ctx, n)
		if !ok {
			q.release(n)
			return
		}
		q.release(n - len(tks))
		for _, tk := range tks {
			if tk.direct {
				d.startedDirect(tk.tenant)
			} else {
				d.started(tk.tenant, tk.prio)
			}
			wg.Add(1)
			go q.dispatched(ctx, workCtx, wg, d, tk)
		}
	}
}

// dispatched runs one request taken from the queue on its slot.
func (q *Queue) dispatched(ctx, workCtx context.Context, wg *sync.WaitGroup, d *dispatcher, tk *taken) {
	defer wg.Done()
	defer q.release(1)
	// The request stops counting as its tenant's running work when its
	// message is settled (its result out), not after its Job's cleanup:
	// the order of tenants follows what is running, as its results show.
	var once sync.Once
	finished := func() { once.Do(func() { d.finished(tk.tenant) }) }
	defer finished()
	q.cfg.Metrics.Taken()
	defer q.cfg.Metrics.Released()
	if tk.direct {
		q.runDirect(workCtx, tk, finished)
		return
	}
	m, err := asRequest(tk.msg, q.queue)
	if err != nil {
		// Not put there by intake (only possible without NATS
		// permissions): nothing to answer it with.
		q.log.Error("dropping a queued message that did not come through intake", zap.Error(err))
		if meta, merr := tk.msg.Metadata(); merr == nil {
			_ = q.queue.DeleteMsg(context.WithoutCancel(ctx), meta.Sequence.Stream)
		}
		_ = tk.msg.Term()
		tk.slot.release()
		return
	}
	extra := q.extraSlots(tk.tenant, QueueSubject(tk.tenant, tk.prio), m.qseq)
	act := q.handle(workCtx, Incoming{Msg: m, AckWait: tk.ackWait, Extra: extra}, finished)
	if act.Kind == Retry || act.Kind == Later {
		// Retried after transient trouble (or a wait for another
		// worker's publish): the run it let go may have a Job running
		// on, which its retry takes over. The slot is kept for it, and
		// so are its extras (their builds may be running too).
		retry := max(act.Delay, time.Millisecond)
		extra.finish(true, retry)
		tk.slot.handBack(QueueSubject(tk.tenant, tk.prio), m.qseq, retry)
		return
	}
	if act.Kind != HandBack {
		extra.finish(false, 0)
		tk.slot.release()
		return
	}
	if ctx.Err() != nil {
		// Stopping: the request's build goes on and another worker
		// takes the request on; the slot goes with it.
		extra.finish(true, 0)
		tk.slot.handBack(QueueSubject(tk.tenant, tk.prio), m.qseq, 0)
	} else {
		extra.finish(false, 0)
		tk.slot.release()
	}
	// Other workers' dispatchers take the handed-back request now, not
	// at their next look at the queue.
	_ = q.nc.Publish(wakeSubject, []byte(tk.tenant+" "+tk.prio))
}
