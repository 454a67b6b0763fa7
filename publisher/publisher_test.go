package publisher_test

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

func setup(t *testing.T, withStreams bool) (*publisher.Client, jetstream.JetStream) {
	t.Helper()
	_, nc, js := testnats.JetStream(t)
	if withStreams {
		if _, _, err := worker.EnsureStreams(context.Background(), js, worker.Config{}); err != nil {
			t.Fatal(err)
		}
	}
	c, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return c, js
}

func request() *v1.Request {
	d := strings.Repeat("d", 64)
	return &v1.Request{
		Tenant: "acme", Name: "web",
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
	}
}

func TestPublishIsDeduplicatedByRequestID(t *testing.T) {
	t.Parallel()
	c, js := setup(t, true)
	ctx := context.Background()
	req := request()
	first, err := c.Publish(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if req.RequestID == "" || req.APIVersion != v1.APIVersion {
		t.Fatalf("defaults not filled: %+v", req)
	}
	again, err := c.Publish(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if first.Duplicate || !again.Duplicate || again.Sequence != first.Sequence {
		t.Fatalf("first %+v again %+v", first, again)
	}
	s, _ := js.Stream(ctx, v1.RequestsStream)
	info, _ := s.Info(ctx)
	if info.State.Msgs != 1 {
		t.Fatalf("%d messages stored, want 1", info.State.Msgs)
	}
	msg, err := s.GetMsg(ctx, first.Sequence)
	if err != nil {
		t.Fatal(err)
	}
	if h := msg.Header.Get("Nats-Msg-Id"); msg.Subject != "buildq.requests.acme" || !strings.HasPrefix(h, v1.MsgID("acme", req.RequestID)+"/") || !v1.MsgIDMatches(h, "acme", req.RequestID) {
		t.Fatalf("subject %q header %v", msg.Subject, msg.Header)
	}
	if got, err := v1.DecodeRequest(msg.Data); err != nil || got.RequestID != req.RequestID {
		t.Fatalf("stored request does not decode: %v", err)
	}
}

func TestPublishRefusesInvalidRequest(t *testing.T) {
	t.Parallel()
	c, _ := setup(t, true)
	req := request()
	req.Tenant = "a.b"
	if _, err := c.Publish(context.Background(), req); !errors.Is(err, v1.ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
}

func TestPublishWithoutStreamsSaysStartAWorker(t *testing.T) {
	t.Parallel()
	c, _ := setup(t, false)
	_, err := c.Publish(context.Background(), request())
	if !errors.Is(err, publisher.ErrNoWorkers) {
		t.Fatalf("err = %v, want ErrNoWorkers", err)
	}
}

func TestWaitAndWatch(t *testing.T) {
	t.Parallel()
	c, js := setup(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	publishResult := func(tenant, name, id string) {
		ev := v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: tenant, Name: name, Status: v1.StatusSucceeded}, time.Now())
		b, _ := jsonMarshal(ev)
		// As a worker publishes it: into BUILDQ_RESULTS, which stores
		// and publishes it on its result subject.
		m := nats.NewMsg(v1.ResultsIngestPrefix + "." + tenant + "." + name)
		m.Header.Set(v1.MsgIDHeader, id)
		m.Data = b
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	// The status service, as a worker answers it: the ledger entry with
	// its decided result.
	decided := map[string]v1.ResultData{}
	var asked atomic.Int32
	nc := js.Conn()
	if _, err := nc.Subscribe(v1.APIStatusSubject("acme"), func(m *nats.Msg) {
		asked.Add(1)
		id := string(m.Data)
		rep := v1.StatusReply{Error: "no request " + id}
		if d, ok := decided[id]; ok {
			rep = v1.StatusReply{Key: d.Key, Request: &v1.RequestEntry{RequestID: id, Tenant: d.Tenant, Name: d.Name,
				State: string(d.Status), Worker: "w1", Result: &d, Published: true}}
		}
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
	}); err != nil {
		t.Fatal(err)
	}
	publishResult("acme", "web", "r1")
	decided["r1"] = v1.ResultData{RequestID: "r1", Tenant: "acme", Name: "web", Key: "k1", Status: v1.StatusSucceeded, Digest: "sha256:1"}
	publishResult("acme", "api", "r2")
	publishResult("other", "web", "r3")

	// Wait finds a result decided before it subscribed, through the
	// status service (not by replaying the stream).
	r, err := c.Wait(ctx, "acme", "web", "r1", time.Time{})
	if err != nil || r.ID != "r1" || r.Data.Digest != "sha256:1" || r.Source != "/buildq/worker/w1" || r.Type != v1.ResultType(v1.StatusSucceeded) {
		t.Fatalf("wait r1: %v %+v", err, r)
	}
	// Wait also gets one published later, on its subscription.
	done := make(chan *v1.Result, 1)
	go func() {
		r, err := c.Wait(ctx, "acme", "web", "r4", time.Now().Add(-time.Minute))
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	eventually(t, func() bool { return asked.Load() == 2 })
	publishResult("acme", "web", "r4")
	if r := <-done; r == nil || r.ID != "r4" {
		t.Fatalf("late result: %+v", r)
	}
	// A result nobody publishes: Wait ends with its context.
	sctx, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer scancel()
	if r, err := c.Wait(sctx, "acme", "web", "r9", time.Time{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait for a result never published: %v %+v", err, r)
	}

	// Watch filters by tenant.
	var ids []string
	wctx, wcancel := context.WithTimeout(ctx, time.Second)
	defer wcancel()
	err = c.Watch(wctx, publisher.Filter{Tenant: "acme", DeliverAll: true}, func(r v1.Result) error {
		ids = append(ids, r.ID)
		if len(ids) == 3 {
			return publisher.ErrStop
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(ids, ",") != "r1,r2,r4" {
		t.Fatalf("watched %v", ids)
	}
	if err := c.Watch(ctx, publisher.Filter{Tenant: "a.*"}, func(v1.Result) error { return nil }); err == nil {
		t.Fatal("bad tenant filter accepted")
	}
}

// TestWaitLeavesNothingRunning: a Wait that returns on its subscription
// while its question to the status service is still unanswered stops
// asking. Nothing it started runs on after it, under a context that may
// never end, to ask again later (not parallel: it counts the package's
// goroutines).
func TestWaitLeavesNothingRunning(t *testing.T) {
	c, js := setup(t, true)
	nc := js.Conn()
	// A status service that takes the question and never answers.
	asked := make(chan struct{}, 1)
	if _, err := nc.Subscribe(v1.APIStatusSubject("acme"), func(*nats.Msg) {
		select {
		case asked <- struct{}{}:
		default:
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	published := make(chan struct{})
	go func() {
		defer close(published)
		<-asked
		publishResult(t, js, "r1")
	}()
	// No deadline, as a producer may call it.
	r, err := c.Wait(context.Background(), "acme", "web", "r1", time.Time{})
	if err != nil || r.ID != "r1" {
		t.Fatalf("wait: %v %+v", err, r)
	}
	// Wait may see the result before its publisher has its PubAck; the
	// connection must outlive that publish.
	<-published
	waiting := func() int {
		buf := make([]byte, 1<<20)
		return strings.Count(string(buf[:runtime.Stack(buf, true)]), "created by github.com/buildq/buildq/publisher.(*Client).Wait")
	}
	eventually(t, func() bool { return waiting() == 0 })
}

// TestImportDoesNotPullKubernetes checks the promise of the package doc:
// a producer that imports publisher does not build k8s.io/* packages.
func TestImportDoesNotPullKubernetes(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/buildq/buildq/publisher", "github.com/buildq/buildq/api/v1").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "k8s.io/") || strings.HasPrefix(p, "sigs.k8s.io/") || strings.Contains(p, "buildq/worker") || strings.Contains(p, "buildq/internal") {
			t.Errorf("publisher depends on %s", p)
		}
	}
}

func jsonMarshal(v any) ([]byte, error) { return json.Marshal(v) }

func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestTenantPermissions runs the SDK as a tenant whose NATS user may only
// publish its requests and status queries and subscribe to its results
// and its own inbox (as in deploy/nats): Publish, Wait and Follow work
// with the tenant's inbox prefix; Watch (the JetStream API) is refused.
func TestTenantPermissions(t *testing.T) {
	t.Parallel()
	tenantPerms := &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: []string{"buildq.requests.acme", "buildq.api.status.acme", "buildq.api.cancel.acme", "buildq.cancel.acme.>"}},
		Subscribe: &server.SubjectPermission{Allow: []string{"buildq.results.acme.>", "buildq.events.acme.>", publisher.InboxPrefix("acme") + ".>"}},
	}
	srv := testnats.Start(t, testnats.Config{Configure: func(o *server.Options) {
		o.Users = []*server.User{{Username: "admin", Password: "admin-pw"}, {Username: "acme", Password: "acme-pw", Permissions: tenantPerms}}
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	admin, err := nats.Connect(srv.URL(), nats.UserInfo("admin", "admin-pw"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	ajs, _ := jetstream.New(admin)
	if _, _, err := worker.EnsureStreams(ctx, ajs, worker.Config{}); err != nil {
		t.Fatal(err)
	}
	// A fake worker: answers status queries and publishes each request's
	// result.
	var decided atomic.Pointer[v1.ResultData]
	if _, err := admin.Subscribe(v1.APIStatusSubject("acme"), func(m *nats.Msg) {
		rep := v1.StatusReply{Error: "unknown"}
		if d := decided.Load(); d != nil && d.RequestID == string(m.Data) {
			rep = v1.StatusReply{Request: &v1.RequestEntry{RequestID: d.RequestID, Tenant: "acme", Name: d.Name, State: string(d.Status), Result: d}}
		}
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
	}); err != nil {
		t.Fatal(err)
	}
	answer := func(req *v1.Request) {
		d := v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Status: v1.StatusSucceeded, Digest: "sha256:" + req.RequestID}
		decided.Store(&d)
		b, _ := json.Marshal(v1.NewResult("/test", d, time.Now()))
		m := nats.NewMsg(v1.ResultsIngestPrefix + "." + req.Tenant + "." + req.Name)
		m.Header.Set(v1.MsgIDHeader, v1.MsgID(req.Tenant, req.RequestID))
		m.Data = b
		if _, err := ajs.PublishMsg(ctx, m); err != nil {
			t.Error(err)
		}
	}
	connect := func(opts ...nats.Option) *publisher.Client {
		nc, err := nats.Connect(srv.URL(), append([]nats.Option{nats.UserInfo("acme", "acme-pw"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		c, err := publisher.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	c := connect(nats.CustomInboxPrefix(publisher.InboxPrefix("acme")))

	// Publish: the PubAck comes back on the tenant's inbox.
	req := request()
	if _, err := c.Publish(ctx, req); err != nil {
		t.Fatalf("publish as the tenant: %v", err)
	}
	// Wait, result decided before it is called: through the status service.
	answer(req)
	r, err := c.Wait(ctx, "acme", "web", req.RequestID, time.Time{})
	if err != nil || r.ID != req.RequestID {
		t.Fatalf("wait (decided before): %v %+v", err, r)
	}
	// Follow and Wait, result published later: on the subscription.
	req2 := request()
	if _, err := c.Publish(ctx, req2); err != nil {
		t.Fatal(err)
	}
	followed := make(chan string, 1)
	// No deadline, as `buildq watch` runs it.
	fctx, fcancel := context.WithCancel(context.Background())
	defer fcancel()
	followErr := make(chan error, 1)
	go func() {
		followErr <- c.Follow(fctx, publisher.Filter{Tenant: "acme"}, func(r v1.Result) error {
			followed <- r.ID
			return publisher.ErrStop
		})
	}()
	waited := make(chan *v1.Result, 1)
	go func() {
		r, err := c.Wait(ctx, "acme", "web", req2.RequestID, time.Time{})
		if err != nil {
			t.Error(err)
		}
		waited <- r
	}()
	time.Sleep(200 * time.Millisecond)
	answer(req2)
	if r := <-waited; r == nil || r.ID != req2.RequestID {
		t.Fatalf("wait (published later): %+v", r)
	}
	if id := <-followed; id != req2.RequestID {
		t.Fatalf("follow saw %s", id)
	}
	if err := <-followErr; err != nil {
		t.Fatal(err)
	}

	// Refused: following every tenant's results, replaying the stream.
	if err := c.Follow(ctx, publisher.Filter{}, func(v1.Result) error { return nil }); !errors.Is(err, nats.ErrPermissionViolation) {
		t.Fatalf("follow all tenants: %v, want a permissions violation", err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
	defer wcancel()
	if err := c.Watch(wctx, publisher.Filter{Tenant: "acme", DeliverAll: true}, func(v1.Result) error { return nil }); err == nil {
		t.Fatal("Watch (the JetStream API) worked under tenant permissions")
	}
	// Without the tenant's inbox prefix the PubAck cannot come back.
	bare := connect()
	pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
	defer pcancel()
	if _, err := bare.Publish(pctx, request()); err == nil {
		t.Fatal("publish without the tenant's inbox prefix got its PubAck")
	}
}

// The request's Nats-Msg-Id carries a nonce: stable for one client's
// retries (JetStream still dedupes them), unpredictable to anyone else, so
// no other tenant can publish a request's header first.
func TestRequestMsgIDIsUnpredictable(t *testing.T) {
	t.Parallel()
	_, js := setup(t, true)
	nc := js.Conn()
	a, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	b, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	req := func(id string) *v1.Request {
		r := request()
		r.RequestID = id
		return r
	}
	first, err := a.Publish(ctx, req("same-id"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := a.Publish(ctx, req("same-id"))
	if err != nil || !again.Duplicate || again.Sequence != first.Sequence {
		t.Fatalf("a retry from the same client was not deduped: %+v %v", again, err)
	}
	other, err := b.Publish(ctx, req("same-id"))
	if err != nil || other.Duplicate {
		t.Fatalf("another client's header for the same id was predictable: %+v %v", other, err)
	}
}

// TestWaitSendsNothingOnceItReturned: Wait's ask of the status service runs
// beside its subscription. When the result comes on the subscription
// first, the ask that was about to go is not sent after Wait returned (a
// tenant API's spy, or the caller's next step, would otherwise see a
// question nobody is waiting for).
func TestWaitSendsNothingOnceItReturned(t *testing.T) {
	c, js := setup(t, true)
	nc := js.Conn()
	status, err := nc.SubscribeSync(v1.APIStatusSubject("acme"))
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	asking, release := make(chan struct{}, 1), make(chan struct{})
	defer publisher.SetWaitAsking(func() {
		select {
		case asking <- struct{}{}:
		default:
		}
		<-release
	})()
	go func() {
		// The result comes while Wait's first ask is about to go; the
		// ask goes on only once Wait had the result a while.
		<-asking
		publishResult(t, js, "r1")
		time.Sleep(200 * time.Millisecond)
		close(release)
	}()
	r, err := c.Wait(context.Background(), "acme", "web", "r1", time.Time{})
	if err != nil || r.ID != "r1" {
		t.Fatalf("wait: %v %+v", err, r)
	}
	// Anything Wait sent is with the server once the flush returns, and
	// its delivery to the spy before the flush's answer.
	select {
	case <-release:
	case <-time.After(10 * time.Second):
		t.Fatal("the result was never published")
	}
	time.Sleep(100 * time.Millisecond)
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if n, _, _ := status.Pending(); n != 0 {
		m, _ := status.NextMsg(0)
		t.Fatalf("the status service was asked %d time(s) after Wait returned: %s", n, m.Data)
	}
}

// TestWaitReturnsOnlyOnceItsAskIsSent: an ask that had passed its last
// check when the result came is sent before Wait returns, never after.
func TestWaitReturnsOnlyOnceItsAskIsSent(t *testing.T) {
	c, js := setup(t, true)
	var (
		returned, late atomic.Bool
		once           sync.Once
	)
	sending, release, checked := make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	defer publisher.SetTenantRequestSending(func() {
		select {
		case sending <- struct{}{}:
		default:
		}
		<-release
		once.Do(func() {
			late.Store(returned.Load())
			close(checked)
		})
	})()
	go func() {
		<-sending
		publishResult(t, js, "r1")
		time.Sleep(200 * time.Millisecond)
		close(release)
	}()
	r, err := c.Wait(context.Background(), "acme", "web", "r1", time.Time{})
	returned.Store(true)
	if err != nil || r.ID != "r1" {
		t.Fatalf("wait: %v %+v", err, r)
	}
	select {
	case <-checked:
	case <-time.After(10 * time.Second):
		t.Fatal("Wait's ask never reached its send")
	}
	if late.Load() {
		t.Fatal("Wait returned while its ask was still to be sent")
	}
}

// publishResult stores a succeeded result of acme/web's request id as a
// worker would (t.Error on failure: it may run in a goroutine).
func publishResult(t *testing.T, js jetstream.JetStream, id string) {
	b, _ := json.Marshal(v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: "acme", Name: "web", Status: v1.StatusSucceeded}, time.Now()))
	m := nats.NewMsg(v1.ResultsIngestPrefix + ".acme.web")
	m.Header.Set(v1.MsgIDHeader, id)
	m.Data = b
	if _, err := js.PublishMsg(context.Background(), m); err != nil {
		t.Error(err)
	}
}
