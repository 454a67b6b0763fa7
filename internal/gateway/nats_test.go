package gateway

import (
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// The gateway publishes as the tenant's own NATS identity, so the NATS
// account's permissions hold for it: a gateway tenant given another
// tenant's identity (a configuration error) cannot publish its requests —
// NATS refuses, the answer is 502 at once, and nothing is stored anywhere.
func TestTenantIdentityPermissionsApply(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{identity: map[string]string{"globex": "acme"}})
	start := time.Now()
	r := w.post("/", binaryEvent(globexToken, RequestedType, "/ci/globex", "g-1"), mustJSON(t, requestJSON("globex", "")))
	if r.code != http.StatusBadGateway || !strings.Contains(r.body["error"].(string), "NATS refused") {
		t.Fatalf("answer %d %s, want 502", r.code, r.raw)
	}
	// Refused by the server, not timed out waiting for a PubAck.
	if took := time.Since(start); took > 4*time.Second {
		t.Errorf("the refusal took %s", took)
	}
	if got := w.stored(); len(got) != 0 {
		t.Fatalf("%d messages stored; the first on %s", len(got), got[0].subject)
	}
	if v := w.metricValue("buildq_gateway_requests_total", map[string]string{"tenant": "globex", "outcome": outcomeDenied}); v != 1 {
		t.Errorf("denied counted %v", v)
	}
	// acme, with its own identity, still publishes.
	if r := w.post("/", binaryEvent(acmeToken, RequestedType, "/ci/acme", "a-1"), mustJSON(t, requestJSON("acme", ""))); r.code != http.StatusAccepted {
		t.Fatalf("acme: %d %s", r.code, r.raw)
	}
	if got := w.stored(); len(got) != 1 || got[0].subject != v1.RequestSubject("acme") {
		t.Fatalf("stored %v", got)
	}
}

