// Package publisher is buildq's producer SDK: it publishes build requests
// onto the BUILDQ_REQUESTS stream and waits for, or watches, their results.
//
// It depends on NATS and the wire types only; importing it does not pull
// Kubernetes or the worker into a program's build.
//
// # Tenant permissions
//
// Publish, Wait, Follow and Events work for a tenant's NATS user in the
// shipped setup (deploy/nats: an account per tenant, which imports its
// request subject and services from the workers' account, and its results
// and events): publish on buildq.requests.<tenant> and
// buildq.api.status.<tenant>, subscribe to buildq.results.<tenant>.>,
// buildq.events.<tenant>.> and its inboxes. The JetStream PubAck of a
// request comes back on the connection's inbox; the tenant API's answers
// (TenantRequest) on a reply under the tenant's own prefix,
// "_INBOX_<tenant>", the only kind a worker answers besides a service
// import's. So a tenant connects with no special option:
//
//	nc, err := nats.Connect(url, nats.UserCredentials("acme.creds")) // or nats.Nkey…
//
// Watch replays the BUILDQ_RESULTS stream through the JetStream API; it is
// for operators, whose users may read the stream. A tenant's Follow fills
// the gap of a reconnection through its stored-results service
// (buildq.api.results.<tenant>) instead.
package publisher

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	v1 "github.com/buildq/buildq/api/v1"
)

// Client publishes requests and reads results. It is safe for concurrent use.
type Client struct {
	nc *nats.Conn
	js jetstream.JetStream
	// secret makes each request's Nats-Msg-Id unpredictable to others but
	// stable across this client's retries of one request.
	secret [16]byte
}

// New returns a client on an established NATS connection.
func New(nc *nats.Conn) (*Client, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	c := &Client{nc: nc, js: js}
	if _, err := rand.Read(c.secret[:]); err != nil {
		return nil, fmt.Errorf("publisher: random: %w", err)
	}
	return c, nil
}

// msgID is the request's Nats-Msg-Id: v1.RequestMsgID with a nonce derived
// from the client's secret. JetStream dedupes on the header stream-wide
// and NATS permissions do not cover headers: a header another tenant could
// predict, it could publish first, and JetStream would drop this request.
func (c *Client) msgID(tenant, requestID string) string {
	m := hmac.New(sha256.New, c.secret[:])
	m.Write([]byte(tenant + "/" + requestID))
	return v1.RequestMsgID(tenant, requestID, hex.EncodeToString(m.Sum(nil))[:20])
}

// InboxPrefix is tenant's own reply-subject prefix, "_INBOX_<tenant>"
// (v1.InboxPrefix). The client sends the tenant API's requests with
// replies under it whatever the connection's own inbox prefix; passing it
// to nats.CustomInboxPrefix is still accepted.
func InboxPrefix(tenant string) string { return v1.InboxPrefix(tenant) }

// NewRequestID returns a fresh, unique request id.
func NewRequestID() string { return nuid.Next() }

// ErrNoWorkers is returned when the requests stream does not exist: no
// worker has ever started against this NATS server.
var ErrNoWorkers = errors.New("no buildq stream on this NATS server: start a worker (buildq worker, or buildq dev) first")

// Publish validates req and publishes it on buildq.requests.<tenant> with
// Nats-Msg-Id = "<tenant>/<requestId>/<nonce>" (v1.RequestMsgID). APIVersion and RequestID are filled in when
// empty. Publishing the same request again within the duplicate window
// stores it once (the returned PubAck has Duplicate set).
func (c *Client) Publish(ctx context.Context, req *v1.Request) (*jetstream.PubAck, error) {
	if req.APIVersion == "" {
		req.APIVersion = v1.APIVersion
	}
	if req.RequestID == "" {
		req.RequestID = NewRequestID()
	}
	if req.SubmittedAt.IsZero() {
		req.SubmittedAt = time.Now().UTC()
	}
	if err := req.Validate(); err != nil {
		return nil, err
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode request: %w", err)
	}
	m := nats.NewMsg(v1.RequestSubject(req.Tenant))
	m.Header.Set(v1.MsgIDHeader, c.msgID(req.Tenant, req.RequestID))
	m.Header.Set("Content-Type", "application/json")
	m.Data = b
	ack, err := c.js.PublishMsg(ctx, m)
	if errors.Is(err, jetstream.ErrNoStreamResponse) {
		return nil, ErrNoWorkers
	}
	if err != nil {
		return nil, fmt.Errorf("publish request %s: %w", req.RequestID, err)
	}
	return ack, nil
}

