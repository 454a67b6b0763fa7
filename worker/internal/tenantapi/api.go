// Package tenantapi is the tenant API service of a worker: status,
// cancel, logs and stored results as NATS request/reply services, so a
// tenant needs no access to the KV buckets or the streams, and sees and
// cancels only its own requests. The tenant is the subject's last token, which NATS
// permissions guard. It reads the request ledger and the build records,
// ends a canceled build's run, and tells the handlers of every worker
// when a request they hold was canceled.
package tenantapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// apiConcurrency bounds the status and cancel requests a worker answers at
// once.
const apiConcurrency = 32

// internalCancelSubject tells every worker that a held request was
// canceled (payload: its ledger key). Tenants must not publish on
// buildq.internal.>.
const internalCancelSubject = "buildq.internal.cancel"

// ErrCanceled ends a held request's handling: its tenant canceled it.
var ErrCanceled = errors.New("canceled on request")

// Config is what the service reads and acts with.
type Config struct {
	Ledger *ledger.Ledger
	Runs   *runs.Store
	NC     *nats.Conn
	Log    *zap.Logger
	Now    func() time.Time
	// AnyReply: every client of the server is trusted (buildq dev), so a
	// request is answered on any reply subject.
	AnyReply bool
	// StopBuild deletes the Job of the given run of key (the backend's
	// cleanup), once the cancel ended the run.
	StopBuild func(ctx context.Context, key, run string) error
	// AnswerParked answers the requests parked on key (the worker's
	// parking): a canceled parked request has no handler to tell.
	AnswerParked func(ctx context.Context, key string)
	// Publish publishes a result (the worker's publisher). A cancel
	// delivers each request's "canceled" itself and says canceled only
	// of those whose canceled result the stream stored: a finished
	// build's handler publishes its result before recording it, so a
	// cancel mark alone does not decide. Nil: the mark decides (the
	// handler, told of it, publishes "canceled").
	Publish func(ctx context.Context, d ledger.Decision) (ledger.Ack, error)
	// Results reads the results stream: the status of a request whose
	// entry holds no result marked stored shows the one the stream
	// stored, if any (a finished build's result is published before it
	// is recorded, and a decision recorded first may give way to it).
	// Nil: the entry alone.
	Results StoredResults
	// ReplyRefused counts a request left unanswered for its reply subject
	// (may be nil).
	ReplyRefused func(tenant string)
	// EndLog ends and archives the log of a run a cancel ended (its
	// final record); nil: nothing to do.
	EndLog func(ctx context.Context, final *v1.BuildRecord)
	// Logs reads runs' logs from BUILDQ_LOGS, Archive their archives (nil
	// Logs: build logs are off, and the logs service says so).
	Logs    *buildlog.Reader
	Archive buildlog.Archive
}

// StoredResults finds a request's stored result: among its subject's
// most recent ones, or all since the request (the worker's results
// stream reader).
type StoredResults interface {
	Recent(ctx context.Context, tenant, name, id string, since time.Time) (*v1.ResultData, error)
	Find(ctx context.Context, tenant, name, id string, since time.Time) (*v1.ResultData, error)
}

// scansPerTenant bounds each tenant's status requests reading the results
// stream at once, and scans all tenants'; past either, a status that
// needs such a read answers that it could not (errTooManyScans).
const (
	scansPerTenant = 2
	scans          = 8
)

// Service is a worker's tenant API.
type Service struct {
	cfg Config
	// held: the requests this worker's handlers hold, to cancel them.
	held heldRequests
	// sem bounds the requests answered at once (apiConcurrency), logsSem
	// the logs requests (logsConcurrency).
	sem     chan struct{}
	logsSem chan struct{}
	// polls: each tenant's logs requests waiting for lines; archives:
	// the last log archive read.
	polls pollCounts
	// reading: each tenant's stored-results requests in progress;
	// scanning: its status requests reading the results stream.
	reading  pollCounts
	scanning pollCounts
	archives archiveCache
}

// New returns the service; Serve starts it.
func New(cfg Config) *Service {
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.ReplyRefused == nil {
		cfg.ReplyRefused = func(string) {}
	}
	return &Service{cfg: cfg, held: heldRequests{m: map[string]*heldRequest{}}, sem: make(chan struct{}, apiConcurrency),
		reading:  pollCounts{perTenant: resultsPerTenant, max: apiConcurrency / 2},
		scanning: pollCounts{perTenant: scansPerTenant, max: scans},
		logsSem:  make(chan struct{}, logsConcurrency)}
}

