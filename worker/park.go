package worker

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
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

// hdrRequeueToken carries a requeued request's token: a random value the
// worker wrote into the request's ledger entry when it parked it. Only a
// message that carries it is taken for the request's first message (a
// tenant can read neither bucket, so it cannot forge one).
const hdrRequeueToken = "Buildq-Requeue-Token"

// waiterValue is the value of a waiter index entry.
type waiterValue struct {
	Tenant    string `json:"tenant"`
	RequestID string `json:"requestId"`
	// Parked: no handler holds the request; the build's end answers it.
	Parked bool `json:"parked,omitempty"`
	// Run is the run it was parked on.
	Run string `json:"run,omitempty"`
	// The request message, to answer or requeue it.
	Subject  string    `json:"subject,omitempty"`
	MsgID    string    `json:"msgId,omitempty"`
	Seq      uint64    `json:"seq,omitempty"`
	MsgTime  time.Time `json:"msgTime,omitzero"`
	Body     []byte    `json:"body,omitempty"`
	ParkedAt time.Time `json:"parkedAt,omitzero"`
	// Token is the requeue token written into the ledger entry at park.
	Token string `json:"token,omitempty"`
}

// parseWaiter reads a waiter entry: JSON, or the first version's
// "tenant/id".
func parseWaiter(b []byte) (waiterValue, bool) {
	var v waiterValue
	if len(b) > 0 && b[0] == '{' {
		if json.Unmarshal(b, &v) != nil || v.Tenant == "" || v.RequestID == "" {
			return v, false
		}
		return v, true
	}
	tenant, id, ok := strings.Cut(string(b), "/")
	return waiterValue{Tenant: tenant, RequestID: id}, ok
}

// requeuedEntry returns the ledger entry a requeued message stands for:
// the entry of its tenant and id whose requeue token the message carries;
// nil when the message carries no token or not the entry's. An error means
// the entry could not be read, and so nothing is known: the caller must
// not take the message for a duplicate (or for a new request) on it — a
// requeue's waiter entry is gone, so the requeued message is all that is
// left of the request.
func (w *Worker) requeuedEntry(ctx context.Context, msg jetstream.Msg, tenant, id string) (*ledgerEntry, error) {
	tok := msg.Headers().Get(hdrRequeueToken)
	if tok == "" {
		return nil, nil
	}
	le, err := w.ledgerGet(ctx, tenant, id)
	if err != nil {
		return nil, err
	}
	if le == nil || le.e.RequeueToken == "" ||
		subtle.ConstantTimeCompare([]byte(le.e.RequeueToken), []byte(tok)) != 1 {
		return nil, nil
	}
	return le, nil
}

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
func (w *Worker) park(ctx context.Context, wr *waiterReg, key string, cur *v1.BuildRecord) (bool, error) {
	v := *wr.park
	v.Parked, v.Run, v.ParkedAt = true, cur.Run, w.cfg.Now().UTC()
	tok, err := w.setRequeueToken(ctx, wr.le)
	if err != nil {
		return false, Transient(err)
	}
	v.Token = tok
	b, _ := json.Marshal(v)
	wk := waiterKey(key, v.Tenant, v.RequestID)
	if _, err := w.requests.Put(ctx, wk, b); err != nil {
		return false, Transient(fmt.Errorf("waiter index: %w", err))
	}
	wr.once.Do(func() {})
	wr.added = true
	now, _, err := w.claims.get(ctx, key)
	if err == nil && now != nil && now.State == v1.StateBuilding && now.Owner != "" && now.Run == cur.Run {
		// Still the run the request was checked against and parked on
		// (v.Run); a new run since is looked at again by the caller.
		return true, nil
	}
	v.Parked = false
	b, _ = json.Marshal(v)
	if _, perr := w.requests.Put(ctx, wk, b); perr != nil {
		// Still parked: the sweep answers it.
		return true, nil
	}
	if err != nil {
		return false, Transient(err)
	}
	return false, nil
}

