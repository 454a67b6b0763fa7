package publisher_test

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

func setup(t *testing.T, withStreams bool) (*publisher.Client, jetstream.JetStream) {
	t.Helper()
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
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
	if msg.Subject != "buildq.requests.acme" || msg.Header.Get("Nats-Msg-Id") != v1.MsgID("acme", req.RequestID) {
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
		m := nats.NewMsg(v1.ResultSubject(tenant, name))
		m.Header.Set(v1.MsgIDHeader, id)
		m.Data = b
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	publishResult("acme", "web", "r1")
	publishResult("acme", "api", "r2")
	publishResult("other", "web", "r3")

	// Wait finds a result already stored.
	r, err := c.Wait(ctx, "acme", "web", "r1", time.Time{})
	if err != nil || r.ID != "r1" {
		t.Fatalf("wait r1: %v %+v", err, r)
	}
	// Wait also gets one published later.
	done := make(chan *v1.Result, 1)
	go func() {
		r, err := c.Wait(ctx, "acme", "web", "r4", time.Now().Add(-time.Minute))
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	time.Sleep(100 * time.Millisecond)
	publishResult("acme", "web", "r4")
	if r := <-done; r == nil || r.ID != "r4" {
		t.Fatalf("late result: %+v", r)
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