// Hold registers the handling of the request with ledger key lk, so a
// cancel of it ends that handling (cancel's cause is ErrCanceled); the
// returned release forgets it.
func (w *Service) Hold(lk string, cancel context.CancelCauseFunc) (release func()) {
	return w.held.hold(lk, cancel)
}

// heldRequests maps the ledger key of each request this worker handles to
// the cancel of its handling.
type heldRequests struct {
	mu sync.Mutex
	m  map[string]*heldRequest
}

type heldRequest struct{ cancel context.CancelCauseFunc }

// hold registers cancel for lk, in place of any registered before; the
// returned release forgets this registration only, not a later one of the
// same key (intake's placeholder, then its handler's: worker/intakeopen.go).
func (h *heldRequests) hold(lk string, cancel context.CancelCauseFunc) func() {
	r := &heldRequest{cancel: cancel}
	h.mu.Lock()
	h.m[lk] = r
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		if h.m[lk] == r {
			delete(h.m, lk)
		}
		h.mu.Unlock()
	}
}

func (h *heldRequests) cancel(lk string) {
	h.mu.Lock()
	r := h.m[lk]
	h.mu.Unlock()
	if r != nil {
		r.cancel(ErrCanceled)
	}
}

// Serve subscribes the tenant API (queue group buildq-api: one worker
// answers each request), the legacy cancel subject, and the internal
// cancel notifications (every worker); the returned stop unsubscribes.
func (w *Service) Serve(ctx context.Context) (func(), error) {
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
		{v1.APILogsPrefix + ".*", "buildq-api", func(m *nats.Msg) {
			w.respond(ctx, m, func(cctx context.Context, tenant string) any {
				return w.logs(cctx, tenant, m.Data)
			})
		}},
		{v1.APIResultsPrefix + ".*", "buildq-api", func(m *nats.Msg) {
			w.respond(ctx, m, func(cctx context.Context, tenant string) any {
				return w.results(cctx, tenant, m.Data)
			})
		}},
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
			fn, sem := h.fn, w.sem
			if h.subject == v1.APILogsPrefix+".*" {
				// A follower's request waits for new lines: apart.
				sem = w.logsSem
			}
			s, err = w.cfg.NC.QueueSubscribe(h.subject, h.queue, func(m *nats.Msg) {
				sem <- struct{}{}
				go func() {
					defer func() { <-sem }()
					// A request that panics the service is a bug to fix,
					// never a way for a tenant to stop the worker.
					defer func() {
						if p := recover(); p != nil {
							w.cfg.Log.Error("tenant API request panicked", zap.String("subject", m.Subject), zap.Any("panic", p), zap.Stack("stack"))
						}
					}()
					fn(m)
				}()
			})
		} else {
			s, err = w.cfg.NC.Subscribe(h.subject, h.fn)
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
func (w *Service) respond(ctx context.Context, m *nats.Msg, fn func(ctx context.Context, tenant string) any) {
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
		w.cfg.ReplyRefused(label)
		w.cfg.Log.Warn("tenant API request with a reply subject no tenant may name: not answered",
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
func (w *Service) replyAllowed(tenant, reply string) bool {
	return ReplyAllowed(w.cfg.AnyReply, tenant, reply)
}

// ReplyAllowed is the rule of replyAllowed: whether a tenant API request
// of tenant may be answered on reply, with anyReply for a server whose
// clients are all trusted.
func ReplyAllowed(anyReply bool, tenant, reply string) bool {
	if anyReply || mutant.On("reply-anywhere") {
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
func (w *Service) status(ctx context.Context, tenant, target string) v1.StatusReply {
	if target == "" || len(target) > v1.MaxRequestIDLen {
		return v1.StatusReply{Error: "send a build key (64 hex digits) or a request id"}
	}
	rep := v1.StatusReply{Key: target}
	var rec keyRecord // the key's build record, read once
	// A request id first: an id may look like a build key.
	le, err := w.cfg.Ledger.Get(ctx, tenant, target)
	switch {
	case err != nil:
		return v1.StatusReply{Error: err.Error()}
	case le != nil:
		e := le.E
		e.RequeueToken = "" // the worker's secret: it authenticates a requeue
		if !e.Published && !e.Final {
			// A result not marked stored may not be the request's: a
			// finished build's result is published before it is
			// recorded, and a decision recorded first may give way to
			// one stored before it. The stored one is shown; a decision
			// recorded and not stored yet is not (the SDK's Wait asks
			// once, and takes a result shown as the request's).
			found, err := w.storedResult(ctx, &e, &rec)
			if err != nil {
				// The entry, and why it may not be the last word: the
				// SDK's Wait asks again.
				e.Result = nil
				return v1.StatusReply{Key: e.Key, Request: &e, Error: "reading the stored results: " + err.Error()}
			}
			switch {
			case found != nil:
				e.Result, e.Published = found, true
				e.State, e.Origin, e.Digest, e.Reason = string(found.Status), found.Origin, found.Digest, found.Reason
			case e.Result != nil:
				e.Result = nil // recorded, its publish on its way
			}
		}
		rep.Request, rep.Key = &e, e.Key
	case !v1.IsBuildKey(target):
		return v1.StatusReply{Error: fmt.Sprintf("no request %s of tenant %s is known (still queued, or older than the results' max age)", target, tenant)}
	}
	if rep.Key == "" {
		return rep
	}
	build, err := rec.get(ctx, w.cfg.Runs, rep.Key)
	if err != nil {
		return v1.StatusReply{Error: err.Error()}
	}
	// A build is shown to the tenant whose request claimed it; another
	// tenant that joined sees its own request's state only.
	if build != nil && build.Tenant == tenant {
		rep.Build = build
	}
	if rep.Request == nil && rep.Build == nil {
		return v1.StatusReply{Key: rep.Key, Error: fmt.Sprintf("no build of tenant %s is known for key %s", tenant, rep.Key)}
	}
	return rep
}

// storedResult is the result the stream stored for e's request, if any
// was found; nil without a results reader. An undecided entry's result,
// if stored, is among the newest (published first, recorded a moment
// later): Recent reads a bounded tail. A decision recorded and not marked
// is looked for from the request's time (Find): it may be an old one
// whose mark was lost. Past the tenant's share of reads at once
// (scansPerTenant, or the worker's) it fails at once: waiting for a turn
// would hold one of the worker's request slots (apiConcurrency), and a
// tenant's flood of such requests would then hold them all, ahead of
// every other tenant's. The SDK's Wait asks again later.
func (w *Service) storedResult(ctx context.Context, e *v1.RequestEntry, rec *keyRecord) (*v1.ResultData, error) {
	if w.cfg.Results == nil {
		return nil, nil
	}
	if !w.scanning.take(e.Tenant) {
		return nil, errTooManyScans
	}
	defer w.scanning.give(e.Tenant)
	if e.Result != nil {
		return w.cfg.Results.Find(ctx, e.Tenant, e.Name, e.RequestID, e.MsgTime)
	}
	found, err := w.cfg.Results.Recent(ctx, e.Tenant, e.Name, e.RequestID, e.MsgTime)
	if err != nil || found != nil || !w.endedAWhileAgo(ctx, rec, e.Key) {
		return found, err
	}
	// The key's run ended a while ago and the entry is still undecided: a
	// result published first whose record failed for good (its last
	// delivery's) may be older than Recent reaches. Rare, and bounded by
	// the same share of reads.
	return w.cfg.Results.Find(ctx, e.Tenant, e.Name, e.RequestID, e.MsgTime)
}

// endedLongAgo is how long after a run's end an undecided entry of its key
// is looked for in full: its result, if published, is recorded within
// moments of the end.
const endedLongAgo = 10 * time.Second

// endedAWhileAgo reports whether key's build record is a finished build's,
// finished over endedLongAgo ago.
func (w *Service) endedAWhileAgo(ctx context.Context, kr *keyRecord, key string) bool {
	if key == "" {
		return false
	}
	rec, err := kr.get(ctx, w.cfg.Runs, key)
	return err == nil && rec != nil && rec.Final() && !rec.FinishedAt.IsZero() && w.cfg.Now().Sub(rec.FinishedAt) > endedLongAgo
}

// keyRecord is a key's build record, read at most once for one answer:
// status reads it to look further for a stored result and to show it.
type keyRecord struct {
	key  string
	read bool
	rec  *v1.BuildRecord
	err  error
}

func (k *keyRecord) get(ctx context.Context, runs *runs.Store, key string) (*v1.BuildRecord, error) {
	if !k.read || k.key != key {
		k.rec, _, k.err = runs.Get(ctx, key)
		k.key, k.read = key, true
	}
	return k.rec, k.err
}

// errTooManyScans answers a status request past its tenant's share of
// reads of the results stream.
var errTooManyScans = errors.New("too many status requests of this tenant read the results at once; try again")
