package gateway

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// Link is a NATS connection the gateway publishes requests over: a
// tenant's own (DialTenant), or `buildq dev`'s unauthenticated one.
// It is safe for concurrent use.
type Link struct {
	name string
	nc   *nats.Conn
	js   jetstream.JetStream
	log  *zap.Logger

	mu sync.Mutex
	// denied is closed (and replaced) when the server refuses something
	// of this connection's: a publish the identity may not make fails at
	// once rather than when its PubAck times out.
	denied    chan struct{}
	deniedErr error
}

// Publish failures, by what the HTTP client should make of them.
var (
	// ErrUnavailable: NATS is unreachable, or did not acknowledge in
	// time. The request may have been stored; a retry stores nothing
	// twice.
	ErrUnavailable = errors.New("NATS is unreachable or did not acknowledge the request")
	// ErrNoStream: nothing stores the tenant's request subject (no
	// worker has set up the streams yet, or the tenant's account lacks
	// the import).
	ErrNoStream = errors.New("no stream stores the request subject: has a worker set up the streams?")
	// ErrDenied: the tenant's NATS identity may not publish its request
	// subject (or read its replies): a configuration error of the
	// tenant's NATS account or of the gateway.
	ErrDenied = errors.New("NATS refused the tenant's identity (permissions violation)")
)

// Dial connects to NATS at url for the gateway. It returns at once even
// while NATS is unreachable: the connection keeps trying (and reconnects
// after a loss without limit, also after the server refused the identity,
// so a fixed NATS account needs no gateway restart), and Connected
// reports false meanwhile. Publishes are not buffered while disconnected:
// they fail at once.
func Dial(url, name string, log *zap.Logger, opts ...nats.Option) (*Link, error) {
	if log == nil {
		log = zap.NewNop()
	}
	l := &Link{name: name, log: log, denied: make(chan struct{})}
	base := []nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.IgnoreAuthErrorAbort(),
		nats.ReconnectBufSize(-1),
		nats.ErrorHandler(l.onError),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("NATS connection lost", zap.String("link", name), zap.Error(err))
			}
		}),
		nats.ReconnectHandler(func(*nats.Conn) { log.Info("NATS connection back", zap.String("link", name)) }),
		nats.ConnectHandler(func(*nats.Conn) { log.Info("NATS connected", zap.String("link", name)) }),
	}
	nc, err := nats.Connect(url, append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("NATS at %s for %s: %w", url, name, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	l.nc, l.js = nc, js
	return l, nil
}

// DialTenant connects to NATS at url as tenant t's own identity, with its
// replies (the PubAcks) under the tenant's inbox prefix,
// v1.InboxPrefix(t.Name), which both shipped setups let the tenant read
// (deploy/nats). opts come last (tests shorten the reconnect wait).
func DialTenant(url string, t *Tenant, log *zap.Logger, opts ...nats.Option) (*Link, error) {
	id, err := t.NATSOptions()
	if err != nil {
		return nil, err
	}
	id = append(id, nats.CustomInboxPrefix(v1.InboxPrefix(t.Name)))
	return Dial(url, "buildq-gateway "+t.Name, log, append(id, opts...)...)
}

// Connected reports whether the link holds a live connection.
func (l *Link) Connected() bool { return l.nc.IsConnected() }

// Close closes the connection.
func (l *Link) Close() { l.nc.Close() }

func (l *Link) onError(_ *nats.Conn, _ *nats.Subscription, err error) {
	if errors.Is(err, nats.ErrPermissionViolation) {
		l.mu.Lock()
		l.deniedErr = err
		close(l.denied)
		l.denied = make(chan struct{})
		l.mu.Unlock()
	}
	l.log.Warn("NATS error", zap.String("link", l.name), zap.Error(err))
}

// publish stores msg in JetStream and returns its PubAck. Its errors
// match ErrUnavailable, ErrNoStream or ErrDenied.
func (l *Link) publish(ctx context.Context, msg *nats.Msg) (*jetstream.PubAck, error) {
	if !l.nc.IsConnected() {
		return nil, fmt.Errorf("%w (not connected)", ErrUnavailable)
	}
	l.mu.Lock()
	denied := l.denied
	l.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		ack *jetstream.PubAck
		err error
	}
	done := make(chan result, 1)
	go func() {
		ack, err := l.js.PublishMsg(ctx, msg)
		done <- result{ack, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-denied:
		l.mu.Lock()
		err := l.deniedErr
		l.mu.Unlock()
		return nil, fmt.Errorf("%w: %w", ErrDenied, err)
	}
	switch {
	case r.err == nil:
		return r.ack, nil
	case errors.Is(r.err, jetstream.ErrNoStreamResponse), errors.Is(r.err, nats.ErrNoResponders):
		return nil, fmt.Errorf("%w (%s)", ErrNoStream, msg.Subject)
	case errors.Is(r.err, nats.ErrPermissionViolation):
		return nil, fmt.Errorf("%w: %w", ErrDenied, r.err)
	}
	return nil, fmt.Errorf("%w: %w", ErrUnavailable, r.err)
}