// answerWaiters answers or requeues the parked waiters of key, now that
// its run ended or was let go, in the background.
func (w *Worker) answerWaiters(ctx context.Context, key string) {
	w.bg.Add(1)
	go func() {
		defer w.bg.Done()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		items, err := w.listWaiters(ctx, "w."+key+".*")
		if err != nil {
			w.log.Debug("waiter index: listing failed; the sweep answers them", zap.String("key", key), zap.Error(err))
			return
		}
		w.settleWaiters(ctx, key, items[key], false)
	}()
}

// waiterItem is one waiter entry with its bucket key and revision.
type waiterItem struct {
	k   string
	rev uint64
	v   waiterValue
}

// listWaiters reads the waiter entries under filter, by build key.
func (w *Worker) listWaiters(ctx context.Context, filter string) (map[string][]waiterItem, error) {
	lister, err := w.requests.ListKeysFiltered(ctx, filter)
	if err != nil {
		if errors.Is(err, jetstream.ErrNoKeysFound) {
			return nil, nil
		}
		return nil, fmt.Errorf("waiter index: %w", err)
	}
	defer func() { _ = lister.Stop() }()
	out := map[string][]waiterItem{}
	seen := map[string]bool{}
	for k := range lister.Keys() {
		if seen[k] {
			continue
		}
		seen[k] = true
		parts := strings.Split(k, ".")
		if len(parts) != 3 {
			continue
		}
		got, err := w.requests.Get(ctx, k)
		if err != nil {
			continue // gone meanwhile
		}
		v, ok := parseWaiter(got.Value())
		if !ok {
			continue
		}
		out[parts[1]] = append(out[parts[1]], waiterItem{k: k, rev: got.Revision(), v: v})
	}
	return out, nil
}

// settleWaiters answers key's parked waiters by the state of its record:
// a final record answers them (or requeues those whose inputs it does not
// answer); a missing record, a run let go, or one lapsed (seen unchanged
// for 1.5 leases by the sweep) requeues them; a run still building keeps
// them parked. Entries already decided are published and dropped.
func (w *Worker) settleWaiters(ctx context.Context, key string, items []waiterItem, lapsed bool) {
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
		if !it.v.Parked {
			continue
		}
		if cur == nil {
			var err error
			if cur, _, err = w.claims.get(ctx, key); err != nil {
				return
			}
			if cur == nil {
				cur = &v1.BuildRecord{Key: key} // absent: requeue
			}
		}
		if err := w.settleWaiter(ctx, key, it, cur, lapsed); err != nil {
			w.log.Info("parked request not settled yet; the sweep tries again",
				zap.String("key", key), zap.String("requestId", it.v.RequestID), zap.Error(err))
		}
	}
}

