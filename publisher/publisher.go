// Package publisher is buildq's producer SDK: it publishes build requests
// onto the BUILDQ_REQUESTS stream and waits for, or watches, their results.
//
// It depends on NATS and the wire types only; importing it does not pull
// Kubernetes or the worker into a program's build.
package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
}

// New returns a client on an established NATS connection.
func New(nc *nats.Conn) (*Client, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Client{nc: nc, js: js}, nil
}

// NewRequestID returns a fresh, unique request id.
func NewRequestID() string { return nuid.Next() }

// ErrNoWorkers is returned when the requests stream does not exist: no
// worker has ever started against this NATS server.
var ErrNoWorkers = errors.New("no buildq stream on this NATS server: start a worker (buildq worker, or buildq dev) first")

// Publish validates req and publishes it on buildq.requests.<tenant> with
// Nats-Msg-Id = "<tenant>/<requestId>" (v1.MsgID). APIVersion and RequestID are filled in when
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
	m.Header.Set(v1.MsgIDHeader, v1.MsgID(req.Tenant, req.RequestID))
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
// end without error).
func (c *Client) Watch(ctx context.Context, f Filter, fn func(v1.Result) error) error {
	subj, err := f.subject()
	if err != nil {
		return err
	}
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{subj}, DeliverPolicy: jetstream.DeliverNewPolicy}
	switch {
	case f.DeliverAll:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	case !f.Since.IsZero():
		since := f.Since
		cfg.DeliverPolicy = jetstream.DeliverByStartTimePolicy
		cfg.OptStartTime = &since
	}
	cons, err := c.js.OrderedConsumer(ctx, v1.ResultsStream, cfg)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return ErrNoWorkers
	}
	if err != nil {
		return fmt.Errorf("watch results: %w", err)
	}
	it, err := cons.Messages()
	if err != nil {
		return fmt.Errorf("watch results: %w", err)
	}
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	defer it.Stop()
	for {
		msg, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return ctx.Err()
			}
			return fmt.Errorf("watch results: %w", err)
		}
		var r v1.Result
		if err := json.Unmarshal(msg.Data(), &r); err != nil {
			continue // not ours to judge; skip what we cannot read
		}
		if f.RequestID != "" && r.ID != f.RequestID {
			continue
		}
		if err := fn(r); err != nil {
			if errors.Is(err, ErrStop) {
				return nil
			}
			return err
		}
	}
}

// ErrStop ends Watch without error.
var ErrStop = errors.New("stop watching")

// Wait returns the result of one request. since bounds how far back stored
// results are searched; use the time the request was published (minus a
// little clock skew), or zero to search everything stored.
func (c *Client) Wait(ctx context.Context, tenant, name, requestID string, since time.Time) (*v1.Result, error) {
	var out *v1.Result
	f := Filter{Tenant: tenant, Name: name, RequestID: requestID, Since: since, DeliverAll: since.IsZero()}
	err := c.Watch(ctx, f, func(r v1.Result) error {
		out = &r
		return ErrStop
	})
	if err != nil {
		return nil, err
	}
	if out == nil {
		return nil, ctx.Err()
	}
	return out, nil
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
