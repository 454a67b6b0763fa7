package worker

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// Parking: a request that joins a build another request's handler runs
// costs no slot. Its waiter entry (w.<build key>.<ledger key> in the
// ledger bucket) is written with the request itself — subject, id, body,
// and the identity of its message — and the message is acked. Whoever
// ends the run (its owner, the reconciler, the cancel service) answers the
// key's parked waiters; a sweep on every worker answers what a crash left
// behind. A parked request whose run ended in a failure of the claimer's
// own inputs, or whose run nobody runs any more, is requeued: its request
// is published again with the original message's identity in headers, and
// is handled like any redelivery of it.
//
// Every answer goes through the ledger's compare-and-swap (record), so a
// parked request answered by two parties at once still has one decision,
// published under its one message id.

// errParked: the request was parked on a build; its message is acked
// without a result, which the build's end brings.
var errParked = errors.New("parked on a build in progress")

// holds reports whether the run of cur is handled by the request with
// ledger key lk: that request never parks on it (it would wait for
// itself); it waits actively and takes the run over when it lapses.
func holds(cur *v1.BuildRecord, lk string, req *v1.Request, seq uint64) bool {
	if cur.Holder != "" {
		return cur.Holder == lk
	}
	return cur.RequestID == req.RequestID && cur.Seq == seq
}

// park writes the request's waiter entry as parked on cur's run, then
// looks at the record again: a run that ended (or was let go) before the
// entry was written may have had its waiters answered already, so the
// request is unparked and handled on (parked false).
//
// The message is acked as parked (parked true) only when the entry is
// known to be parked. Unparking is a compare-and-swap at the revision
// this call wrote: another message of the request (a redelivery, a
// requeue) may have parked it again since, or a requeuer dropped it, and
// that later state stands. When unparking fails — that conflict, or a
// write whose reply was lost and so may have been stored — the entry's
// state is not known, and the message is not acked: it is tried again
// (or handed back), and parks again or finds its answer.
func (w *parking) park(ctx context.Context, wr *waiterReg, key string, cur *v1.BuildRecord) (bool, error) {
	v := *wr.park
	v.Parked, v.Run, v.ParkedAt = true, cur.Run, w.cfg.Now().UTC()
	tok, err := w.ledger.RequeueToken(ctx, wr.le)
	if err != nil {
		return false, Transient(err)
	}
	v.Token = tok
	rev, err := w.ledger.PutWaiterRev(ctx, key, v)
	if err != nil {
		return false, Transient(err)
	}
	wr.once.Do(func() {})
	wr.added = true
	if w.afterPark != nil {
		w.afterPark(key, v.Tenant, v.RequestID)
	}
	now, _, err := w.runs.Get(ctx, key)
	if err == nil && now != nil && now.State == v1.StateBuilding && now.Owner != "" && now.Run == cur.Run {
		// Still the run the request was checked against and parked on
		// (v.Run); a new run since is looked at again by the caller.
		return true, nil
	}
	v.Parked = false
	if mutant.On("unpark-overwrites") {
		if perr := w.ledger.PutWaiter(ctx, key, v); perr != nil {
			return true, nil //nolint:nilerr // the mutant: a failed unpark taken for parked
		}
	} else if perr := w.ledger.UpdateWaiter(ctx, key, v, rev); perr != nil {
		return false, Transient(fmt.Errorf("parking on %s: the waiter entry is not known to be parked: %w", key, perr))
	}
	if err != nil {
		return false, Transient(err)
	}
	return false, nil
}

// answerWaiters answers or requeues the parked waiters of key, now that
// its run ended or was let go, in the background.
func (w *parking) answerWaiters(ctx context.Context, key string) {
	w.bg.Add(1)
	go func() {
		defer w.bg.Done()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		items, err := w.ledger.ListWaiters(ctx, key)
		if err != nil {
			w.log.Debug("waiter index: listing failed; the sweep answers them", zap.String("key", key), zap.Error(err))
			return
		}
		w.settleWaiters(ctx, key, items[key], false)
	}()
}

