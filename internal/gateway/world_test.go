package gateway

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/natsconf"
	"github.com/buildq/buildq/internal/testnats"
)

// The example tenants' secrets, as their producers and forges hold them.
const (
	acmeToken    = "acme-ci-token-0123456789"
	globexToken  = "globex-ci-token-9876543210"
	acmeGitHub   = "acme-github-webhook-secret"
	acmeGitLab   = "acme-gitlab-webhook-token"
	acmeRepo     = "https://github.com/acme/web"
	acmeLabRepo  = "https://gitlab.example.com/acme/api"
	pushedCommit = "9e597618cb9102c993b3245f4e7c0843131ce335"
	beforeCommit = "85a5d3681c47658c4e0a667472a17a754c22055d"
)

// world is a NATS server set up as `buildq nats-config` makes it (an
// account per tenant: acme and globex import their own request subject
// from BUILDQ and may publish nothing else), the requests stream, and a
// gateway whose tenants publish with their own nkeys, behind an httptest
// server.
type world struct {
	t      *testing.T
	nats   *testnats.Server
	admin  jetstream.JetStream
	gw     *Server
	srv    *httptest.Server
	reg    *prometheus.Registry
	logs   *observer.ObservedLogs
	config string // the configuration file
	tls    *tls.Config
}

// worldOptions change the world before it starts.
type worldOptions struct {
	// identity maps a gateway tenant to the NATS user whose seed it gets
	// (default: its own).
	identity map[string]string
	// yaml replaces the configuration file's tenants section.
	tenants string
	// tls serves the gateway over TLS with this configuration (client
	// certificates).
	tls *tls.Config
}

// natsWorld starts nats-server with the account-per-tenant configuration
// of acme and globex and returns it with the seed file of each user.
func natsWorld(t *testing.T) (*testnats.Server, map[string]string) {
	t.Helper()
	tenants := []string{"acme", "globex"}
	keys, err := natsconf.NewUserKeys(natsconf.Users(tenants))
	if err != nil {
		t.Fatal(err)
	}
	conf, err := natsconf.ServerConfig(natsconf.ConfigOptions{Tenants: tenants, NKeys: natsconf.PublicKeys(keys)})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "nats-server.conf")
	writeFile(t, file, string(conf))
	parsed, err := server.ProcessConfigFile(file)
	if err != nil {
		t.Fatalf("the server refuses the configuration: %v", err)
	}
	srv := testnats.Start(t, testnats.Config{Configure: func(o *server.Options) {
		keep := *o
		*o = *parsed
		o.Host, o.Port, o.StoreDir, o.NoLog, o.NoSigs = keep.Host, keep.Port, keep.StoreDir, true, true
		o.JetStreamMaxMemory, o.JetStreamMaxStore = keep.JetStreamMaxMemory, keep.JetStreamMaxStore
	}})
	seeds := map[string]string{}
	for _, k := range keys {
		p := filepath.Join(dir, k.User+".seed")
		writeFile(t, p, string(k.Seed)+"\n")
		seeds[k.User] = p
	}
	return srv, seeds
}

// ensureRequestsStream creates BUILDQ_REQUESTS as DESIGN §3 has it
// (WorkQueue retention, file storage, a 10-minute duplicate window).
func ensureRequestsStream(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: v1.RequestsStream, Subjects: []string{v1.RequestsPrefix + ".>"},
		Retention: jetstream.WorkQueuePolicy, Storage: jetstream.FileStorage, Duplicates: 10 * time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
}

func newWorld(t *testing.T, wo worldOptions) *world {
	t.Helper()
	srv, seeds := natsWorld(t)
	adminNC := srv.Connect(t, nkeyOption(t, seeds[natsconf.AdminKey]))
	admin, err := jetstream.New(adminNC)
	if err != nil {
		t.Fatal(err)
	}
	ensureRequestsStream(t, admin)

	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "msgid.key"), strings.Repeat("k", 32))
	writeFile(t, filepath.Join(dir, "acme-github"), acmeGitHub+"\n")
	writeFile(t, filepath.Join(dir, "acme-gitlab"), acmeGitLab+"\n")
	id := func(tenant string) string {
		if u, ok := wo.identity[tenant]; ok {
			return seeds[u]
		}
		return seeds[tenant]
	}
	tenants := wo.tenants
	if tenants == "" {
		tenants = fmt.Sprintf(`
  - name: acme
    auth: {tokenSHA256: [%q], clientCertSubjects: ["CN=ci.acme.example,O=Acme"]}
    nats: {nkeySeedFile: %q}
    webhooks:
      github: {secretFile: acme-github}
      gitlab: {secretFile: acme-gitlab}
    triggers:
      - repository: %s
        name: web
        image: registry.example.com/acme/web
        branches: [main, "release/*"]
      - repository: %s.git
        name: web-docs
        dockerfile: docs/Dockerfile
        subPath: docs
        platforms: [linux/amd64, linux/arm64]
        buildArgs: {MODE: docs}
        branches: [main]
        tags: ["v*"]
      - repository: ssh://git@github.com/acme/other
        name: other
      - repository: %s
        name: api
  - name: globex
    auth: {tokenSHA256: ["sha256:%s"]}
    nats: {nkeySeedFile: %q}
`, tokenHash(acmeToken), id("acme"), acmeRepo, acmeRepo, acmeLabRepo, tokenHash(globexToken), id("globex"))
	}
	config := filepath.Join(dir, "gateway.yaml")
	writeFile(t, config, "msgIdKeyFile: msgid.key\ntenants:"+tenants)
	w := &world{t: t, nats: srv, admin: admin, config: config, tls: wo.tls}
	w.start()
	return w
}