// Filter selects result events. Empty Tenant or Name match all; RequestID,
// when set, keeps only that request's result.
type Filter struct {
	Tenant    string
	Name      string
	RequestID string
	// Since replays stored results from that time on; zero means only new
	// results. DeliverAll replays everything stored.
	Since      time.Time
	DeliverAll bool
}

// Validate checks the tenant and name of a filter.
func (f Filter) Validate() error {
	_, err := f.subject()
	return err
}

func (f Filter) subject() (string, error) {
	t, n := f.Tenant, f.Name
	if t == "" {
		t = "*"
	} else if msg := v1.DNSLabelProblem(t); msg != "" {
		return "", fmt.Errorf("tenant %s", msg)
	}
	if n == "" {
		n = "*"
	} else if msg := v1.DNSLabelProblem(n); msg != "" {
		return "", fmt.Errorf("name %s", msg)
	}
	return v1.ResultsPrefix + "." + t + "." + n, nil
}

// Watch calls fn for every result that matches f, in stream order, until
// ctx ends or fn returns an error (which Watch returns; return ErrStop to
// end without error). It reads BUILDQ_RESULTS with an ordered consumer
// (an operator's user: tenants may not read the stream) and resumes it
// from the stream sequence after the last result it delivered whenever
// it breaks (a NATS restart, a lost server) or stays quiet, so nothing is
// missed or delivered twice; errors before the first consumer existed
// (no stream, no permission) end it.
func (c *Client) Watch(ctx context.Context, f Filter, fn func(v1.Result) error) error {
	subj, err := f.subject()
	if err != nil {
		return err
	}
	began := time.Now()
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{subj}, DeliverPolicy: jetstream.DeliverNewPolicy}
	switch {
	case f.DeliverAll:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	case !f.Since.IsZero():
		since := f.Since
		cfg.DeliverPolicy = jetstream.DeliverByStartTimePolicy
		cfg.OptStartTime = &since
	}
	w := &follower{f: f, fn: fn, seen: newSeenSet(seenCap)}
	started := false
	backoff := 250 * time.Millisecond
	for {
		ok, last, err := c.watchOnce(ctx, cfg, w)
		started = started || ok
		var fnErr fnError
		switch {
		case errors.As(err, &fnErr):
			if errors.Is(fnErr.err, ErrStop) {
				return nil
			}
			return fnErr.err
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil && !started:
			return err
		case err != nil:
			// Broken (a restart, a lost server): again from where this
			// watch is, after a pause.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 5*time.Second)
		default:
			backoff = 250 * time.Millisecond
		}
		// Quiet for a while, or broken: the ordered consumer (one replica
		// on one server) may sit on a server that went away. Recreate it
		// from where this watch is, level-triggered, rather than trust it.
		switch {
		case last > 0:
			cfg.DeliverPolicy, cfg.OptStartSeq, cfg.OptStartTime = jetstream.DeliverByStartSequencePolicy, last+1, nil
		case cfg.DeliverPolicy == jetstream.DeliverNewPolicy:
			t := began
			cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &t
		}
	}
}

// watchIdle is how long Watch waits for a result before it recreates its
// consumer.
const watchIdle = 15 * time.Second

// watchOnce delivers results through one ordered consumer until it has
// been quiet for watchIdle (then err is nil) or fn (a fnError), ctx or
// the consumer ends the watch. ok reports that the consumer was made;
// last is the stream sequence of the last result delivered (0: none).
func (c *Client) watchOnce(ctx context.Context, cfg jetstream.OrderedConsumerConfig, w *follower) (ok bool, last uint64, err error) {
	last = cfg.OptStartSeq
	if last > 0 {
		last--
	}
	cons, err := c.js.OrderedConsumer(ctx, v1.ResultsStream, cfg)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, last, ErrNoWorkers
	}
	if err != nil {
		return false, last, fmt.Errorf("watch results: %w", err)
	}
	// Short pulls with frequent heartbeats, so a consumer whose server is
	// gone is noticed in seconds.
	it, err := cons.Messages(jetstream.PullExpiry(5*time.Second), jetstream.PullHeartbeat(time.Second))
	if err != nil {
		return false, last, fmt.Errorf("watch results: %w", err)
	}
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	defer it.Stop()
	for {
		msg, err := it.Next(jetstream.NextMaxWait(watchIdle))
		if err != nil {
			switch {
			case ctx.Err() != nil:
				return true, last, ctx.Err()
			case errors.Is(err, nats.ErrTimeout):
				return true, last, nil
			case errors.Is(err, jetstream.ErrMsgIteratorClosed):
				return true, last, ctx.Err()
			}
			return true, last, fmt.Errorf("watch results: %w", err)
		}
		var seq uint64
		if meta, err := msg.Metadata(); err == nil {
			seq = meta.Sequence.Stream
			last = seq
		}
		if _, err := w.deliver(seq, msg.Data()); err != nil {
			return true, last, fnError{err}
		}
	}
}

