package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// The tenant API: status and cancel as NATS request/reply services, so a
// tenant needs no access to the KV buckets or the streams, and sees and
// cancels only its own requests. The tenant is the subject's last token,
// which NATS permissions guard.

// apiConcurrency bounds the status and cancel requests a worker answers at
// once.
const apiConcurrency = 32

// internalCancelSubject tells every worker that a held request was
// canceled (payload: its ledger key). Tenants must not publish on
// buildq.internal.>.
const internalCancelSubject = "buildq.internal.cancel"

// errRequestCanceled ends a held request's handling: its tenant canceled it.
var errRequestCanceled = errors.New("canceled on request")

// heldRequests maps the ledger key of each request this worker handles to
// the cancel of its handling.
type heldRequests struct {
	mu sync.Mutex
	m  map[string]context.CancelCauseFunc
}

func (h *heldRequests) hold(lk string, cancel context.CancelCauseFunc) func() {
	h.mu.Lock()
	h.m[lk] = cancel
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		delete(h.m, lk)
		h.mu.Unlock()
	}
}

func (h *heldRequests) cancel(lk string) {
	h.mu.Lock()
	c := h.m[lk]
	h.mu.Unlock()
	if c != nil {
		c(errRequestCanceled)
	}
}

// serveAPI subscribes the tenant API (queue group buildq-api: one worker
// answers each request), the legacy cancel subject, and the internal
// cancel notifications (every worker).
func (w *Worker) serveAPI(ctx context.Context) (func(), error) {
	var subs []*nats.Subscription
	stop := func() {
		for _, s := range subs {
			_ = s.Unsubscribe()
		}
	}
	handlers := []struct {
		subject, queue string
		fn             func(m *nats.Msg)
	}{
		{v1.APIStatusPrefix + ".*", "buildq-api", func(m *nats.Msg) {
			w.respond(ctx, m, func(cctx context.Context, tenant string) any {
				return w.status(cctx, tenant, strings.TrimSpace(string(m.Data)))
			})
		}},
		{v1.APICancelPrefix + ".*", "buildq-api", func(m *nats.Msg) {
			w.respond(ctx, m, func(cctx context.Context, tenant string) any {
				return w.cancel(cctx, tenant, strings.TrimSpace(string(m.Data)))
			})
		}},
		// buildq.cancel.<tenant>.<name>, the first version's subject.
		{v1.CancelPrefix + ".*.*", "buildq-cancel", func(m *nats.Msg) {
			w.respond(ctx, m, func(cctx context.Context, tenant string) any {
				return w.cancel(cctx, tenant, strings.TrimSpace(string(m.Data)))
			})
		}},
		{internalCancelSubject, "", func(m *nats.Msg) { w.held.cancel(string(m.Data)) }},
	}
	for _, h := range handlers {
		var (
			s   *nats.Subscription
			err error
		)
		if h.queue != "" {
			// A slow API server must not queue every other tenant's
			// status or cancel behind one: each is answered on its own,
			// up to apiConcurrency at once (then the subscription waits,
			// and the queue group sends work to the other workers).
			fn := h.fn
			s, err = w.nc.QueueSubscribe(h.subject, h.queue, func(m *nats.Msg) {
				w.apiSem <- struct{}{}
				go func() { defer func() { <-w.apiSem }(); fn(m) }()
			})
		} else {
			s, err = w.nc.Subscribe(h.subject, h.fn)
		}
		if err != nil {
			stop()
			return nil, err
		}
		subs = append(subs, s)
	}
	return stop, nil
}

// respond runs fn for the tenant of m's subject and sends its JSON reply
// — only to a reply subject a tenant's request can legitimately carry
// (replyAllowed); any other request is dropped unanswered and counted.
func (w *Worker) respond(ctx context.Context, m *nats.Msg, fn func(ctx context.Context, tenant string) any) {
	if m.Reply == "" {
		return
	}
	parts := strings.Split(m.Subject, ".")
	tenant := parts[len(parts)-1]
	if strings.HasPrefix(m.Subject, v1.CancelPrefix+".") {
		tenant = parts[2] // buildq.cancel.<tenant>.<name>
	}
	label := tenant
	if v1.DNSLabelProblem(tenant) != "" {
		label = "_invalid"
	}
	if !w.replyAllowed(label, m.Reply) {
		w.cfg.Metrics.replyRefused(label)
		w.log.Warn("tenant API request with a reply subject no tenant may name: not answered",
			zap.String("subject", m.Subject), zap.String("reply", truncate(m.Reply, 200)))
		return
	}
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	var reply any
	if p := v1.DNSLabelProblem(tenant); p != "" {
		reply = map[string]string{"error": "tenant " + p}
	} else {
		reply = fn(cctx, tenant)
	}
	b, _ := json.Marshal(reply)
	_ = m.Respond(b)
}

