package natsconf

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// A NATS restart under the account-per-tenant configuration, with a real
// worker connected as buildq-worker and tenants as their own accounts:
// the server is shut down in the middle of a build and started again on
// the same configuration, port and JetStream store. After it, a tenant's
// requests, status and cancel must work again (the service imports are
// back), the build in flight must end with one result, and nothing must
// be lost or answered twice.

// restartableServer is an in-process nats-server that can be stopped and
// started again on the same configuration file, port and store.
type restartableServer struct {
	t     *testing.T
	file  string
	port  int
	store string
	mu    sync.Mutex
	s     *server.Server
}

func newRestartableServer(t *testing.T, conf []byte) *restartableServer {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, "nats-server.conf")
	if err := os.WriteFile(file, conf, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	r := &restartableServer{t: t, file: file, port: port, store: filepath.Join(dir, "js")}
	r.start()
	t.Cleanup(r.stop)
	return r
}

func (r *restartableServer) url() string { return fmt.Sprintf("nats://127.0.0.1:%d", r.port) }

func (r *restartableServer) start() {
	r.t.Helper()
	opts, err := server.ProcessConfigFile(r.file)
	if err != nil {
		r.t.Fatalf("the server refuses the configuration: %v", err)
	}
	var s *server.Server
	// The port may still be held for a moment after a shutdown.
	for i := 0; ; i++ {
		s, err = server.NewServer(overrides(opts, r.port, r.store))
		if err != nil {
			r.t.Fatal(err)
		}
		s.Start()
		if s.ReadyForConnections(10 * time.Second) {
			break
		}
		s.Shutdown()
		if i == 20 {
			r.t.Fatal("nats-server did not start again")
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.mu.Lock()
	r.s = s
	r.mu.Unlock()
}

func (r *restartableServer) stop() {
	r.mu.Lock()
	s := r.s
	r.s = nil
	r.mu.Unlock()
	if s != nil {
		s.Shutdown()
		s.WaitForShutdown()
	}
}

func (r *restartableServer) restart() {
	r.stop()
	r.start()
}

// reconnecting connects as a user and keeps reconnecting across restarts.
func reconnecting(t *testing.T, url, name string, auth nats.Option, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, append([]nats.Option{auth, nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond),
		nats.ReconnectJitter(0, 0)}, opts...)...)
	if err != nil {
		t.Fatalf("connect as %s: %v", name, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// gateBackend runs a build until its context digest's gate opens.
type gateBackend struct {
	mu      sync.Mutex
	gates   map[string]chan struct{}
	started map[string]int
	changed chan struct{}
}

func newGateBackend() *gateBackend {
	return &gateBackend{gates: map[string]chan struct{}{}, started: map[string]int{}, changed: make(chan struct{}, 1)}
}

func (b *gateBackend) gate(digest string) chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	g, ok := b.gates[digest]
	if !ok {
		g = make(chan struct{})
		b.gates[digest] = g
	}
	return g
}

func (b *gateBackend) open(digest string) { close(b.gate(digest)) }

func (b *gateBackend) runs(digest string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.started[digest]
}

func (b *gateBackend) Identity() string { return "gate-executor" }

func (b *gateBackend) Run(ctx context.Context, bd worker.Build, started worker.Started) (worker.Outcome, error) {
	d := bd.Request.ContextDigest
	job := "job-" + bd.Key[:12]
	started(job, true, bd.Request.RequestID)
	b.mu.Lock()
	b.started[d]++
	b.mu.Unlock()
	at := time.Now().UTC()
	select {
	case <-b.gate(d):
		return worker.Outcome{Succeeded: true, Digest: "sha256:" + strings.Repeat("0", 48) + bd.Key[:16], Job: job, Run: bd.Run,
			StartedAt: at, FinishedAt: time.Now().UTC()}, nil
	case <-ctx.Done():
		return worker.Outcome{}, ctx.Err()
	}
}

func (b *gateBackend) Cleanup(context.Context, string, string) error { return nil }

// fakeRegistry holds the tags copied into tenants' repositories; an
// image by digest is always there (the builds "pushed" it).
type fakeRegistry struct {
	mu   sync.Mutex
	tags map[string]string
}

func (r *fakeRegistry) Head(_ context.Context, ref string) (string, error) {
	if _, d, ok := strings.Cut(ref, "@"); ok {
		return d, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if d, ok := r.tags[ref]; ok {
		return d, nil
	}
	return "", registry.ErrNotFound
}

func (r *fakeRegistry) Copy(_ context.Context, src, dst string) (string, error) {
	_, d, _ := strings.Cut(src, "@")
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tags[dst] = d
	return d, nil
}

func (r *fakeRegistry) EnsureHarborProject(context.Context, string, string) error { return nil }
func (r *fakeRegistry) PushIndex(context.Context, []registry.IndexChild, []string) (string, error) {
	return "", errors.New("fakeRegistry: no index pushes here")
}

// memContexts is a ContextSource of tenants' context objects.
type memContexts struct {
	mu sync.Mutex
	m  map[string][]byte
}

func (c *memContexts) put(key string, b []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.m[key] = b
}

func (c *memContexts) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b, ok := c.m[key]
	if !ok {
		return nil, s3store.ErrNotFound
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

// tenantRequest is a request of tenant for a context of its own, whose
// object is in store.
func tenantRequest(t *testing.T, store *memContexts, tenant, content string) *v1.Request {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM scratch\nCOPY f /f\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	res, err := contexttar.Write(context.Background(), dir, &buf, contexttar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	key := s3store.TenantContextKey(tenant, res.Digest)
	store.put(key, buf.Bytes())
	return &v1.Request{Tenant: tenant, Name: "web", ContextDigest: res.Digest,
		Source: v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: key}}}
}

// resultLog records every result a tenant's connection receives (its
// stream import), by request id.
type resultLog struct {
	mu   sync.Mutex
	byID map[string][]v1.ResultData
	subj map[string]bool
}

func subscribeResults(t *testing.T, nc *nats.Conn, tenant string) *resultLog {
	t.Helper()
	l := &resultLog{byID: map[string][]v1.ResultData{}, subj: map[string]bool{}}
	if _, err := nc.Subscribe(v1.ResultsPrefix+"."+tenant+".>", func(m *nats.Msg) {
		var r v1.Result
		_ = json.Unmarshal(m.Data, &r)
		l.mu.Lock()
		l.byID[r.ID] = append(l.byID[r.ID], r.Data)
		l.subj[m.Subject] = true
		l.mu.Unlock()
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return l
}

func (l *resultLog) get(id string) []v1.ResultData {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]v1.ResultData(nil), l.byID[id]...)
}

func (l *resultLog) subjects() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for s := range l.subj {
		out = append(out, s)
	}
	return out
}

// waitResult waits for id's result on l.
func waitResult(t *testing.T, l *resultLog, id string, timeout time.Duration) v1.ResultData {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if got := l.get(id); len(got) > 0 {
			return got[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no result for %s within %s", id, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// tenantAPI asks one of tenant's services as its SDK does, retrying while
// nobody answers (the worker reconnecting after a restart).
func tenantAPI(t *testing.T, pub *publisher.Client, tenant, subject, payload string, into any) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		m, err := pub.TenantRequest(ctx, tenant, subject, []byte(payload))
		cancel()
		if err == nil {
			if err := json.Unmarshal(m.Data, into); err != nil {
				t.Fatalf("%s: %s", subject, m.Data)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %s: %v", subject, payload, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// publishRetrying publishes a tenant's request, retrying while the server
// or its import is not back (a request published twice is stored once).
func publishRetrying(t *testing.T, pub *publisher.Client, req *v1.Request) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := pub.Publish(ctx, req)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("publish %s: %v", req.RequestID, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// restartMode is one form of the account per tenant: its server
// configuration and how each user (key name) connects.
type restartMode struct {
	conf []byte
	auth func(user string) nats.Option
	// afterStart runs once the server and the worker are up (JWT mode:
	// adds a tenant live, by a push).
	afterStart func(t *testing.T, url string)
	tenants    []string
}

func runRestart(t *testing.T, m restartMode) {
	srv := newRestartableServer(t, m.conf)
	url := srv.url()
	backend := newGateBackend()
	store := &memContexts{m: map[string][]byte{}}

	wnc := reconnecting(t, url, "buildq-worker", m.auth(WorkerKey), nats.ReconnectBufSize(-1))
	w, err := worker.New(wnc, backend, worker.Config{
		ID: "w1", MaxInFlight: 8, AckWait: 2 * time.Second, Lease: 2 * time.Second, ShutdownTimeout: 5 * time.Second,
		Naming: naming.Policy{Registry: "registry.test:5000"}, ContextPrefix: "contexts/{tenant}/", Contexts: store,
		Registry: &fakeRegistry{tags: map[string]string{}}, Logger: zaptest.NewLogger(t).Named("w1"),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	eventually := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	eventually("the worker", func() bool { return w.Ready() == nil })
	if m.afterStart != nil {
		m.afterStart(t, url)
	}

	type tenant struct {
		nc      *nats.Conn
		pub     *publisher.Client
		results *resultLog
	}
	tenants := map[string]*tenant{}
	for _, name := range m.tenants {
		nc := reconnecting(t, url, name, m.auth(name))
		pub, err := publisher.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		tenants[name] = &tenant{nc: nc, pub: pub, results: subscribeResults(t, nc, name)}
	}
	acme := tenants["acme"]
	status := func(id string) v1.StatusReply {
		t.Helper()
		var rep v1.StatusReply
		tenantAPI(t, acme.pub, "acme", v1.APIStatusSubject("acme"), id, &rep)
		return rep
	}

	// Two builds of acme's in flight, and one held in the queue of
	// another tenant.
	r1 := tenantRequest(t, store, "acme", "one")
	r2 := tenantRequest(t, store, "acme", "two")
	publishRetrying(t, acme.pub, r1)
	publishRetrying(t, acme.pub, r2)
	eventually("both builds running", func() bool { return backend.runs(r1.ContextDigest) > 0 && backend.runs(r2.ContextDigest) > 0 })
	if rep := status(r1.RequestID); rep.Request == nil || rep.Request.Result != nil || rep.Build == nil {
		t.Fatalf("status of r1 before the restart: %+v", rep)
	}
	// globex holds r1's content too: its request joins acme's build in
	// flight (parked, after its possession read) and waits across the
	// restart.
	globex := tenants["globex"]
	g1 := tenantRequest(t, store, "globex", "one")
	if g1.ContextDigest != r1.ContextDigest {
		t.Fatal("contexts differ")
	}
	publishRetrying(t, globex.pub, g1)
	eventually("globex's request waiting on acme's build", func() bool {
		var rep v1.StatusReply
		tenantAPI(t, globex.pub, "globex", v1.APIStatusSubject("globex"), g1.RequestID, &rep)
		return rep.Request != nil && rep.Request.Result == nil && rep.Build == nil && rep.Request.Key != ""
	})

	srv.restart()
	eventually("the worker reconnected", func() bool { return wnc.IsConnected() })
	for name, tn := range tenants {
		eventually(name+" reconnected", func() bool { return tn.nc.IsConnected() })
	}

	// Status and cancel through the service imports, after the restart.
	if rep := status(r1.RequestID); rep.Request == nil || rep.Request.Result != nil || rep.Request.Key == "" {
		t.Fatalf("status of r1 after the restart: %+v", rep)
	}
	var cr v1.CancelReply
	tenantAPI(t, acme.pub, "acme", v1.APICancelSubject("acme"), r2.RequestID, &cr)
	if !cr.Canceled || cr.Requests != 1 {
		t.Fatalf("cancel of r2 after the restart: %+v", cr)
	}
	if got := waitResult(t, acme.results, r2.RequestID, 20*time.Second); got.Status != v1.StatusCanceled {
		t.Fatalf("r2: %+v", got)
	}
	// The build in flight across the restart ends with one result.
	backend.open(r1.ContextDigest)
	got1 := waitResult(t, acme.results, r1.RequestID, 20*time.Second)
	if got1.Status != v1.StatusSucceeded || got1.Origin != v1.OriginBuild {
		t.Fatalf("r1: %+v", got1)
	}
	if got := waitResult(t, globex.results, g1.RequestID, 20*time.Second); got.Status != v1.StatusSucceeded || got.Digest != got1.Digest ||
		got.Origin != v1.OriginInflight || !strings.Contains(got.Image, "/globex/") {
		t.Fatalf("globex's request that waited on acme's build: %+v", got)
	}
	if n := backend.runs(r1.ContextDigest); n != 1 {
		t.Errorf("r1's content built %d times", n)
	}
	// New requests of every tenant, through the request import, after the
	// restart; and the SDK's Wait (subscription, then status) sees them.
	var ids []string
	for _, name := range m.tenants {
		tn := tenants[name]
		r := tenantRequest(t, store, name, "after the restart, "+name)
		backend.open(r.ContextDigest)
		publishRetrying(t, tn.pub, r)
		wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
		res, err := tn.pub.Wait(wctx, name, "web", r.RequestID, time.Time{})
		wcancel()
		if err != nil || res.Data.Status != v1.StatusSucceeded {
			t.Fatalf("%s's request after the restart: %+v %v", name, res, err)
		}
		ids = append(ids, name+"/"+r.RequestID)
	}
	// Each request has one stored result, and every publish of it that a
	// tenant saw says the same; no tenant saw another's.
	time.Sleep(300 * time.Millisecond)
	wjs, err := jetstream.New(wnc)
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer scancel()
	st, err := wjs.Stream(sctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(sctx)
	if err != nil {
		t.Fatal(err)
	}
	stored := map[string]int{}
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		msg, err := st.GetMsg(sctx, seq)
		if err != nil {
			continue
		}
		stored[msg.Header.Get(v1.MsgIDHeader)]++
	}
	for _, id := range append([]string{"acme/" + r1.RequestID, "acme/" + r2.RequestID, "globex/" + g1.RequestID}, ids...) {
		if stored[id] != 1 {
			t.Errorf("result %s stored %d times (stream: %v)", id, stored[id], stored)
		}
	}
	if len(stored) != 3+len(m.tenants) {
		t.Errorf("results stored: %v", stored)
	}
	for name, tn := range tenants {
		for _, s := range tn.results.subjects() {
			if !strings.HasPrefix(s, v1.ResultsPrefix+"."+name+".") {
				t.Errorf("%s received %s", name, s)
			}
		}
		tn.results.mu.Lock()
		for id, ds := range tn.results.byID {
			for _, d := range ds[1:] {
				if d.Status != ds[0].Status || d.Reason != ds[0].Reason || d.Digest != ds[0].Digest || d.Origin != ds[0].Origin {
					t.Errorf("%s: two different results of %s: %+v, %+v", name, id, ds[0], d)
				}
			}
		}
		tn.results.mu.Unlock()
	}
}

func TestRestartFileModeWithWorker(t *testing.T) {
	t.Parallel()
	tenants := []string{"acme", "globex"}
	keys, err := NewUserKeys(Users(tenants))
	if err != nil {
		t.Fatal(err)
	}
	conf, err := ServerConfig(ConfigOptions{Tenants: tenants, NKeys: PublicKeys(keys)})
	if err != nil {
		t.Fatal(err)
	}
	opts := seedFiles(t, keys)
	runRestart(t, restartMode{conf: conf, tenants: tenants, auth: func(u string) nats.Option { return opts[u] }})
}

// JWT mode, with a tenant (initech) added to the running server by a push
// and never written into the configuration the server restarts with: the
// full resolver keeps its JWT, and its imports come back with it.
func TestRestartJWTModeWithWorkerAndAPushedTenant(t *testing.T) {
	t.Parallel()
	s, err := NewJWTSetup([]string{"acme", "globex"})
	if err != nil {
		t.Fatal(err)
	}
	conf, err := s.ServerConfig(filepath.Join(t.TempDir(), "jwt"))
	if err != nil {
		t.Fatal(err)
	}
	creds := map[string]nats.Option{}
	auth := func(u string) nats.Option {
		if o, ok := creds[u]; ok {
			return o
		}
		creds[u] = credsOption(t, s, u)
		return creds[u]
	}
	runRestart(t, restartMode{
		conf: conf, tenants: []string{"acme", "globex", "initech"}, auth: auth,
		afterStart: func(t *testing.T, url string) {
			added, err := s.AddTenants([]string{"initech"})
			if err != nil {
				t.Fatal(err)
			}
			sys := connect(t, url, "sys", auth(SysKey))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := PushAccount(ctx, sys.nc, added[0].JWT); err != nil {
				t.Fatal(err)
			}
		},
	})
}