// settleWaiters answers key's parked waiters by the state of its record:
// a final record answers them (or requeues those whose inputs it does not
// answer); a missing record, a run let go, or one lapsed (seen unchanged
// for 1.5 leases by the sweep) requeues them; a run still building keeps
// them parked. Entries already decided are published and dropped.
func (w *parking) settleWaiters(ctx context.Context, key string, items []ledger.WaiterItem, lapsed bool) {
	// One pass per key at a time in this worker: two passes (a run's end
	// and the sweep, or two ends) that both read a waiter's entry before
	// either recorded its decision would both publish its result.
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	mu := &w.settling[h.Sum32()%uint32(len(w.settling))]
	mu.Lock()
	defer mu.Unlock()
	var cur *v1.BuildRecord
	for _, it := range items {
		if !it.V.Parked {
			continue
		}
		if cur == nil {
			var err error
			if cur, _, err = w.runs.Get(ctx, key); err != nil {
				return
			}
			if cur == nil {
				cur = &v1.BuildRecord{Key: key} // absent: requeue
			}
		}
		if err := w.settleWaiter(ctx, key, it, cur, lapsed); err != nil {
			w.log.Info("parked request not settled yet; the sweep tries again",
				zap.String("key", key), zap.String("requestId", it.V.RequestID), zap.Error(err))
		}
	}
}

func (w *parking) settleWaiter(ctx context.Context, key string, it ledger.WaiterItem, cur *v1.BuildRecord, lapsed bool) error {
	le, err := w.ledger.Get(ctx, it.V.Tenant, it.V.RequestID)
	if err != nil {
		return err
	}
	drop := func() { w.ledger.DropWaiterAt(ctx, it) }
	switch {
	case le == nil:
		// The entry aged out with the results: nothing is left to answer.
		drop()
		return nil
	case le.E.Result != nil:
		if !le.E.Published {
			if err := w.deliver(ctx, le, verdictOf(le.E)); err != nil {
				return err
			}
		}
		drop()
		return nil
	case le.E.Canceled:
		v := w.parkedVerdict(it.V, key, le).canceled()
		if err := w.deliver(ctx, le, v); err != nil {
			return err
		}
		drop()
		return nil
	case cur.State == "" || (cur.State == v1.StateBuilding && (cur.Owner == "" || lapsed)):
		why := "the build it waited on is gone"
		switch {
		case cur.State == "":
		case cur.Owner == "":
			why = "the worker running the build it waited on let it go"
		default:
			why = "the worker running the build it waited on stopped renewing its claim"
		}
		return w.requeue(ctx, it, why)
	case cur.State == v1.StateBuilding:
		return nil // still building: stays parked
	}
	req, err := v1.DecodeRequest(it.V.Body)
	if err != nil {
		return fmt.Errorf("parked request unreadable: %w", err)
	}
	if req.Source.Git != nil {
		if le.E.Source == nil {
			// Parked before its source was packed cannot be: handled
			// again, it is packed then.
			return w.requeue(ctx, it, "its source is not packed yet")
		}
		resolveTo(req, le.E.Source)
	}
	repo, err := w.cfg.Naming.Repository(req)
	if err != nil {
		return err
	}
	if !sharedFailure(cur, req, repo) {
		// The run failed for its claimer's own inputs: this request
		// builds with its own.
		return w.requeue(ctx, it, "the build it joined failed for its claimer's own inputs ("+failedWhy(cur)+"); it builds with its own")
	}
	v := w.parkedVerdict(it.V, key, le)
	v, err = w.safeAnswer(ctx, v, req, cur, repo, naming.Destinations(repo, key, req.Tags))
	switch {
	case err != nil && IsTransient(err):
		// Registry trouble copying the image into the request's own
		// repository: handled like any request, with its retry budget.
		return w.requeue(ctx, it, v1.ReasonInfrastructureError+": "+err.Error())
	case err != nil:
		v.Data.Status, v.Data.Reason, v.Data.Message = v1.StatusFailed, v1.ReasonInfrastructureError, err.Error()
		v.Data.Digest, v.Data.Image, v.Data.ImageRef, v.Data.LogTail = "", "", "", ""
		v.Term = true
	}
	if err := w.deliver(ctx, le, v); err != nil {
		return err
	}
	drop()
	return nil
}

// safeAnswer is answer, with a panic in it (a scanner's, a registry
// client's) turned into an error that fails the request: a settling pass
// runs on the sweep's or a run's end's goroutine, where nothing else
// would recover it, and the panic would stop the worker — and the next
// worker to settle the request.
func (w *parking) safeAnswer(ctx context.Context, v verdict, req *v1.Request, cur *v1.BuildRecord, repo string, dests []string) (_ verdict, err error) {
	defer func() {
		if p := recover(); p != nil {
			w.log.Error("panic while answering a parked request", zap.String("requestId", req.RequestID), zap.Any("panic", p))
			err = fmt.Errorf("panic while answering the request: %v", p)
		}
	}()
	return w.answer(ctx, v, req, cur, v1.OriginInflight, false, repo, dests)
}