// ServiceReplyPrefix is the prefix nats-server gives the reply subject of
// a request that reached the BUILDQ account through a service import
// (a tenant account's status, cancel or request subject): the server
// routes a message on it back into the importing account only, and
// refuses it as the reply of any client's publish (a reserved reply).
const ServiceReplyPrefix = "_R_."

// replyAllowed reports whether the worker may answer a tenant API request
// of tenant on reply. NATS checks the subject a client publishes to, never
// the reply subject it names; a tenant inside the workers' account could
// otherwise have the worker write its answer on a bucket's $KV subject,
// another tenant's inbox or a JetStream API reply the worker waits on. So
// the worker answers only where a tenant's request can legitimately ask
// for an answer: a service import's reply (_R_., the account per tenant
// of deploy/nats) or the tenant's own inbox prefix (_INBOX_<tenant>.,
// which only that tenant may read), unless Config.AnyReply says every
// client of the server is trusted (buildq dev).
func (w *Worker) replyAllowed(tenant, reply string) bool {
	if w.cfg.AnyReply || mutant("reply-anywhere") {
		return true
	}
	if strings.ContainsAny(reply, "*> \t\r\n") {
		return false
	}
	if rest, ok := strings.CutPrefix(reply, ServiceReplyPrefix); ok {
		return rest != ""
	}
	if tenant == "_invalid" {
		return false
	}
	rest, ok := strings.CutPrefix(reply, v1.InboxPrefix(tenant)+".")
	return ok && rest != ""
}

// truncate shortens s to at most n bytes for a log line.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// status is what tenant may know of target: one of its request ids, or a
// build key.
func (w *Worker) status(ctx context.Context, tenant, target string) v1.StatusReply {
	if target == "" || len(target) > v1.MaxRequestIDLen {
		return v1.StatusReply{Error: "send a build key (64 hex digits) or a request id"}
	}
	rep := v1.StatusReply{Key: target}
	// A request id first: an id may look like a build key.
	le, err := w.ledgerGet(ctx, tenant, target)
	switch {
	case err != nil:
		return v1.StatusReply{Error: err.Error()}
	case le != nil:
		e := le.e
		e.RequeueToken = "" // the worker's secret: it authenticates a requeue
		rep.Request, rep.Key = &e, e.Key
	case !IsBuildKey(target):
		return v1.StatusReply{Error: fmt.Sprintf("no request %s of tenant %s is known (still queued, or older than the results' max age)", target, tenant)}
	}
	if rep.Key == "" {
		return rep
	}
	rec, _, err := w.claims.get(ctx, rep.Key)
	if err != nil {
		return v1.StatusReply{Error: err.Error()}
	}
	// A build is shown to the tenant whose request claimed it; another
	// tenant that joined sees its own request's state only.
	if rec != nil && rec.Tenant == tenant {
		rep.Build = rec
	}
	if rep.Request == nil && rep.Build == nil {
		return v1.StatusReply{Key: rep.Key, Error: fmt.Sprintf("no build of tenant %s is known for key %s", tenant, rep.Key)}
	}
	return rep
}

