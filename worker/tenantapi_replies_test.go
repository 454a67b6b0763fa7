package worker

// Tenant API (worker/internal/tenantapi): reply subjects. The worker
// answers only on a service import's reply or the tenant's own inbox,
// never on a subject a tenant names to have the worker write where it may
// not (docs/design.md §2b).

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/tenantapi"
)

// TestAPIAnswersOnlyOnATenantsOwnReplies: NATS checks the subject a client
// publishes to, never the reply subject it names. A tenant API request
// whose reply is a bucket's $KV subject, the workers' inbox, another
// tenant's inbox or a stream's subject is dropped unanswered and counted;
// the tenant's own inbox is answered. (A service import's reply, _R_.…,
// cannot be sent by a client at all — nats-server refuses it as reserved —
// so the worker sees one only from an import: tenantapi's TestReplyAllowed, and
// integration/natsauth_test.go on the account per tenant.)
// (Issue 23: a tenant in the workers' account had the worker's answers
// written into buildq-requests and buildq-builds.)
//
// Origin: issue 23 (98418f0).
func TestAPIAnswersOnlyOnATenantsOwnReplies(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := prometheus.NewRegistry()
	metrics := NewMetrics(reg)
	e.startWorker("w1", func(c *Config) { c.Metrics = metrics })
	// A responder is there once a legitimate request is answered.
	eventually(t, 5*time.Second, "the status service", func() bool {
		_, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), "nothing", time.Second)
		return err == nil
	})

	hostile := []string{
		"$KV." + v1.BuildsBucket + "." + hex64("k"),
		"$KV.buildq-requests.x",
		"$KV." + v1.SlotsBucket + ".acme.0",
		"_INBOX.abc.def",
		v1.InboxPrefix("globex") + ".abc",
		v1.InboxPrefix("acme"), // the prefix alone is no inbox
		"_INBOX_acme-corp.x",   // another tenant whose name starts with acme
		v1.ResultSubject("globex", "web"),
		"buildq.requests.globex",
		"buildq.internal.cancel",
		"$JS.API.STREAM.DELETE." + v1.RequestsStream,
	}
	spy, err := e.nc.SubscribeSync(">")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = spy.Unsubscribe() }()
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	subjects := []string{v1.APIStatusSubject("acme"), v1.APICancelSubject("acme"), v1.CancelSubject("acme", "web")}
	for _, reply := range hostile {
		for _, subj := range subjects {
			if err := e.nc.PublishRequest(subj, reply, []byte(hex64("k"))); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := float64(len(hostile) * len(subjects))
	eventually(t, 10*time.Second, "every hostile reply counted", func() bool {
		return testutil.ToFloat64(metrics.refused.WithLabelValues("acme")) == want
	})
	// Nothing was published on any of the hostile replies.
	for {
		m, err := spy.NextMsg(200 * time.Millisecond)
		if err != nil {
			break
		}
		if slices.Contains(hostile, m.Subject) {
			t.Errorf("the worker answered on %s: %s", m.Subject, m.Data)
		}
	}
	if n, _, _ := e.streamState(); n != 0 {
		t.Errorf("%d request messages stored", n)
	}

	// The tenant's own inbox is still answered.
	if _, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), "nothing", 5*time.Second); err != nil {
		t.Fatalf("acme's own inbox: %v", err)
	}
	if got := testutil.ToFloat64(metrics.refused.WithLabelValues("acme")); got != want {
		t.Errorf("refused replies: %v, want %v", got, want)
	}
}

// The worker trusts any _R_. reply (a service import's): no client can
// name one. A status request of tenant acme with the reply _R_.… is
// refused by nats-server itself and never answered, in the one-account
// harness as in the account per tenant.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); refused there, kept as a regression test.
func TestServiceReplyPrefixCannotBeForged(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	eventually(t, 5*time.Second, "the status service", func() bool {
		_, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), "nothing", time.Second)
		return err == nil
	})
	spy, err := e.nc.SubscribeSync("_R_.>")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = spy.Unsubscribe() }()
	nc, err := nats.Connect(e.world.nats.URL(), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for _, reply := range []string{"_R_.abc.def", "_R_.x"} {
		_ = nc.PublishRequest(v1.APIStatusSubject("acme"), reply, []byte("x"))
		_ = nc.PublishRequest(v1.APICancelSubject("acme"), reply, []byte(hex64("k")))
	}
	_ = nc.Flush()
	if m, err := spy.NextMsg(500 * time.Millisecond); err == nil {
		t.Fatalf("answered on a forged service reply %s: %s", m.Subject, m.Data)
	}
	// Inbox prefixes of tenants whose names share a prefix stay apart.
	for _, c := range []struct {
		tenant, reply string
		ok            bool
	}{
		{"acme-corp", "_INBOX_acme.x", false},
		{"acme", "_INBOX_acme-corp.x", false},
		{"acme-corp", "_INBOX_acme-corp.x", true},
		{"a", "_INBOX_acme.x", false},
		{"acme", "_INBOX_ACME.x", false},
		{"acme", "_inbox_acme.x", false},
	} {
		if got := tenantapi.ReplyAllowed(false, c.tenant, c.reply); got != c.ok {
			t.Errorf("replyAllowed(%s, %s) = %v, want %v", c.tenant, c.reply, got, c.ok)
		}
	}
}