// start loads the configuration, dials every tenant's link and serves
// a gateway on them.
func (w *world) start() {
	t := w.t
	t.Helper()
	settings, err := Load(w.config)
	if err != nil {
		t.Fatalf("load %s: %v", w.config, err)
	}
	if err := settings.ProductionProblems(); err != nil {
		t.Fatal(err)
	}
	links := map[string]*Link{}
	for _, tn := range settings.Tenants {
		l, err := DialTenant(w.nats.URL(), tn, zap.NewNop(), nats.ReconnectWait(20*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		links[tn.Name] = l
	}
	core, logs := observer.New(zap.DebugLevel)
	w.logs = logs
	w.reg = prometheus.NewRegistry()
	gw, err := New(Options{Tenants: settings.Tenants, Links: links, MsgIDKey: settings.MsgIDKey, Registry: w.reg,
		Logger: zap.New(core), PublishTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	w.gw = gw
	w.srv = httptest.NewUnstartedServer(gw)
	if w.tls != nil {
		w.srv.TLS = w.tls
		w.srv.StartTLS()
	} else {
		w.srv.Start()
	}
	t.Cleanup(w.srv.Close)
	w.waitReady()
}

// waitReady waits until /readyz says every link is up.
func (w *world) waitReady() {
	w.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body := w.get("/readyz")
		if code == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("the gateway is not ready: %d %s", code, body)
		}
		time.Sleep(10 * time.Millisecond) // polling a condition, with a deadline
	}
}

func nkeyOption(t *testing.T, seedFile string) nats.Option {
	t.Helper()
	o, err := nats.NkeyOptionFromSeed(seedFile)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func writeFile(t *testing.T, p, content string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func tokenHash(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// response is an HTTP answer, its JSON decoded.
type response struct {
	code int
	body map[string]any
	raw  string
}

func (w *world) do(req *http.Request) response {
	w.t.Helper()
	client := http.DefaultClient
	if w.tls != nil {
		client = w.srv.Client()
	}
	resp, err := client.Do(req)
	if err != nil {
		w.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	r := response{code: resp.StatusCode, raw: string(b)}
	_ = json.Unmarshal(b, &r.body)
	return r
}

func (w *world) get(path string) (int, string) {
	w.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, w.srv.URL+path, nil)
	r := w.do(req)
	return r.code, r.raw
}

func (w *world) post(path string, headers map[string]string, body []byte) response {
	w.t.Helper()
	req, err := http.NewRequest(http.MethodPost, w.srv.URL+path, bytes.NewReader(body))
	if err != nil {
		w.t.Fatal(err)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	return w.do(req)
}

// storedMsg is a message of the requests stream.
type storedMsg struct {
	subject string
	msgID   string
	req     v1.Request
}

// stored reads every message of BUILDQ_REQUESTS back, as the admin.
func (w *world) stored() []storedMsg {
	w.t.Helper()
	return storedIn(w.t, w.admin)
}

func storedIn(t *testing.T, js jetstream.JetStream) []storedMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, v1.RequestsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []storedMsg
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		var req v1.Request
		if err := json.Unmarshal(m.Data, &req); err != nil {
			t.Fatalf("stored message %d: %v", seq, err)
		}
		out = append(out, storedMsg{subject: m.Subject, msgID: m.Header.Get(v1.MsgIDHeader), req: req})
	}
	return out
}

// checkStored asserts a stored message is the request of tenant with id
// on the tenant's subject, with a Nats-Msg-Id of the SDK's form.
func checkStored(t *testing.T, m storedMsg, tenant, requestID string) {
	t.Helper()
	if m.subject != v1.RequestSubject(tenant) {
		t.Errorf("stored on %s, want %s", m.subject, v1.RequestSubject(tenant))
	}
	if m.req.Tenant != tenant || m.req.RequestID != requestID || m.req.APIVersion != v1.APIVersion {
		t.Errorf("stored request %s/%s (%s), want %s/%s", m.req.Tenant, m.req.RequestID, m.req.APIVersion, tenant, requestID)
	}
	if err := m.req.Validate(); err != nil {
		t.Errorf("stored request is invalid: %v", err)
	}
	parts := strings.Split(m.msgID, "/")
	if !v1.MsgIDMatches(m.msgID, tenant, requestID) || len(parts) != 3 || len(parts[2]) != nonceLen {
		t.Errorf("Nats-Msg-Id %q is not <tenant>/<requestId>/<nonce> of %s/%s", m.msgID, tenant, requestID)
	}
}

// githubSign is the X-Hub-Signature-256 of body.
func githubSign(secret string, body []byte) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// metricValue is the value of a counter or gauge with the given labels,
// or -1 when there is none.
func (w *world) metricValue(name string, labels map[string]string) float64 {
	w.t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		w.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue next
				}
			}
			switch {
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return -1
}
