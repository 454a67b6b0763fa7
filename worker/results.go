package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// storedResults reads BUILDQ_RESULTS for the ledger (ledger.Results): the
// first result stored under a request's message id is its decision, and
// a publisher answered as a duplicate, or one whose request is old
// enough that a result published first may have left the duplicate
// window, reads what was stored.
type storedResults struct {
	js jetstream.JetStream
	// attempt bounds each JetStream API request of a look (0: apiAttempt).
	attempt time.Duration
}

// apiAttempt bounds one JetStream request on a decision's path: a look
// for a stored result, a result's publish. A request in flight when the
// connection to its server drops is never answered (the client does not
// fail it; it waits out its context), so a look or a publish whose
// context allows 15 s would hang that long after a NATS restart, and the
// request's decision with it. Each request of a look is a read and is
// sent again when its attempt runs out, while the look's context allows;
// a publish that runs out fails (handle.go, publish). 5 s is the
// jetstream package's own bound for a request without a deadline; a
// JetStream request on a sound connection is answered in milliseconds.
const apiAttempt = 5 * time.Second

// retry runs one API request f with the attempt's bound, again while the
// attempt ran out and ctx did not.
func retry[T any](ctx context.Context, attempt time.Duration, f func(context.Context) (T, error)) (T, error) {
	if attempt <= 0 {
		attempt = apiAttempt
	}
	for {
		actx, cancel := context.WithTimeout(ctx, attempt)
		v, err := f(actx)
		cancel()
		if err == nil || ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return v, err
		}
	}
}

// stream is BUILDQ_RESULTS' handle.
func (r storedResults) stream(ctx context.Context) (jetstream.Stream, error) {
	st, err := retry(ctx, r.attempt, func(ctx context.Context) (jetstream.Stream, error) {
		return r.js.Stream(ctx, v1.ResultsStream)
	})
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", v1.ResultsStream, err)
	}
	return st, nil
}

var _ ledger.Results = storedResults{}

// Stored is the result stored at seq.
func (r storedResults) Stored(ctx context.Context, seq uint64) (v1.ResultData, error) {
	st, err := r.stream(ctx)
	if err != nil {
		return v1.ResultData{}, err
	}
	m, err := retry(ctx, r.attempt, func(ctx context.Context) (*jetstream.RawStreamMsg, error) {
		return st.GetMsg(ctx, seq)
	})
	if err != nil {
		return v1.ResultData{}, fmt.Errorf("result %d of %s: %w", seq, v1.ResultsStream, err)
	}
	var res v1.Result
	if err := json.Unmarshal(m.Data, &res); err != nil {
		return v1.ResultData{}, fmt.Errorf("result %d of %s: %w", seq, v1.ResultsStream, err)
	}
	return res.Data, nil
}

// findBatch is how many headers a look for a stored result fetches at a
// time.
const findBatch = 256

// Find is the result stored for tenant's request id under name at or
// after since. The subject's last result is read first (one direct
// get): it is the request's, or older than since, most of the time.
// Otherwise the stream's headers on the subject are read from since on
// (an ephemeral consumer, headers only), and the result whose message id
// is the request's is read in full. Publishes of requests older than
// the worker's FirstAge look.
func (r storedResults) Find(ctx context.Context, tenant, name, id string, since time.Time) (*v1.ResultData, error) {
	d, _, err := r.find(ctx, tenant, name, id, since, 0)
	return d, err
}

// recentMsgs is how many of the stream's messages, back from the
// subject's last result, Recent reads at most.
const recentMsgs = 1024

// Recent is Find bounded for the status service: it reads the subject's
// results among the stream's last recentMsgs messages up to the
// subject's last. A result published first is recorded a moment later,
// so the one status must not miss is among the newest; a tenant polling
// the status of a request under a busy name costs a bounded read.
func (r storedResults) Recent(ctx context.Context, tenant, name, id string, since time.Time) (*v1.ResultData, error) {
	d, _, err := r.find(ctx, tenant, name, id, since, recentMsgs)
	return d, err
}