// ErrStop ends Watch without error.
var ErrStop = errors.New("stop watching")

// Wait returns the result of one request. It needs no JetStream access:
// it subscribes (core NATS) to the request's result subject,
// buildq.results.<tenant>.<name>, and keeps the result whose id is
// requestID; a result published before that subscription existed is
// found by asking the status service (buildq.api.status.<tenant>), which
// answers with the request's decided result. While it shows none, Wait
// asks again now and then (after 5 s, doubling up to a minute): a result
// can reach the ledger after its publish (published first, recorded
// later), and a core subscription misses what is published while its
// connection reconnects. So a tenant's NATS user
// needs only to subscribe to its results and its inbox, and to publish on
// its status subject (see deploy/nats/).
//
// since is no longer used (the stream is not replayed); it is kept so that
// existing callers compile. An empty name waits on every name of the
// tenant.
func (c *Client) Wait(ctx context.Context, tenant, name, requestID string, since time.Time) (*v1.Result, error) {
	_ = since
	if tenant == "" {
		return nil, errors.New("wait: the tenant is required")
	}
	if requestID == "" {
		return nil, errors.New("wait: the request id is required")
	}
	subj, err := Filter{Tenant: tenant, Name: name}.subject()
	if err != nil {
		return nil, err
	}
	found := make(chan *v1.Result, 1)
	offer := func(r *v1.Result) {
		select {
		case found <- r:
		default:
		}
	}
	sub, err := c.nc.Subscribe(subj, func(m *nats.Msg) {
		var r v1.Result
		if json.Unmarshal(m.Data, &r) == nil && r.ID == requestID {
			offer(&r)
		}
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", subj, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	// The server has the subscription once the flush returns: every
	// result published from now on reaches it.
	if err := c.flush(ctx); err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", subj, err)
	}
	if err := c.permissionError("Subscription to", subj); err != nil {
		return nil, err
	}

	// A result decided before the subscription: ask the status service.
	// The asking stops when Wait returns, however it returns: an answer
	// it no longer needs is not waited for, and Wait returns only once
	// the asking has stopped, so nothing is sent for a Wait that
	// returned (an ask handed to the connection just before may still
	// be on its way out).
	pctx, stop := context.WithCancel(ctx)
	polled := make(chan struct{})
	defer func() {
		stop()
		<-polled
	}()
	go func() {
		defer close(polled)
		unanswered, undecided := time.Second, waitPollFirst
		for pctx.Err() == nil {
			if waitAsking != nil {
				waitAsking()
			}
			r, answered := c.decided(pctx, tenant, requestID)
			if r != nil {
				offer(r)
				return
			}
			if c.permissionError("Publish to", v1.APIStatusSubject(tenant)) != nil {
				return // the subscription alone
			}
			// No worker answered (none running yet, or all busy): ask
			// again soon. Answered, undecided: the subscription is the
			// way the result comes, and asking again now and then finds
			// one it missed (published during a reconnect) or one the
			// status service could not show yet (stored first, recorded
			// later).
			wait, limit := &unanswered, 30*time.Second
			if answered {
				wait, limit = &undecided, waitPollMax
			}
			select {
			case <-pctx.Done():
				return
			case <-time.After(*wait):
			}
			*wait = min(2*(*wait), limit)
		}
	}()
	select {
	case r := <-found:
		return r, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// How often Wait asks the status service again while it shows the
// request undecided: after waitPollFirst, doubling up to waitPollMax.
const waitPollFirst, waitPollMax = 5 * time.Second, time.Minute

// waitAsking, set by tests only, runs before each of Wait's asks;
// tenantRequestSending right before TenantRequest publishes.
var waitAsking, tenantRequestSending func()

// decided asks tenant's status service for requestID. answered is false
// when no worker answered; the result is nil while undecided (or unknown).
func (c *Client) decided(ctx context.Context, tenant, requestID string) (*v1.Result, bool) {
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	msg, err := c.TenantRequest(rctx, tenant, v1.APIStatusSubject(tenant), []byte(requestID))
	if err != nil {
		return nil, false
	}
	var rep v1.StatusReply
	if json.Unmarshal(msg.Data, &rep) != nil {
		return nil, true
	}
	if rep.Request != nil && rep.Error != "" {
		return nil, false // the service failed to read it: ask again
	}
	// The status service shows a result only once it is the request's
	// (a decision recorded and not yet stored may give way to one stored
	// before it).
	e := rep.Request
	if e == nil || e.Result == nil || e.RequestID != requestID || e.Result.RequestID != requestID {
		return nil, true
	}
	at := e.Result.Timings.FinishedAt
	if at.IsZero() {
		at = e.UpdatedAt
	}
	source := "/buildq/api/status"
	if e.Worker != "" {
		source = "/buildq/worker/" + e.Worker
	}
	r := v1.NewResult(source, *e.Result, at)
	return &r, true
}

// TenantRequest sends a request to one of tenant's API subjects
// (v1.APIStatusSubject, v1.APICancelSubject) and returns the answer. The
// reply subject is under the tenant's own inbox prefix (v1.InboxPrefix),
// whatever the connection's: a worker answers tenant API requests only on
// such a reply, or on the reply a service import gives (the account per
// tenant of deploy/nats), never on a subject of someone else's. When no
// worker subscribes it returns an error matching ErrNoWorkers.
func (c *Client) TenantRequest(ctx context.Context, tenant, subject string, payload []byte) (*nats.Msg, error) {
	if p := v1.DNSLabelProblem(tenant); p != "" {
		return nil, fmt.Errorf("tenant %s", p)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
	}
	inbox := v1.InboxPrefix(tenant) + "." + nuid.Next()
	sub, err := c.nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", inbox, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := sub.AutoUnsubscribe(1); err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", inbox, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, err // given up already: nothing is sent
	}
	if tenantRequestSending != nil {
		tenantRequestSending()
	}
	if err := c.nc.PublishRequest(subject, inbox, payload); err != nil {
		return nil, fmt.Errorf("%s: %w", subject, err)
	}
	msg, err := sub.NextMsgWithContext(ctx)
	if err != nil {
		if perr := c.permissionError("Subscription to", inbox); perr != nil {
			return nil, perr
		}
		if perr := c.permissionError("Publish to", subject); perr != nil {
			return nil, perr
		}
		return nil, fmt.Errorf("%s: %w", subject, err)
	}
	// The server's "no responders" status: nobody subscribes.
	if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
		return nil, fmt.Errorf("no worker answers %s: %w", subject, ErrNoWorkers)
	}
	return msg, nil
}

// flush waits until the server has processed everything sent so far
// (a context without a deadline gets one: FlushWithContext needs it).
func (c *Client) flush(ctx context.Context) error {
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return c.nc.FlushWithContext(fctx)
}

// permissionError returns the server's refusal of op ("Subscription to",
// "Publish to") on subject, when it is the connection's last error.
func (c *Client) permissionError(op, subject string) error {
	err := c.nc.LastError()
	if err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), op+" \""+subject+"\"") {
		return fmt.Errorf("%w: this NATS user may not use %s (a tenant's user needs its own subjects, see deploy/nats)", err, subject)
	}
	return nil
}

// Events calls fn for each progress event of tenant/name (core NATS, not
// stored: only events published after the call are seen) until ctx ends.
func (c *Client) Events(ctx context.Context, tenant, name string, fn func(v1.Event)) error {
	sub, err := c.nc.Subscribe(v1.EventSubject(tenant, name), func(m *nats.Msg) {
		var e v1.Event
		if json.Unmarshal(m.Data, &e) == nil {
			fn(e)
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe to events: %w", err)
	}
	<-ctx.Done()
	_ = sub.Unsubscribe()
	return nil
}
