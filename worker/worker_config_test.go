package worker

// The worker's configuration and setup: settings that would break a rule
// are refused at start, and Setup waits only for a JetStream that is not
// ready yet.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// A build record is renewed every third of the lease and a dead owner's
// is taken over after 1.5 leases watched: an index TTL shorter than that
// drops a running build's record (its key is claimed again, its Job
// replaced) or a dead owner's before anyone takes it over. The worker
// accepted --lease 30m with --index-ttl 1h.
//
// Origin: issue 24, a suspicion its review raised (--index-ttl was not checked against --lease).
func TestIndexTTLMustOutliveTheLease(t *testing.T) {
	t.Parallel()
	cfg := testConfig("w1")
	cfg.Lease = 30 * time.Minute
	cfg.IndexTTL = time.Hour
	err := cfg.WithDefaults().Validate()
	if err == nil || !strings.Contains(err.Error(), "index TTL") {
		t.Fatalf("Validate() with --lease 30m --index-ttl 1h = %v, want an index TTL error", err)
	}
	cfg.IndexTTL = 3 * time.Hour
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatalf("Validate() with --lease 30m --index-ttl 3h = %v", err)
	}
	if err := testConfig("w1").WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}
	cfg.IndexTTL = time.Hour
	if _, err := New(nil, nil, cfg); err == nil || !strings.Contains(err.Error(), "index TTL") {
		t.Fatalf("New with --lease 30m --index-ttl 1h = %v, want refused", err)
	}
}

// A context prefix must hold {tenant} as a whole path segment: with
// "contexts/{tenant}" tenant acme could name contexts/acme-corp/….
//
// Origin: tests for --context-bucket and the context prefix (b72e2fe).
func TestContextPrefixNeedsATenantSegment(t *testing.T) {
	t.Parallel()
	for prefix, ok := range map[string]bool{"contexts/{tenant}/": true, "": true, "contexts/{tenant}": false, "contexts/": false} {
		c := Config{ContextPrefix: prefix}.WithDefaults()
		if err := c.Validate(); (err == nil) != ok {
			t.Errorf("ContextPrefix %q: Validate() = %v, want ok=%v", prefix, err, ok)
		}
	}
}

// Attack (--context-prefix "" on a multi-tenant worker): with an empty
// ContextPrefix a request may name any object, so the possession check
// read whatever object mallory named — acme's own, whose key is
// contexts/acme/sha256/<digest>.tar.gz, known from the digest — and took
// acme's bytes as mallory's proof: she was answered from acme's build,
// and a build of her own built acme's object. A worker that checks
// possession now refuses to be made without a prefix of the tenant's
// (Config.Validate), and `buildq worker` refuses --context-prefix ""
// without --single-tenant (TestAttackWorkerAcceptsAnyContextObjectWithoutSingleTenant).
//
// Origin: second hostile-tenant review, of 26b1795; failed there, fixed by 626123b.
func TestEmptyContextPrefixIsRefusedWhenPossessionIsChecked(t *testing.T) {
	t.Parallel()
	cfg := testConfig("w1")
	cfg.Contexts, cfg.ContextPrefix = newFaultyStore(), ""
	if _, err := New(nil, nil, cfg); err == nil || !strings.Contains(err.Error(), "context prefix") {
		t.Fatalf("a worker that checks possession with an empty context prefix: New() = %v; want it refused", err)
	}
}

// The builds bucket does not grow forever.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestBuildsBucketHasATTL(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.IndexTTL = 48 * time.Hour })
	kv, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.TTL() != 48*time.Hour {
		t.Fatalf("TTL %s", st.TTL())
	}
}

// Setup waits for a JetStream that is not ready yet (a cluster electing its
// leader, workers racing to create the streams) and gives up at once on
// anything else.
//
// Origin: Setup waits for a JetStream that is not ready yet (caefd2f).
func TestSetupRetriesOnlyWhatIsNotReadyYet(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err   error
		retry bool
	}{
		{fmt.Errorf("create stream: %w", context.DeadlineExceeded), true},
		{nats.ErrNoResponders, true},
		{&jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"}, true},
		{&jetstream.APIError{Code: 500, ErrorCode: 10005, Description: "no suitable peers for placement"}, true},
		{&jetstream.APIError{Code: 400, ErrorCode: 10058, Description: "stream name already in use with a different configuration"}, false},
		{jetstream.ErrJetStreamNotEnabled, false},
		{errors.New("permissions violation"), false},
	} {
		if got := setupRetryable(c.err); got != c.retry {
			t.Errorf("%v: retry %v, want %v", c.err, got, c.retry)
		}
	}
}

// A JetStream API request that gets no answer at all (sent while a cluster
// elects its meta leader) costs Setup one request timeout, not the
// caller's whole deadline. The worker's connection reaches JetStream through a relay on a
// server without it: the relay drops the first API request unanswered and
// passes on the rest.
//
// Origin: each Setup attempt has its own deadline (bd3069e).
func TestSetupAttemptOutlivesAnUnansweredRequest(t *testing.T) {
	backend := setup(t) // the server with JetStream
	front := testnats.Start(t, testnats.Config{NoJetStream: true})
	relay := front.Connect(t)
	var requests atomic.Int32
	if _, err := relay.Subscribe("$JS.API.>", func(m *nats.Msg) {
		if requests.Add(1) == 1 {
			return // lost: no answer
		}
		fwd := nats.NewMsg(m.Subject)
		fwd.Data, fwd.Header = m.Data, m.Header
		reply, err := backend.nc.RequestMsg(fwd, 5*time.Second)
		if err != nil {
			return
		}
		out := nats.NewMsg(m.Reply)
		out.Data, out.Header = reply.Data, reply.Header
		_ = relay.PublishMsg(out)
	}); err != nil {
		t.Fatal(err)
	}
	if err := relay.Flush(); err != nil {
		t.Fatal(err)
	}
	w, err := New(front.Connect(t, nats.ReconnectBufSize(-1)), nil, testConfig("setup-relay"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := w.Setup(ctx); err != nil {
		t.Fatalf("Setup after one unanswered API request: %v", err)
	}
	if requests.Load() < 2 {
		t.Fatalf("%d API requests reached the relay; the setup did not go through it", requests.Load())
	}
	if _, err := backend.js.Stream(ctx, v1.RequestsStream); err != nil {
		t.Fatalf("the requests stream after Setup: %v", err)
	}
}
