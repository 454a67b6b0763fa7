package worker

// Handler (handle.go, process.go): a panic while handling a request is
// recovered; the request gets one failed/InfrastructureError result, is
// terminated, and wedges nothing — not the worker, not its key, not its
// tenant's later requests (docs/design.md §6).

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
)

// panicBackend panics in Run.
type panicBackend struct{}

func (panicBackend) Identity() string { return "panics" }

func (panicBackend) Run(context.Context, Build, Started) (Outcome, error) {
	panic("executor blew up")
}

func (panicBackend) Cleanup(context.Context, string, string) error { return nil }

// A request that panics the handler gets one failed result and is
// terminated; the worker goes on.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestPanicInTheHandlerFailsTheRequestOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	w, err := New(e.nc, panicBackend{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	results := e.collect()
	for _, seed := range []string{"panic-1", "panic-2"} {
		if _, err := e.pub.Publish(context.Background(), request(seed)); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range results.waitFor(t, 2, 10*time.Second) {
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInfrastructureError || !strings.Contains(r.Data.Message, "executor blew up") {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	eventually(t, 5*time.Second, "the requests to be terminated", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// panicOnceBackend panics in its first Run (a bug that depends on timing)
// and builds fine afterwards.
type panicOnceBackend struct{ runs atomic.Int32 }

func (*panicOnceBackend) Identity() string { return "panic-once" }

func (b *panicOnceBackend) Run(_ context.Context, bd Build, started Started) (Outcome, error) {
	if b.runs.Add(1) == 1 {
		panic("executor bug that shows once")
	}
	started("fake-"+bd.Run, true, bd.Request.RequestID)
	return Outcome{Succeeded: true, Digest: digestOf("panic-once"), Job: "fake-" + bd.Run, Run: bd.Run}, nil
}

func (*panicOnceBackend) Cleanup(context.Context, string, string) error { return nil }

// safeProcess turns a panic into a failed/InfrastructureError verdict but
// drops the ledger entry (le = nil), so handle() publishes that decision
// without storing it first. When the Term is lost (or the worker dies
// between the PubAck and the Term), the redelivery finds an entry with no
// decision and decides again — here the build works the second time.
//
// Interleaving:
//
//	delivery 1: ledger entry opened → claim → backend panics → recovered →
//	            failed/InfrastructureError published (not in the ledger) →
//	            Term lost
//	delivery 2: ledger has no decision → build (take-over of the claim the
//	            panicking handler never released) → succeeded published
//
// Breaks invariant 1 and the ledger's promise: one request, two different
// results published (the stream's duplicate window hides the second from
// stream readers for 10 minutes; after that it is stored too; the ledger
// and `buildq status` say succeeded while the stored result says failed).
//
// Origin: adversarial review of the issue-9 claim protocol, attack 2; failed on fa71058.
func TestRedeliveryAfterAPanicRepeatsItsResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	w, err := New(e.nc, &panicOnceBackend{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	req := request("panic-once")
	var lost atomic.Bool
	w.faults = &faultHooks{loseAck: func(id string) bool { return id == req.RequestID && lost.CompareAndSwap(false, true) }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	results := e.collect()

	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	first := results.waitFor(t, 1, 10*time.Second)[0]
	if first.Data.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("first result %s", mustJSON(t, first.Data))
	}
	eventually(t, 30*time.Second, "the redelivered request to be settled", func() bool {
		msgs, pending, _ := e.streamState()
		return lost.Load() && msgs == 0 && pending == 0
	})
	_ = e.nc.Flush()
	results.mu.Lock()
	defer results.mu.Unlock()
	n := 0
	for _, ds := range results.published { // keyed by Nats-Msg-Id
		for _, d := range ds {
			if d.RequestID != req.RequestID {
				continue
			}
			n++
			if decision(d) != decision(first.Data) {
				t.Fatalf("request %s got two different results:\n  %s\n  %s", req.RequestID, decision(first.Data), decision(d))
			}
		}
	}
	if n == 0 {
		t.Fatal("no publish of the result was seen")
	}
}

// panicHead is a registry client whose HEAD of an indexed image panics
// (a bug in the client, a nil map on an odd response).
type panicHead struct{}

func (panicHead) Head(_ context.Context, ref string) (string, error) {
	if strings.Contains(ref, "@sha256:") {
		panic("head: a registry client bug (" + ref + ")")
	}
	return "", errors.New("head: not used here")
}

func (panicHead) Copy(context.Context, string, string) (string, error) {
	return "", errors.New("copy: not used here")
}

func (panicHead) EnsureHarborProject(context.Context, string, string) error { return nil }
func (panicHead) PushIndex(context.Context, []registry.IndexChild, []string) (string, error) {
	return "", errors.New("push index: not used here")
}

// §2: "A panic while handling a request is recovered: the request gets
// one failed/InfrastructureError result and is terminated, and the
// worker goes on." checkIndexed runs a cache hit's registry HEAD inside
// singleflight's DoChan, which re-panics a panic of its function on a
// fresh goroutine, where nothing can recover it: unless the panic is
// carried back to the handler, the whole worker process dies, and every
// worker that takes the request dies the same way (a poison message).
// The test runs the worker in a child process.
//
// Origin: review of one publisher per recorded decision (1ba6b6a).
func TestPanicInTheSharedHeadFailsTheRequestOnce(t *testing.T) {
	if os.Getenv("BUILDQ_HEADPANIC_CHILD") == "" {
		t.Parallel()
		cmd := exec.Command(os.Args[0], "-test.run=^TestPanicInTheSharedHeadFailsTheRequestOnce$", "-test.count=1")
		cmd.Env = append(os.Environ(), "BUILDQ_HEADPANIC_CHILD=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			s := string(out)
			if i := strings.Index(s, "\npanic: "); i >= 0 {
				s = s[i+1 : min(len(s), i+1500)]
			} else if len(s) > 1500 {
				s = s[len(s)-1500:]
			}
			t.Fatalf("the worker process died on a panic in the registry HEAD of a cache hit (%v), where a handler's panic must give one failed result:\n%s", err, s)
		}
		return
	}
	e := setup(t)
	req := request("po-panic-head")
	req.RequestID = "po-panic"
	key := v1.BuildKey(req, kanikoID)
	const reg = "registry.test:5000"
	w := e.startWorker("w1", func(c *Config) {
		c.Registry = panicHead{}
		c.Naming = naming.Policy{Registry: reg}
	})
	results := e.collect()
	ctx := context.Background()
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateSucceeded, Run: "r0", RequestID: "earlier", Seq: 1,
		Tenant: "acme", Name: "web", Repository: reg + "/acme/web", Digest: digestOf("po-image"),
		Destinations: []string{reg + "/acme/web:" + v1.DefaultTag(key)}})
	if _, err := w.w.runs.Bucket().Put(ctx, key, rec); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 1, 20*time.Second)
	if d := got[0].Data; d.Status != v1.StatusFailed || d.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("result %s, want failed/InfrastructureError", decision(d))
	}
}

// Attack (a panic in the shared possession check wedges a tenant's
// content on the worker): checkPossession registers its read in
// possessions.inFlight (possession.go:121-126), runs provePossession
// (:128), and only then removes the entry and closes its done channel
// (:129-138). A panic in
// between — the S3 client, the archive verifier — skips both: the panic
// itself is recovered by safeProcess (that request gets one failed
// result), but the entry stays, and every later request of that tenant
// and digest on this worker waits on a done channel nobody will close
// (possession.go:112-119): no result, its slot held, its message
// heartbeaten (never redelivered elsewhere), until the worker stops. The
// registry HEAD, shared the same way, carries a panic to its callers
// (checkIndexed): the shared possession read must not do worse. Breaks
// invariant 1 (every accepted request gets its result).
//
// Origin: second hostile-tenant review, of 26b1795; failed there, fixed by 626123b.
func TestPossessionPanicDoesNotWedgeTheTenantsLaterRequests(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
	rw := e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a /a\n", "a": "acme"})
	a1 := tenantRequestFor("acme", digest)
	store.put(a1.Source.S3.Key, archive)
	key := v1.BuildKey(a1, kanikoID)

	store.panicOnce.Store(true)
	if _, err := e.pub.Publish(ctx, a1); err != nil {
		t.Fatal(err)
	}
	if r := oneResult(t, results, a1.RequestID); r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("the request whose check panicked: %s", mustJSON(t, r))
	}
	// The store works again. A later request of the same tenant and
	// content must be handled.
	a2 := tenantRequestFor("acme", digest)
	if _, err := e.pub.Publish(ctx, a2); err != nil {
		t.Fatal(err)
	}
	if r := e.resultPlayingKubelet(results, key, a2.RequestID, 10*time.Second); r == nil || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("a later request of acme for the same content got %s within 10s: "+
			"%d handler(s) wait on a possession read (its slot held, its message heartbeaten)",
			mustJSON(t, r), goroutinesIn(rw.w, "checkPossession", "provePossession"))
	}
}
