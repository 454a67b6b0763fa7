package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// ErrResultsLost says that results published while a Follow was
// disconnected may be missing for good: the stream no longer holds them
// (they aged out, MaxAge), or they could not be read.
var ErrResultsLost = errors.New("results published while disconnected may be missing")

// Gap is what Follow reports after each reconnection: where it resumed
// from and how many results it had missed.
type Gap struct {
	// AfterSeq is the stream sequence of the last result seen before the
	// connection broke (0: none seen; then Since, when the Follow began).
	AfterSeq uint64
	Since    time.Time
	// Replayed counts the results fetched for the gap that Follow had not
	// delivered yet (they were, in order, before this report).
	Replayed int
	// Err is nil when the gap is filled; otherwise it matches
	// ErrResultsLost and says why.
	Err error
}

// FollowOption configures Follow.
type FollowOption func(*followOptions) error

type followOptions struct {
	onGap    func(Gap)
	patience time.Duration
}

// OnGap has Follow call fn after each reconnection, once the results
// published meanwhile are delivered (or could not be). Default: nothing.
func OnGap(fn func(Gap)) FollowOption {
	return func(o *followOptions) error {
		if fn == nil {
			return errors.New("OnGap: nil function")
		}
		o.onGap = fn
		return nil
	}
}

// GapPatience is how long Follow keeps asking for the results it missed
// when no worker answers yet (they reconnect too). Default 2 minutes.
func GapPatience(d time.Duration) FollowOption {
	return func(o *followOptions) error {
		if d <= 0 {
			return fmt.Errorf("GapPatience: %v is not positive", d)
		}
		o.patience = d
		return nil
	}
}

// seenCap bounds the request ids Follow remembers to deliver each result
// once.
const seenCap = 16384

// seenSet remembers the last seenCap keys added.
type seenSet struct {
	m    map[string]struct{}
	ring []string
	next int
}

func newSeenSet(n int) *seenSet {
	return &seenSet{m: make(map[string]struct{}, n), ring: make([]string, n)}
}

// add reports whether key is new, and remembers it.
func (s *seenSet) add(key string) bool {
	if _, ok := s.m[key]; ok {
		return false
	}
	if old := s.ring[s.next]; old != "" {
		delete(s.m, old)
	}
	s.ring[s.next] = key
	s.next = (s.next + 1) % len(s.ring)
	s.m[key] = struct{}{}
	return true
}

// follower is one Follow's state: the last stream sequence seen and the
// results delivered.
type follower struct {
	f    Filter
	fn   func(v1.Result) error
	last uint64
	seen *seenSet
}

// deliver hands the result in data (stored at stream sequence seq, 0:
// unknown) to fn, unless it was delivered before or does not match.
// delivered reports whether fn got it.
func (w *follower) deliver(seq uint64, data []byte) (delivered bool, err error) {
	w.last = max(w.last, seq)
	r, ok := decodeResult(data)
	if !ok {
		return false, nil // not ours to judge; skip what we cannot read
	}
	if w.f.RequestID != "" && r.ID != w.f.RequestID {
		return false, nil
	}
	// The filter holds for a replayed result as for a live one (which
	// its subject filtered): the stored-results service's answer is
	// checked, not trusted, to be of the filter's tenant and name.
	if (w.f.Tenant != "" && r.Data.Tenant != w.f.Tenant) || (w.f.Name != "" && r.Data.Name != w.f.Name) {
		return false, nil
	}
	// Request ids are per tenant.
	if !w.seen.add(r.Data.Tenant + "/" + r.ID) {
		return false, nil
	}
	return true, w.fn(r)
}

// decodeResult reads a result event; ok is false for anything else.
func decodeResult(data []byte) (r v1.Result, ok bool) {
	return r, json.Unmarshal(data, &r) == nil
}