func (w *Worker) settleWaiter(ctx context.Context, key string, it waiterItem, cur *v1.BuildRecord, lapsed bool) error {
	le, err := w.ledgerGet(ctx, it.v.Tenant, it.v.RequestID)
	if err != nil {
		return err
	}
	drop := func() {
		if err := w.requests.Delete(ctx, it.k, jetstream.LastRevision(it.rev)); err != nil && !isWrongRevision(err) {
			w.log.Debug("waiter index: delete failed", zap.String("key", key), zap.Error(err))
		}
	}
	switch {
	case le == nil:
		// The entry aged out with the results: nothing is left to answer.
		drop()
		return nil
	case le.e.Result != nil:
		if !le.e.Published {
			if err := w.deliver(ctx, le, verdictOf(le.e)); err != nil {
				return err
			}
		}
		drop()
		return nil
	case le.e.Canceled:
		v := canceledVerdict(w.parkedVerdict(it.v, key))
		if err := w.deliver(ctx, le, v); err != nil {
			return err
		}
		drop()
		return nil
	case cur.State == "" || (cur.State == v1.StateBuilding && (cur.Owner == "" || lapsed)):
		return w.requeue(ctx, it)
	case cur.State == v1.StateBuilding:
		return nil // still building: stays parked
	}
	req, err := v1.DecodeRequest(it.v.Body)
	if err != nil {
		return fmt.Errorf("parked request unreadable: %w", err)
	}
	repo, err := w.cfg.Naming.Repository(req)
	if err != nil {
		return err
	}
	if !sharedFailure(cur, req, repo) {
		// The run failed for its claimer's own inputs: this request
		// builds with its own.
		return w.requeue(ctx, it)
	}
	v := w.parkedVerdict(it.v, key)
	v, err = w.resultVerdict(ctx, v, req, cur, v1.OriginInflight, false, repo, naming.Destinations(repo, key, req.Tags))
	switch {
	case err != nil && IsTransient(err):
		// Registry trouble copying the image into the request's own
		// repository: handled like any request, with its retry budget.
		return w.requeue(ctx, it)
	case err != nil:
		v.data.Status, v.data.Reason, v.data.Message = v1.StatusFailed, v1.ReasonInfrastructureError, err.Error()
		v.data.Digest, v.data.Image, v.data.ImageRef, v.data.LogTail = "", "", "", ""
		v.term = true
	}
	if err := w.deliver(ctx, le, v); err != nil {
		return err
	}
	drop()
	return nil
}

// parkedVerdict is the start of a parked request's verdict.
func (w *Worker) parkedVerdict(p waiterValue, key string) verdict {
	var name string
	if req, err := v1.DecodeRequest(p.Body); err == nil {
		name = req.Name
	}
	started := p.ParkedAt
	if started.IsZero() {
		started = w.cfg.Now().UTC()
	}
	return verdict{tenant: p.Tenant, name: name, data: v1.ResultData{
		RequestID: p.RequestID, Tenant: p.Tenant, Name: name, Key: key, Attempts: 1,
		Timings: v1.Timings{QueuedAt: p.MsgTime.UTC(), StartedAt: started, QueueWaitMs: max(started.Sub(p.MsgTime).Milliseconds(), 0)},
	}}
}

// errPublishLater: the request's result is being published by another
// handler, or was decided by another worker that may still publish it;
// the waiter stays, and the sweep looks again.
var errPublishLater = errors.New("its result is another handler's to publish for now")

// deliver stores v as the request's decision (or takes the one stored
// first), publishes it and marks it published.
func (w *Worker) deliver(ctx context.Context, le *ledgerEntry, v verdict) error {
	release, ok := w.publishing.acquire(RequestIndexKey(le.e.Tenant, le.e.RequestID))
	if !ok {
		return errPublishLater
	}
	defer release()
	if v.data.Timings.FinishedAt.IsZero() {
		v.data.Timings.FinishedAt = w.cfg.Now().UTC()
	}
	if !v.recorded {
		rv, err := w.record(ctx, le, v)
		if err != nil {
			return err
		}
		v = rv
	}
	if v.publishedBefore {
		return nil
	}
	if v.recorded {
		// Decided before this pass and not marked published: see
		// handle.
		switch right, err := w.mayPublishDecision(ctx, le); right {
		case publishDone:
			return nil
		case publishLater:
			return cmp.Or(err, errPublishLater)
		}
	}
	w.event(v.tenant, v.name, v1.Event{RequestID: v.data.RequestID, Key: v.data.Key, Phase: v1.PhaseFinished,
		Message: finishedMessage(v.data), Job: v.data.Job})
	if err := w.publishResult(ctx, v.tenant, v.name, v.data); err != nil {
		return err
	}
	w.published(ctx, le)
	w.cfg.Metrics.published(v.data)
	w.log.Info("parked request answered", zap.String("requestId", v.data.RequestID), zap.String("status", string(v.data.Status)),
		zap.String("origin", string(v.data.Origin)), zap.String("reason", v.data.Reason))
	return nil
}