// parkedVerdict is the start of a parked request's verdict; le is its
// ledger entry.
func (w *parking) parkedVerdict(p ledger.Waiter, key string, le *ledger.Entry) verdict {
	var name string
	if req, err := v1.DecodeRequest(p.Body); err == nil {
		name = req.Name
	}
	started := p.ParkedAt
	if started.IsZero() {
		started = w.cfg.Now().UTC()
	}
	v := verdict{Decision: ledger.Decision{Tenant: p.Tenant, Name: name, Data: v1.ResultData{
		RequestID: p.RequestID, Tenant: p.Tenant, Name: name, Key: key, Attempts: 1,
		Timings: v1.Timings{QueuedAt: p.MsgTime.UTC(), StartedAt: started, QueueWaitMs: max(started.Sub(p.MsgTime).Milliseconds(), 0)},
	}}}
	if le != nil && le.E.Source != nil {
		v.Data.Source = &le.E.Source.SourceInfo
	}
	return v
}

// errPublishLater: the request's result is being published by another
// handler, or was decided by another worker that may still publish it;
// the waiter stays, and the sweep looks again.
var errPublishLater = errors.New("its result is another handler's to publish for now")

// deliver delivers v, a parked request's decision, through the ledger
// (record, publish, mark).
func (w *parking) deliver(ctx context.Context, le *ledger.Entry, v verdict) error {
	res, err := w.ledger.Deliver(ctx, le, v.Decision, ledger.Delivery{Publish: w.publish})
	switch res.Status {
	case ledger.Busy, ledger.Later:
		return cmp.Or(err, errPublishLater)
	case ledger.Published:
		d := res.Decision.Data
		w.log.Info("parked request answered", zap.String("requestId", d.RequestID), zap.String("status", string(d.Status)),
			zap.String("origin", string(d.Origin)), zap.String("reason", d.Reason))
	}
	return err
}

// requeue publishes a parked request again, carrying its first message's
// identity, and then drops its waiter entry (at the revision read: a
// second requeuer of the same revision publishes the same message id,
// which JetStream drops). why goes into the request's progress event.
func (w *parking) requeue(ctx context.Context, it ledger.WaiterItem, why string) error {
	p := it.V
	if len(p.Body) == 0 || p.Subject == "" {
		// An entry of the first version (not parked): nothing to requeue.
		return nil
	}
	if p.Token == "" {
		return nil // parked by no version that requeues
	}
	m := nats.NewMsg(p.Subject)
	m.Data = p.Body
	m.Header.Set(v1.MsgIDHeader, requeueMsgID(p, it.Rev))
	m.Header.Set(ledger.RequeueTokenHeader, p.Token)
	ack, err := w.js.PublishMsg(ctx, m)
	if err != nil {
		return fmt.Errorf("requeue %s: %w", p.RequestID, err)
	}
	if ack.Duplicate {
		// Another requeuer of the same revision published it first (the
		// id is the same for both); it removes the waiter entry too.
		w.log.Debug("requeue already published", zap.String("requestId", p.RequestID))
	}
	w.ledger.DropWaiterAt(ctx, it)
	w.cfg.Metrics.requeued()
	w.log.Info("parked request requeued", zap.String("requestId", p.RequestID), zap.String("tenant", p.Tenant), zap.String("why", why))
	if w.event != nil && !ack.Duplicate {
		if req, err := v1.DecodeRequest(p.Body); err == nil {
			w.event(p.Tenant, req.Name, v1.Event{RequestID: p.RequestID, Phase: v1.PhaseWaiting, Message: "requeued: " + why})
		}
	}
	return nil
}

// parking answers and requeues the requests parked on runs: when a run
// ends (the runs store's hook) and in the sweep that every worker runs.
type parking struct {
	cfg    *Config
	ledger *ledger.Ledger
	runs   *runs.Store
	js     jetstream.JetStream
	log    *zap.Logger
	// bg counts the answering of parked requests that runs in the
	// background (the worker waits for it when it stops).
	bg *sync.WaitGroup
	// publish publishes a decision's result (the worker's publisher).
	publish func(context.Context, ledger.Decision) (ledger.Ack, error)
	// event publishes a progress event (nil: none).
	event func(tenant, name string, e v1.Event)
	// answer completes a parked request's verdict from the final record
	// of the run it waited on (the handler's resultVerdict: the image
	// tagged into the request's own repository).
	answer func(ctx context.Context, v verdict, req *v1.Request, rec *v1.BuildRecord, origin v1.Origin, owned bool, repo string, dests []string) (verdict, error)
	// settling serializes settleWaiters per build key, by a hash of the
	// key: bounded, whatever the number of keys.
	settling [64]sync.Mutex
	// parked: the sweep's watch of runs with parked requests.
	parked parkWatch
	// afterPark, when set (tests only), runs after a request's entry is
	// written parked and before its run is looked at again.
	afterPark func(key, tenant, id string)
}