// Follow calls fn for every result that matches f as it is published, on
// a core NATS subscription (no JetStream access needed: a tenant's NATS
// user may follow its own results), until ctx ends or fn returns an error
// (which Follow returns; return ErrStop to end without error). Since and
// DeliverAll are not supported: replaying stored results is Watch's.
//
// Follow misses nothing across a reconnection: each result carries its
// stream sequence (the stream republishes it with Nats-Sequence), and
// once the connection is back Follow fetches the results stored after
// the last one it saw — through the tenant's stored-results service
// (buildq.api.results.<tenant>) when f names a tenant, otherwise from
// the BUILDQ_RESULTS stream (an operator's user) — and delivers those it
// had not. Each result is delivered once (by request id), whether it
// came live, in a replay, or was published twice. OnGap tells of each
// reconnection; a gap that cannot be filled (the results aged out) is
// reported there with ErrResultsLost, and Follow goes on.
//
// Keep the connection reconnecting (nats.MaxReconnects(-1)) for a Follow
// meant to outlive a server restart: a closed connection ends it.
func (c *Client) Follow(ctx context.Context, f Filter, fn func(v1.Result) error, opts ...FollowOption) error {
	if f.DeliverAll || !f.Since.IsZero() {
		return errors.New("follow: replaying stored results needs Watch")
	}
	o := followOptions{onGap: func(Gap) {}, patience: 2 * time.Minute}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return err
		}
	}
	subj, err := f.subject()
	if err != nil {
		return err
	}
	began := time.Now()
	sub, err := c.nc.SubscribeSync(subj)
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", subj, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := c.flush(ctx); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("subscribe to %s: %w", subj, err)
	}
	if err := c.permissionError("Subscription to", subj); err != nil {
		return err
	}
	status := c.nc.StatusChanged(nats.CONNECTED, nats.RECONNECTING, nats.DISCONNECTED, nats.CLOSED)
	defer c.nc.RemoveStatusListener(status)

	// The subscription's messages wait in its own pending queue (not a
	// channel that drops) while a gap is filled.
	pctx, stopPump := context.WithCancel(ctx)
	defer stopPump()
	live := make(chan *nats.Msg)
	pumpDone := make(chan error, 1)
	go func() {
		for {
			m, err := sub.NextMsgWithContext(pctx)
			if err != nil {
				pumpDone <- err
				return
			}
			select {
			case live <- m:
			case <-pctx.Done():
				pumpDone <- pctx.Err()
				return
			}
		}
	}()

	w := &follower{f: f, fn: fn, seen: newSeenSet(seenCap)}
	end := func(err error) error {
		if errors.Is(err, ErrStop) {
			return nil
		}
		return err
	}
	var (
		down bool
		mark Gap // where a replay starts, taken when the connection broke
	)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-pumpDone:
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("follow %s: %w", subj, err)
		case st := <-status:
			switch st {
			case nats.CLOSED:
				return fmt.Errorf("follow %s: %w", subj, nats.ErrConnectionClosed)
			case nats.CONNECTED:
				if !down {
					continue
				}
				down = false
				// CONNECTED comes before the client has sent its
				// subscriptions again; a flush returns once the server
				// has them, so everything stored from now on comes live.
				if err := c.flush(ctx); err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					down = true // broken again: a later CONNECTED retries
					continue
				}
				g, err := c.fillGap(ctx, w, subj, mark, o.patience)
				if err != nil {
					return end(err)
				}
				o.onGap(g)
			default:
				if !down {
					down = true
					mark = Gap{AfterSeq: w.last}
					if w.last == 0 {
						mark.Since = began
					}
				}
			}
		case m := <-live:
			seq, _ := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
			if _, err := w.deliver(seq, m.Data); err != nil {
				return end(err)
			}
		}
	}
}

// fillGap delivers the results stored after mark that w has not. Only
// fn's error is returned; a gap that could not be filled is the Gap's
// Err.
func (c *Client) fillGap(ctx context.Context, w *follower, subj string, mark Gap, patience time.Duration) (Gap, error) {
	g := mark
	var err error
	if w.f.Tenant != "" {
		err = c.replayService(ctx, w, mark, patience, &g)
	} else {
		err = c.replayStream(ctx, w, subj, mark, &g)
	}
	var fnErr fnError
	if errors.As(err, &fnErr) {
		return g, fnErr.err
	}
	if err != nil && ctx.Err() != nil {
		return g, ctx.Err()
	}
	if err != nil && !errors.Is(err, ErrResultsLost) {
		err = fmt.Errorf("%w: %w", ErrResultsLost, err)
	}
	g.Err = err
	return g, nil
}

// fnError carries the error of the caller's function through a replay.
type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }

// replayService reads the gap from the tenant's stored-results service,
// asking again while no worker answers (up to patience).
func (c *Client) replayService(ctx context.Context, w *follower, mark Gap, patience time.Duration, g *Gap) error {
	req := v1.ResultsRequest{Name: w.f.Name, AfterSeq: mark.AfterSeq, Since: mark.Since}
	giveUp := time.Now().Add(patience)
	backoff := 250 * time.Millisecond
	var lost error
	for {
		rep, err := c.StoredResults(ctx, w.f.Tenant, req)
		if err != nil {
			if ctx.Err() != nil || c.permissionError("Publish to", v1.APIResultsSubject(w.f.Tenant)) != nil || time.Now().After(giveUp) {
				return errors.Join(lost, fmt.Errorf("read the stored results: %w", err))
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 5*time.Second)
			continue
		}
		if rep.Truncated && lost == nil {
			lost = fmt.Errorf("%w: the stream now begins at sequence %d, after the last result seen (%d); the results between aged out", ErrResultsLost, rep.FirstSeq, mark.AfterSeq)
			if mark.AfterSeq == 0 {
				lost = fmt.Errorf("%w: results stored since %s have aged out", ErrResultsLost, mark.Since.Format(time.RFC3339))
			}
		}
		for _, s := range rep.Results {
			ok, err := w.deliver(s.Seq, s.Event)
			if err != nil {
				return fnError{err}
			}
			if ok {
				g.Replayed++
			}
		}
		w.last = max(w.last, rep.Next)
		if !rep.More {
			return lost
		}
		if rep.Next <= req.AfterSeq {
			// More, but from where it was asked again: asking once more
			// would get the same page, forever.
			return errors.Join(lost, fmt.Errorf("the stored-results service says there is more after sequence %d but does not move on from %d", rep.Next, req.AfterSeq))
		}
		req = v1.ResultsRequest{Name: w.f.Name, AfterSeq: rep.Next}
	}
}

// replayStream reads the gap from BUILDQ_RESULTS with an ordered
// consumer (an operator's user).
func (c *Client) replayStream(ctx context.Context, w *follower, subj string, mark Gap, g *Gap) error {
	s, err := c.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		return fmt.Errorf("read %s: %w", v1.ResultsStream, err)
	}
	var lost error
	first := s.CachedInfo().State.FirstSeq
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{subj}}
	if mark.AfterSeq > 0 {
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, mark.AfterSeq+1
		if mark.AfterSeq+1 < first {
			lost = fmt.Errorf("%w: the stream now begins at sequence %d, after the last result seen (%d); the results between aged out", ErrResultsLost, first, mark.AfterSeq)
		}
	} else {
		since := mark.Since
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &since
		if first > 1 {
			if m, err := s.GetMsg(ctx, first); err == nil && m.Time.After(since) {
				lost = fmt.Errorf("%w: results stored since %s have aged out", ErrResultsLost, since.Format(time.RFC3339))
			}
		}
	}
	cons, err := c.js.OrderedConsumer(ctx, v1.ResultsStream, cfg)
	if err != nil {
		return errors.Join(lost, fmt.Errorf("read %s: %w", v1.ResultsStream, err))
	}
	for {
		batch, err := cons.Fetch(v1.MaxResultsPage, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return errors.Join(lost, fmt.Errorf("read %s: %w", v1.ResultsStream, err))
		}
		n, pending := 0, uint64(0)
		for m := range batch.Messages() {
			n++
			var seq uint64
			if meta, err := m.Metadata(); err == nil {
				seq, pending = meta.Sequence.Stream, meta.NumPending
			}
			ok, err := w.deliver(seq, m.Data())
			if err != nil {
				return fnError{err}
			}
			if ok {
				g.Replayed++
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return errors.Join(lost, fmt.Errorf("read %s: %w", v1.ResultsStream, err))
		}
		if n == 0 || pending == 0 {
			return lost
		}
	}
}

// StoredResults asks tenant's stored-results service
// (buildq.api.results.<tenant>) for one page of the tenant's results
// stored after req.AfterSeq (or since req.Since). It needs no JetStream
// access: a tenant's NATS user may ask its own (deploy/nats).
func (c *Client) StoredResults(ctx context.Context, tenant string, req v1.ResultsRequest) (*v1.ResultsReply, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	msg, err := c.TenantRequest(ctx, tenant, v1.APIResultsSubject(tenant), b)
	if err != nil {
		return nil, err
	}
	var rep v1.ResultsReply
	if err := json.Unmarshal(msg.Data, &rep); err != nil {
		return nil, fmt.Errorf("unreadable reply on %s: %w", v1.APIResultsSubject(tenant), err)
	}
	if rep.Error != "" {
		return nil, fmt.Errorf("%s: %s", v1.APIResultsSubject(tenant), rep.Error)
	}
	return &rep, nil
}