// cancel cancels tenant's requests: the one named, or all of the tenant's
// requests waiting on a build key. Each gets the result "canceled". The
// build itself is stopped — its run ended as Canceled and its Job deleted
// — only when no other request, of any tenant, still waits on it;
// otherwise it goes on for them (a canceled owner hands its run over).
func (w *Worker) cancel(ctx context.Context, tenant, target string) v1.CancelReply {
	if target == "" || len(target) > v1.MaxRequestIDLen {
		return v1.CancelReply{Message: "send a build key (64 hex digits) or a request id"}
	}
	var (
		key  string
		mine []*ledgerEntry
		// before: the key's waiters read before anything is canceled. A
		// canceled owner lets its run go, and a waiter requeued to take
		// it over is, for a moment, no waiter at all: read only after the
		// cancel, it would not be counted, and its build would be
		// stopped under it.
		before []*ledgerEntry
	)
	// A request id first: an id may look like a build key.
	byID, err := w.ledgerGet(ctx, tenant, target)
	if err != nil {
		return v1.CancelReply{Message: err.Error()}
	}
	if byID == nil && IsBuildKey(target) {
		key = target
		ws, err := w.waiters(ctx, key)
		if err != nil {
			return v1.CancelReply{Key: key, Message: err.Error()}
		}
		for _, le := range ws {
			if le.e.Tenant == tenant || mutant("cancel-other-tenants") {
				mine = append(mine, le)
			}
		}
		before = ws
	} else {
		le := byID
		switch {
		case le == nil:
			return v1.CancelReply{Message: fmt.Sprintf("no request %q of tenant %s is known", target, tenant)}
		case le.e.Result != nil:
			return v1.CancelReply{Key: le.e.Key, Message: "the request already has its result: " + le.e.State}
		}
		key, mine = le.e.Key, []*ledgerEntry{le}
		if before, err = w.waiters(ctx, key); err != nil {
			return v1.CancelReply{Key: key, Message: err.Error()}
		}
	}
	n := 0
	for _, le := range mine {
		ok, err := w.markCanceled(ctx, le)
		if err != nil {
			return v1.CancelReply{Key: key, Requests: n, Canceled: n > 0, Message: err.Error()}
		}
		if ok {
			n++
			_ = w.nc.Publish(internalCancelSubject, []byte(RequestIndexKey(le.e.Tenant, le.e.RequestID)))
		}
	}
	if n > 0 {
		// Parked requests have no handler to tell: answer them here.
		w.answerWaiters(ctx, key)
	}
	// Does anyone else still wait on the build?
	ws, err := w.waiters(ctx, key)
	if err != nil {
		return v1.CancelReply{Key: key, Requests: n, Canceled: n > 0, Message: err.Error()}
	}
	canceled := map[string]bool{}
	for _, le := range mine {
		canceled[RequestIndexKey(le.e.Tenant, le.e.RequestID)] = true
	}
	waiting := map[string]bool{}
	for _, le := range append(before, ws...) {
		if k := RequestIndexKey(le.e.Tenant, le.e.RequestID); !le.e.Canceled && !canceled[k] {
			waiting[k] = true
		}
	}
	others := len(waiting)
	if others > 0 {
		if n == 0 {
			return v1.CancelReply{Key: key, Message: fmt.Sprintf("no request of tenant %s waits on key %s", tenant, key)}
		}
		return v1.CancelReply{Key: key, Canceled: true, Requests: n,
			Message: fmt.Sprintf("canceled %d request(s); the build goes on for %d other request(s)", n, others)}
	}
	stopped, msg := w.stopBuild(ctx, tenant, key, n > 0)
	if n == 0 && !stopped {
		return v1.CancelReply{Key: key, Message: msg}
	}
	if stopped {
		msg = fmt.Sprintf("canceled %d request(s) and stopped the build", n)
	} else {
		msg = fmt.Sprintf("canceled %d request(s)", n)
	}
	return v1.CancelReply{Key: key, Canceled: true, Requests: n, Stopped: stopped, Message: msg}
}

// stopBuild ends key's current run as Canceled and deletes its Job, when
// the run is still building and tenant may stop it (it canceled requests
// waiting on it, or its own request claimed it).
func (w *Worker) stopBuild(ctx context.Context, tenant, key string, hadRequests bool) (bool, string) {
	for {
		cur, rev, err := w.claims.get(ctx, key)
		switch {
		case err != nil:
			return false, err.Error()
		case !hadRequests && (cur == nil || cur.Tenant != tenant):
			// One answer whether the key is unknown, built or building
			// for others: a cancel tells nothing of other tenants' builds.
			return false, fmt.Sprintf("no request of tenant %s waits on key %s", tenant, key)
		case cur == nil:
			return false, "no build is known for key " + key
		case cur.Final():
			return false, "the build already finished: " + cur.State
		}
		final := *cur
		final.State, final.Reason, final.Message = v1.StateFailed, v1.ReasonCanceled, "canceled on request"
		final.Owner, final.LeaseUntil, final.FinishedAt = "", time.Time{}, w.cfg.Now().UTC()
		final.Digest, final.LogTail = "", ""
		_, ok, err := w.claims.update(ctx, &final, rev)
		if err != nil {
			return false, err.Error()
		}
		if !ok {
			continue
		}
		// The owner notices at its next renewal; stop the build now so
		// nothing is pushed after the cancel.
		stop := func() error { return w.backend.Cleanup(ctx, key, cur.Run) }
		if jj, ok := w.backend.(jobJanitor); ok && mutant("cancel-by-name") {
			stop = func() error { return jj.DeleteJob(ctx, kaniko.JobName(key), "") }
		}
		if err := stop(); err != nil && !errors.Is(err, context.Canceled) {
			w.log.Warn("cancel: stopping the build failed", zap.String("key", key), zap.Error(err))
		}
		w.log.Info("build canceled", zap.String("key", key), zap.String("run", cur.Run))
		w.answerWaiters(ctx, key)
		return true, "stopped"
	}
}