// plainWorld is a NATS server without authentication and a gateway with
// one tenant, acme, whose link has no identity (what restarts of the
// server need: nothing of the server's configuration is shared between
// its runs).
func plainWorld(t *testing.T) *world {
	t.Helper()
	srv, _, admin := testnats.JetStream(t)
	ensureRequestsStream(t, admin)
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "msgid.key"), strings.Repeat("m", 40))
	config := filepath.Join(dir, "gateway.yaml")
	writeFile(t, config, "msgIdKeyFile: msgid.key\ntenants:\n  - name: acme\n    auth: {tokenSHA256: ["+tokenHash(acmeToken)+"]}\n")
	w := &world{t: t, nats: srv, admin: admin, config: config}
	settings, err := Load(config)
	if err != nil {
		t.Fatal(err)
	}
	l, err := DialTenant(srv.URL(), settings.Tenants[0], zap.NewNop(), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	w.reg = prometheus.NewRegistry()
	gw, err := New(Options{Tenants: settings.Tenants, Links: map[string]*Link{"acme": l}, MsgIDKey: settings.MsgIDKey, Registry: w.reg, PublishTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	w.gw = gw
	w.srv = httptest.NewServer(gw)
	t.Cleanup(w.srv.Close)
	w.waitReady()
	return w
}

// While NATS is down the gateway answers 503 (with Retry-After) and says
// on /readyz which tenant has no connection; when NATS is back it takes
// requests again, and the request refused meanwhile, sent again, is
// stored once.
func TestNATSDownAnswers503ThenRecovers(t *testing.T) {
	t.Parallel()
	w := plainWorld(t)
	send := func() response {
		return w.post("/", binaryEvent(acmeToken, RequestedType, "/ci", "during-outage"), mustJSON(t, requestJSON("acme", "")))
	}
	if v := w.metricValue("buildq_gateway_nats_connected", map[string]string{"tenant": "acme"}); v != 1 {
		t.Fatalf("nats_connected %v before the outage", v)
	}
	w.nats.Stop()
	// The client sees the server go (its connection closes).
	deadline := time.Now().Add(10 * time.Second)
	for w.gw.links["acme"].Connected() {
		if time.Now().After(deadline) {
			t.Fatal("the link still reports a connection to a stopped server")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, with a deadline
	}
	req, _ := http.NewRequest(http.MethodPost, w.srv.URL+"/", strings.NewReader(string(mustJSON(t, requestJSON("acme", "")))))
	for k, v := range binaryEvent(acmeToken, RequestedType, "/ci", "during-outage") {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("during the outage: %d (Retry-After %q), want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if code, body := w.get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "acme") {
		t.Fatalf("/readyz during the outage: %d %q", code, body)
	}
	if v := w.metricValue("buildq_gateway_nats_connected", map[string]string{"tenant": "acme"}); v != 0 {
		t.Fatalf("nats_connected %v during the outage", v)
	}

	if err := w.nats.Start(); err != nil {
		t.Fatal(err)
	}
	w.waitReady()
	first := send()
	if first.code != http.StatusAccepted || first.body["duplicate"] != nil {
		t.Fatalf("after the outage: %d %s", first.code, first.raw)
	}
	if again := send(); again.code != http.StatusAccepted || again.body["duplicate"] != true {
		t.Fatalf("the retry: %d %s", again.code, again.raw)
	}
	if got := w.stored(); len(got) != 1 {
		t.Fatalf("%d stored, want 1", len(got))
	}
	if v := w.metricValue("buildq_gateway_requests_total", map[string]string{"tenant": "acme", "outcome": outcomeUnavailable}); v != 1 {
		t.Errorf("unavailable counted %v", v)
	}
	if v := w.metricValue("buildq_gateway_publish_seconds", map[string]string{"tenant": "acme", "result": "ok"}); v != 2 {
		t.Errorf("publish latency observed %v times, want 2", v)
	}
}

// A NATS server without the requests stream: 503 saying no stream stores
// the tenant's requests yet.
func TestNoStreamAnswers503(t *testing.T) {
	t.Parallel()
	w := plainWorld(t)
	if err := w.admin.DeleteStream(t.Context(), v1.RequestsStream); err != nil {
		t.Fatal(err)
	}
	r := w.post("/", binaryEvent(acmeToken, RequestedType, "/ci", "x"), mustJSON(t, requestJSON("acme", "")))
	if r.code != http.StatusServiceUnavailable || !strings.Contains(r.raw, "no stream") {
		t.Fatalf("answer %d %s", r.code, r.raw)
	}
}

// buildq dev's mode: one shared, unauthenticated NATS connection; events
// need no credentials and go to the tenant they name, but credentials
// that are given are checked.
func TestOpenModeForDev(t *testing.T) {
	t.Parallel()
	srv, _, admin := testnats.JetStream(t)
	ensureRequestsStream(t, admin)
	shared, err := Dial(srv.URL(), "buildq-dev-gateway", zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(shared.Close)
	settings, err := Parse([]byte("tenants:\n  - name: acme\n    auth: {tokenSHA256: ["+tokenHash(acmeToken)+"]}\n"), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	gw, err := New(Options{Tenants: settings.Tenants, Shared: shared, Open: true, MsgIDKey: []byte(strings.Repeat("d", 32))})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(gw)
	t.Cleanup(hs.Close)
	w := &world{t: t, srv: hs, gw: gw}
	w.waitReady()
	if r := w.post("/", binaryEvent("", RequestedType, "/dev", "1"), mustJSON(t, requestJSON("initech", ""))); r.code != http.StatusAccepted || r.body["tenant"] != "initech" {
		t.Fatalf("open mode, no credentials: %d %s", r.code, r.raw)
	}
	if r := w.post("/", binaryEvent("wrong", RequestedType, "/dev", "2"), mustJSON(t, requestJSON("initech", ""))); r.code != http.StatusUnauthorized {
		t.Fatalf("open mode, a wrong token: %d %s", r.code, r.raw)
	}
	if r := w.post("/", binaryEvent(acmeToken, RequestedType, "/dev", "3"), mustJSON(t, requestJSON("initech", ""))); r.code != http.StatusForbidden {
		t.Fatalf("open mode, acme's token for initech: %d %s", r.code, r.raw)
	}
	if r := w.post("/", binaryEvent("", RequestedType, "/dev", "4"), mustJSON(t, requestJSON("", ""))); r.code != http.StatusUnprocessableEntity || !strings.Contains(r.raw, `"tenant"`) {
		t.Fatalf("open mode, no tenant anywhere: %d %s", r.code, r.raw)
	}
	got := storedIn(t, admin)
	if len(got) != 1 {
		t.Fatalf("%d stored, want 1", len(got))
	}
	checkStored(t, got[0], "initech", EventRequestID("initech", "/dev", "1"))
}

// New refuses what cannot work.
func TestNewRefuses(t *testing.T) {
	t.Parallel()
	settings, err := Parse([]byte("tenants:\n  - name: acme\n"), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	key := []byte(strings.Repeat("k", 32))
	for name, o := range map[string]Options{
		"short key":      {Tenants: settings.Tenants, MsgIDKey: []byte("short")},
		"no link":        {Tenants: settings.Tenants, MsgIDKey: key},
		"unknown tenant": {Tenants: settings.Tenants, MsgIDKey: key, Links: map[string]*Link{"acme": {}, "globex": {}}},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("%s: New accepted it", name)
		}
	}
}