// find is Find, reading no further back than recent messages before the
// subject's last (0: no bound); scanned is how many headers it read.
func (r storedResults) find(ctx context.Context, tenant, name, id string, since time.Time, recent uint64) (_ *v1.ResultData, scanned int, _ error) {
	// The subject's last result first: most often it is the request's own
	// (just published), or older than the request (nothing to find).
	st, err := r.stream(ctx)
	if err != nil {
		return nil, 0, err
	}
	want := v1.MsgID(tenant, id)
	last, err := retry(ctx, r.attempt, func(ctx context.Context) (*jetstream.RawStreamMsg, error) {
		return st.GetLastMsgForSubject(ctx, v1.ResultSubject(tenant, name))
	})
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return nil, 0, nil
	case err != nil:
		return nil, 0, fmt.Errorf("look for the result of %s: %w", id, err)
	case last.Header.Get(v1.MsgIDHeader) == want:
		var res v1.Result
		if err := json.Unmarshal(last.Data, &res); err != nil {
			return nil, 0, fmt.Errorf("result %d of %s: %w", last.Sequence, v1.ResultsStream, err)
		}
		return &res.Data, 0, nil
	case !since.IsZero() && last.Time.Before(since.Add(-time.Second)):
		return nil, 0, nil
	}
	cfg := jetstream.ConsumerConfig{
		FilterSubject:     v1.ResultSubject(tenant, name),
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		AckPolicy:         jetstream.AckNonePolicy,
		HeadersOnly:       true,
		MemoryStorage:     true,
		InactiveThreshold: time.Minute,
	}
	switch {
	case recent > 0 && last.Sequence > recent:
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, last.Sequence-recent+1
	case !since.IsZero():
		// A second's slack for the clocks of a cluster's servers.
		from := since.Add(-time.Second)
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &from
	}
	// A consumer created by an attempt whose answer was lost is removed
	// by the server after its InactiveThreshold.
	c, err := retry(ctx, r.attempt, func(ctx context.Context) (jetstream.Consumer, error) {
		return r.js.CreateConsumer(ctx, v1.ResultsStream, cfg)
	})
	if err != nil {
		return nil, 0, fmt.Errorf("look for the result of %s: %w", id, err)
	}
	// The consumer is deleted beside the answer, not before it: a delete
	// lost to a dropped connection must not hold the look (the server
	// removes the consumer after its InactiveThreshold all the same).
	defer func() {
		go func(name string) {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = r.js.DeleteConsumer(dctx, v1.ResultsStream, name)
		}(c.CachedInfo().Name)
	}()
	pending := c.CachedInfo().NumPending
	for pending > 0 {
		wait := 2 * time.Second
		if dl, ok := ctx.Deadline(); ok {
			wait = min(wait, time.Until(dl))
		}
		if wait <= 0 {
			return nil, scanned, fmt.Errorf("look for the result of %s: %w", id, context.DeadlineExceeded)
		}
		batch, err := c.Fetch(int(min(pending, findBatch)), jetstream.FetchMaxWait(wait))
		if err != nil {
			return nil, scanned, fmt.Errorf("look for the result of %s: %w", id, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			scanned++
			if m.Headers().Get(v1.MsgIDHeader) != want {
				continue
			}
			meta, err := m.Metadata()
			if err != nil {
				return nil, scanned, fmt.Errorf("look for the result of %s: %w", id, err)
			}
			d, err := r.Stored(ctx, meta.Sequence.Stream)
			if err != nil {
				return nil, scanned, err
			}
			return &d, scanned, nil
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, scanned, fmt.Errorf("look for the result of %s: %w", id, err)
		}
		if n == 0 {
			return nil, scanned, fmt.Errorf("look for the result of %s: %d stored results not delivered", id, pending)
		}
		pending -= min(uint64(n), pending)
	}
	return nil, scanned, nil
}

// serverClock bounds the NATS server's clock from above, so that how old a
// request is — against its message's stream time — is judged by the
// server's clock and never the worker's (docs/design.md §6: no worker's
// clock decides). A sample is the server's time stamp in a stream info
// response and the local (monotonic) time its request was sent: the stamp
// was taken after the send, so stamp + time since the send is at least
// the server's time now.
type serverClock struct {
	mu   sync.Mutex
	ts   time.Time // the server's time stamp of the last sample
	sent time.Time // when its request was sent, with its monotonic reading
	// window is BUILDQ_RESULTS' duplicate window as the sample read it.
	window time.Duration
}

// sample records an info response's time stamp and the results stream's
// duplicate window; a response without a time stamp (an older server)
// leaves the clock unknown.
func (c *serverClock) sample(ts, sent time.Time, window time.Duration) {
	if ts.IsZero() {
		return
	}
	c.mu.Lock()
	c.ts, c.sent, c.window = ts, sent, window
	c.mu.Unlock()
}

// sampleMaxAge is how long a sample is trusted: three of the worker's
// samples (ackWaitRefresh). Past it (the info requests failing, the
// worker paused) the clock is unknown: a window narrowed meanwhile, a
// server restarted on another clock, are seen within it or not trusted.
const sampleMaxAge = 3 * ackWaitRefresh

// young reports whether a request whose message the server stored at
// msgTime is younger than firstAge and than half the results stream's
// duplicate window, on the server's clock. Unknown is not young.
func (c *serverClock) young(msgTime time.Time, firstAge time.Duration) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ts.IsZero() || firstAge <= 0 {
		return false
	}
	since := time.Since(c.sent)
	if since > sampleMaxAge {
		return false
	}
	now := c.ts.Add(since)
	return now.Sub(msgTime) < min(firstAge, c.window/2)
}

// sampleServerClock reads BUILDQ_RESULTS' info: the server's time stamp
// and the stream's duplicate window as it is now (another deployment's
// worker may have set it).
func (w *Worker) sampleServerClock(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	sent := time.Now()
	st, err := w.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		return
	}
	info := st.CachedInfo()
	w.serverClock.sample(info.TimeStamp, sent, info.Config.Duplicates)
}