// ledgerGet reads tenant's request id; nil when unknown.
func (w *Worker) ledgerGet(ctx context.Context, tenant, id string) (*ledgerEntry, error) {
	got, err := w.requests.Get(ctx, RequestIndexKey(tenant, id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("request ledger: %w", err)
	}
	var e v1.RequestEntry
	if err := json.Unmarshal(got.Value(), &e); err != nil {
		return nil, fmt.Errorf("request ledger: unreadable entry for %s: %w", id, err)
	}
	return &ledgerEntry{e: e, rev: got.Revision()}, nil
}

// markCanceled sets the Canceled mark of an undecided entry. ok is false
// when it was decided (or canceled) meanwhile.
func (w *Worker) markCanceled(ctx context.Context, le *ledgerEntry) (bool, error) {
	k := RequestIndexKey(le.e.Tenant, le.e.RequestID)
	for range 10 {
		if le.e.Result != nil || le.e.Canceled {
			return false, nil
		}
		e := le.e
		e.Canceled, e.UpdatedAt = true, w.cfg.Now().UTC()
		b, _ := json.Marshal(e)
		rev, err := w.requests.Update(ctx, k, b, le.rev)
		if err == nil {
			le.e, le.rev = e, rev
			return true, nil
		}
		if !isWrongRevision(err) {
			return false, fmt.Errorf("request ledger: %w", err)
		}
		cur, err := w.ledgerGet(ctx, le.e.Tenant, le.e.RequestID)
		if err != nil || cur == nil {
			return false, err
		}
		*le = *cur
	}
	return false, errors.New("request ledger: entry keeps changing")
}

// waiterKey is the ledger bucket key that says a request waits on a build
// key: "w.<build key>.<ledger key>", so a cancel lists a key's waiters
// with one filtered listing.
func waiterKey(key, tenant, id string) string {
	return "w." + key + "." + RequestIndexKey(tenant, id)
}

// waiterReg remembers whether a request was indexed as a waiter.
type waiterReg struct {
	once  sync.Once
	added bool
	// park, when set, lets the request park (park.go): the message it
	// came in, for the waiter entry, and its ledger entry.
	park *waiterValue
	le   *ledgerEntry
}

// add indexes the request as a waiter of key, once. A nil reg does
// nothing (the request is indexed already).
func (r *waiterReg) add(ctx context.Context, w *Worker, key, tenant, id string) {
	if r == nil {
		return
	}
	r.once.Do(func() {
		w.addWaiter(ctx, key, tenant, id)
		r.added = true
	})
}

// addWaiter records that a request waits on key (best effort: a cancel
// that misses it only stops a build one request still waited on, which
// then answers canceled through the build record).
func (w *Worker) addWaiter(ctx context.Context, key, tenant, id string) {
	b, _ := json.Marshal(waiterValue{Tenant: tenant, RequestID: id})
	if _, err := w.requests.Put(ctx, waiterKey(key, tenant, id), b); err != nil {
		w.log.Debug("waiter index: put failed", zap.String("key", key), zap.Error(err))
	}
}

func (w *Worker) dropWaiter(ctx context.Context, key, tenant, id string) {
	if err := w.requests.Delete(ctx, waiterKey(key, tenant, id)); err != nil {
		w.log.Debug("waiter index: delete failed", zap.String("key", key), zap.Error(err))
	}
}

// waiters returns the undecided ledger entries of the requests waiting on
// key, parked or held.
func (w *Worker) waiters(ctx context.Context, key string) ([]*ledgerEntry, error) {
	items, err := w.listWaiters(ctx, "w."+key+".*")
	if err != nil {
		return nil, err
	}
	var out []*ledgerEntry
	for _, it := range items[key] {
		le, err := w.ledgerGet(ctx, it.v.Tenant, it.v.RequestID)
		if err != nil {
			return nil, err
		}
		if le != nil && le.e.Result == nil {
			out = append(out, le)
		}
	}
	return out, nil
}
