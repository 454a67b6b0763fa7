package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
type storedResults struct{ js jetstream.JetStream }

var _ ledger.Results = storedResults{}

// Stored is the result stored at seq.
func (r storedResults) Stored(ctx context.Context, seq uint64) (v1.ResultData, error) {
	st, err := r.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		return v1.ResultData{}, fmt.Errorf("stream %s: %w", v1.ResultsStream, err)
	}
	m, err := st.GetMsg(ctx, seq)
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
// after since: the stream's headers on the request's result subject are
// read from since on (an ephemeral consumer, headers only), and the
// result whose message id is the request's is read in full. It is rare:
// only a publish of a request older than the ledger's FirstAge looks.
func (r storedResults) Find(ctx context.Context, tenant, name, id string, since time.Time) (*v1.ResultData, error) {
	cfg := jetstream.ConsumerConfig{
		FilterSubject:     v1.ResultSubject(tenant, name),
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		AckPolicy:         jetstream.AckNonePolicy,
		HeadersOnly:       true,
		MemoryStorage:     true,
		InactiveThreshold: time.Minute,
	}
	if !since.IsZero() {
		// A second's slack for the clocks of a cluster's servers.
		from := since.Add(-time.Second)
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &from
	}
	c, err := r.js.CreateConsumer(ctx, v1.ResultsStream, cfg)
	if err != nil {
		return nil, fmt.Errorf("look for the result of %s: %w", id, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = r.js.DeleteConsumer(dctx, v1.ResultsStream, c.CachedInfo().Name)
	}()
	pending := c.CachedInfo().NumPending
	want := v1.MsgID(tenant, id)
	for pending > 0 {
		batch, err := c.Fetch(int(min(pending, findBatch)), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, fmt.Errorf("look for the result of %s: %w", id, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			if m.Headers().Get(v1.MsgIDHeader) != want {
				continue
			}
			meta, err := m.Metadata()
			if err != nil {
				return nil, fmt.Errorf("look for the result of %s: %w", id, err)
			}
			d, err := r.Stored(ctx, meta.Sequence.Stream)
			if err != nil {
				return nil, err
			}
			return &d, nil
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, fmt.Errorf("look for the result of %s: %w", id, err)
		}
		if n == 0 {
			return nil, fmt.Errorf("look for the result of %s: %d stored results not delivered", id, pending)
		}
		pending -= uint64(min(uint64(n), pending))
	}
	return nil, nil
}