// requeue publishes a parked request again, carrying its first message's
// identity, and then drops its waiter entry (at the revision read: a
// second requeuer of the same revision publishes the same message id,
// which JetStream drops).
func (w *Worker) requeue(ctx context.Context, it waiterItem) error {
	p := it.v
	if len(p.Body) == 0 || p.Subject == "" {
		// An entry of the first version (not parked): nothing to requeue.
		return nil
	}
	if p.Token == "" {
		return nil // parked by no version that requeues
	}
	m := nats.NewMsg(p.Subject)
	m.Data = p.Body
	m.Header.Set(v1.MsgIDHeader, requeueMsgID(p, it.rev))
	m.Header.Set(hdrRequeueToken, p.Token)
	ack, err := w.js.PublishMsg(ctx, m)
	if err != nil {
		return fmt.Errorf("requeue %s: %w", p.RequestID, err)
	}
	if ack.Duplicate {
		// Another requeuer of the same revision published it first (the
		// id is the same for both); it removes the waiter entry too.
		w.log.Debug("requeue already published", zap.String("requestId", p.RequestID))
	}
	if err := w.requests.Delete(ctx, it.k, jetstream.LastRevision(it.rev)); err != nil && !isWrongRevision(err) {
		w.log.Debug("waiter index: delete after requeue failed", zap.Error(err))
	}
	w.cfg.Metrics.requeued()
	w.log.Info("parked request requeued", zap.String("requestId", p.RequestID), zap.String("tenant", p.Tenant))
	return nil
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
func (w *Worker) sweepWaiters(ctx context.Context) {
	items, err := w.listWaiters(ctx, "w.>")
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
			if it.v.Parked {
				parked++
			}
		}
		n += parked
		if parked == 0 {
			continue
		}
		cur, rev, err := w.claims.get(ctx, key)
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
				released := *cur
				released.Owner, released.LeaseUntil = "", time.Time{}
				if _, ok, err := w.claims.update(ctx, &released, rev); err != nil || !ok {
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

// setRequeueToken gives the request's ledger entry its requeue token,
// once: the token stays the request's for good, so every message that
// carries it — a requeue, and every redelivery of one, even after the
// request parked and unparked again — stands for the request. (Handlers
// of one request racing each other are settled by the ledger, as for any
// redelivery.)
func (w *Worker) setRequeueToken(ctx context.Context, le *ledgerEntry) (string, error) {
	if le == nil {
		return "", errors.New("request ledger: no entry to park")
	}
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	tok := hex.EncodeToString(raw[:])
	k := RequestIndexKey(le.e.Tenant, le.e.RequestID)
	for range 10 {
		if le.e.RequeueToken != "" {
			return le.e.RequeueToken, nil
		}
		e := le.e
		e.RequeueToken, e.UpdatedAt = tok, w.cfg.Now().UTC()
		b, _ := json.Marshal(e)
		rev, err := w.requests.Update(ctx, k, b, le.rev)
		if err == nil {
			le.e, le.rev = e, rev
			return tok, nil
		}
		if !isWrongRevision(err) {
			return "", fmt.Errorf("request ledger: %w", err)
		}
		cur, gerr := w.ledgerGet(ctx, le.e.Tenant, le.e.RequestID)
		if gerr != nil || cur == nil {
			return "", fmt.Errorf("request ledger: entry gone while parking: %v", gerr)
		}
		*le = *cur
	}
	return "", errors.New("request ledger: entry keeps changing")
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
func requeueMsgID(p waiterValue, rev uint64) string {
	m := hmac.New(sha256.New, []byte(p.Token))
	m.Write([]byte(strconv.FormatUint(rev, 10)))
	return v1.MsgID(p.Tenant, p.RequestID) + "/requeue-" + hex.EncodeToString(m.Sum(nil))[:32]
}