// parkWatch remembers, per build key with parked waiters, the record's
// revision and when this worker first saw it: a run unchanged for 1.5
// leases has nobody running it, and its parked waiters are requeued (one
// of them takes it over).
type parkWatch struct {
	mu   sync.Mutex
	seen map[string]observed
}

// sweepWaiters settles every parked waiter whose run ended, was let go or
// lapsed: what a crash between a run's end and its waiters' answers left.
func (w *parking) sweepWaiters(ctx context.Context) {
	items, err := w.ledger.ListWaiters(ctx, "")
	if err != nil {
		w.log.Debug("waiter sweep: listing failed", zap.Error(err))
		return
	}
	now := w.cfg.Now()
	w.parked.mu.Lock()
	for k := range w.parked.seen {
		if _, ok := items[k]; !ok {
			delete(w.parked.seen, k)
		}
	}
	w.parked.mu.Unlock()
	n := 0
	for key, list := range items {
		parked := 0
		for _, it := range list {
			if it.V.Parked {
				parked++
			}
		}
		n += parked
		if parked == 0 {
			continue
		}
		cur, rev, err := w.runs.Get(ctx, key)
		if err != nil {
			continue
		}
		lapsed := false
		if cur != nil && cur.State == v1.StateBuilding && cur.Owner != "" {
			w.parked.mu.Lock()
			seen, ok := w.parked.seen[key]
			if !ok || seen.rev != rev {
				w.parked.seen[key] = observed{rev: rev, at: now}
			} else if now.Sub(seen.at) >= cur.LapseAfter() {
				lapsed = true
				delete(w.parked.seen, key)
			}
			w.parked.mu.Unlock()
			if lapsed {
				// Nobody renews the run: let it go (a compare-and-swap on
				// the revision watched), so the requeued requests take it
				// over at once. A live owner renewed meanwhile, and keeps it.
				if ok, err := w.runs.Release(ctx, cur, rev); err != nil || !ok {
					continue
				}
				w.log.Info("released a lapsed build run with parked requests", zap.String("key", key), zap.String("run", cur.Run), zap.String("owner", cur.Owner))
			}
		}
		// Also for a run still building: a parked request canceled, or
		// decided by a redelivery, is published and dropped.
		w.settleWaiters(ctx, key, list, lapsed)
	}
	w.cfg.Metrics.setParked(n)
}

// requeueMsgID is the Nats-Msg-Id of the requeue of p's request at waiter
// revision rev: the same for every worker that requeues that revision (so
// JetStream keeps one), and unguessable by anyone who does not hold the
// requeue token, so nobody can publish it first and have JetStream drop
// the requeue. The token itself is not in it: a stream's message ids are
// not secret from its producers (JetStream's Nats-Expected-Last-Msg-Id
// check answers a failed publish with the stream's last message id, so a
// tenant can read the id of the message stored before its probe — an
// adversarial review read requeue tokens so), and an id that showed the
// token would give away every later requeue's id.
func requeueMsgID(p ledger.Waiter, rev uint64) string {
	m := hmac.New(sha256.New, []byte(p.Token))
	m.Write([]byte(strconv.FormatUint(rev, 10)))
	return v1.MsgID(p.Tenant, p.RequestID) + "/requeue-" + hex.EncodeToString(m.Sum(nil))[:32]
}

// waiterReg remembers whether a request was indexed as a waiter.
type waiterReg struct {
	once  sync.Once
	added bool
	// park, when set, lets the request park (park.go): the message it
	// came in, for the waiter entry, and its ledger entry.
	park *ledger.Waiter
	le   *ledger.Entry
	// created: when intake sent the create that made le, for this very
	// message, having registered the request with the cancel service
	// first; zero when le was there before or the handler made it.
	// Within lookAheadFresh of it, le as created stands for the first
	// look's check that the request is unanswered (lookAhead).
	created time.Time
}

// add indexes the request as a waiter of key, once. A nil reg does
// nothing (the request is indexed already).
func (r *waiterReg) add(ctx context.Context, l *ledger.Ledger, key, tenant, id string) {
	if r == nil {
		return
	}
	r.once.Do(func() {
		l.AddWaiter(ctx, key, tenant, id)
		r.added = true
	})
}
