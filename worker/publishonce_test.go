package worker

// One publish of each request's result: a decision recorded and not yet
// marked published is published by its decider alone (a handler of a
// redelivered message, or another worker's sweep, waits), and by another
// worker only once it has stayed unmarked for the grace; and a panic in
// the registry HEAD shared by cache hits fails its requests, not the
// worker.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// slowMark delays the first write that marks one ledger entry published
// (a slow KV write, a GC pause between the PubAck and the mark): it
// widens the window between "decision recorded" and "marked published"
// in which any other reader of the entry publishes the result again.
type slowMark struct {
	jetstream.KeyValue
	key   string // ledger key
	delay time.Duration
	armed *atomic.Bool // shared between workers: only the first mark waits
}

func (s *slowMark) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if key == s.key && bytes.Contains(value, []byte(`"published":true`)) && s.armed.CompareAndSwap(true, false) {
		time.Sleep(s.delay)
	}
	return s.KeyValue.Update(ctx, key, value, rev)
}

// A settling pass is not the only way a worker publishes a parked
// request's result: a handler of any message of the request does too.
// Here the park's ack is lost (the fault the simulation injects with
// loseAck); the run ends, and the owner's settle pass records the parked
// request's decision and publishes it; before its published mark lands,
// the park message is redelivered to the same worker, whose handler finds
// the decision recorded and not marked. It must not publish it a second
// time.
func TestRedeliveredParkDoesNotRepublishBesideTheSettlePass(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("po-redelivered-park", "po-owner", "po-parked")
	armed := &atomic.Bool{}
	armed.Store(true)
	var lost atomic.Bool
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.AckWait = 3 * time.Second
	}, nil, func(w *Worker) {
		w.ledger.UseBucket(&slowMark{KeyValue: w.ledger.Bucket(), key: RequestIndexKey("acme", parked.RequestID), delay: 8 * time.Second, armed: armed})
		w.faults = &faultHooks{loseAck: func(id string) bool {
			return id == parked.RequestID && lost.CompareAndSwap(false, true) // the park's ack only
		}}
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the request parked, its ack lost", func() bool {
		return e.isParked(key, parked.RequestID) && lost.Load()
	})
	// The run ends now, well before the redelivery (AckWait 3 s).
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	time.Sleep(9 * time.Second) // past the slow mark
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times by one worker (its settle pass, and the handler of its redelivered message)", n)
	}
}

// The same race between two workers: every worker sweeps the waiter index
// every lease/2, and the sweep on another worker finds a parked request
// whose run ended while the owner's settle pass is between recording the
// decision and marking it published (the natural window is the owner's
// pass from the run's end to its mark, registry copies of every parked
// request's tags included). No fault but a slow write (shorter than the
// grace, 2 leases) is needed. The sweep must leave it to the owner.
func TestSweepOnAnotherWorkerDoesNotRepublishAParkedResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("po-two-workers", "po-owner2", "po-parked2")
	armed := &atomic.Bool{}
	armed.Store(true)
	hook := func(w *Worker) {
		w.ledger.UseBucket(&slowMark{KeyValue: w.ledger.Bucket(), key: RequestIndexKey("acme", parked.RequestID), delay: 3 * time.Second, armed: armed})
	}
	e.startWorkerHooked("w1", withRegistry(tr), nil, hook)
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held by w1", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	e.startWorkerHooked("w2", withRegistry(tr), nil, hook)
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		_, ackPending, _ := e.streamState()
		return e.isParked(key, parked.RequestID) && ackPending == 1
	})
	e.kubelet(job, 0, tr.push(t, destination(job)))
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	time.Sleep(4 * time.Second) // past the slow mark
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times (the owner's settle pass, and another worker's sweep)", n)
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

// §2: "A panic while handling a request is recovered: the request gets
// one failed/InfrastructureError result and is terminated, and the
// worker goes on." checkIndexed runs a cache hit's registry HEAD inside
// singleflight's DoChan, which re-panics a panic of its function on a
// fresh goroutine, where nothing can recover it: unless the panic is
// carried back to the handler, the whole worker process dies, and every
// worker that takes the request dies the same way (a poison message).
// The test runs the worker in a child process.
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

// stallAfterDecision passes every ledger write through, but the write
// that records the decision of one request's entry, once stored, never
// returns (a decider that hangs, or dies, between recording a result and
// publishing it) until the test ends.
type stallAfterDecision struct {
	jetstream.KeyValue
	key     string
	armed   *atomic.Bool
	stalled chan struct{}
	end     <-chan struct{}
}

func (s *stallAfterDecision) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	r, err := s.KeyValue.Update(ctx, key, value, rev)
	if err == nil && key == s.key && bytes.Contains(value, []byte(`"result":`)) && s.armed.CompareAndSwap(true, false) {
		close(s.stalled)
		<-s.end
		return 0, errors.New("stalled decider")
	}
	return r, err
}

// A decision whose decider stops between recording and publishing it is
// published by another worker once it stayed unmarked for the grace (2
// leases), exactly once, and the ledger names the taker.
func TestUnpublishedDecisionOfAStalledWorkerIsTakenOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	owner, parked, key := ownerAndParked("po-takeover", "po-owner3", "po-parked3")
	armed := &atomic.Bool{}
	armed.Store(true)
	end := make(chan struct{})
	t.Cleanup(func() { close(end) })
	stall := &stallAfterDecision{key: RequestIndexKey("acme", parked.RequestID), armed: armed, stalled: make(chan struct{}), end: end}
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		stall.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(stall)
	})
	results := e.collect()
	ctx := context.Background()
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	eventually(t, 5*time.Second, "the claim held by w1", func() bool { r := e.claim(key); return r != nil && r.Owner == "w1" })
	e.startWorkerHooked("w2", withRegistry(tr), nil, nil)
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the second request parked", func() bool {
		return e.isParked(key, parked.RequestID)
	})
	e.kubelet(job, 0, tr.push(t, destination(job)))
	select {
	case <-stall.stalled:
	case <-time.After(20 * time.Second):
		t.Fatal("w1 never recorded the parked request's decision")
	}
	stalledAt := time.Now()
	assertEnd(t, e, results, []*v1.Request{owner, parked}, 30*time.Second)
	if waited := time.Since(stalledAt); waited < 4*time.Second {
		t.Fatalf("the stalled decider's result was published by another worker after %v, before the grace of 2 leases (4s)", waited)
	}
	time.Sleep(2 * time.Second) // anything more would come now
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the parked request's result was published %d times, want once", n)
	}
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	ent, err := kv.Get(ctx, RequestIndexKey("acme", parked.RequestID))
	if err != nil {
		t.Fatal(err)
	}
	var got v1.RequestEntry
	if err := json.Unmarshal(ent.Value(), &got); err != nil {
		t.Fatal(err)
	}
	if got.Worker != "w2" || !got.Published || got.Result == nil {
		t.Fatalf("ledger entry after the take-over: worker %q, published %v, decided %v; want w2, true, true", got.Worker, got.Published, got.Result != nil)
	}
}

// isParked reports whether acme's request id has a parked waiter entry on
// key.
func (e *env) isParked(key, id string) bool {
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return false
	}
	ent, err := kv.Get(ctx, ledger.WaiterKey(key, "acme", id))
	if err != nil {
		return false
	}
	v, ok := ledger.ParseWaiter(ent.Value())
	return ok && v.Parked
}

// ownerAndParked is two requests for one build key: the first claims it,
// the second parks on its run.
func ownerAndParked(seed, ownerID, parkedID string) (owner, parked *v1.Request, key string) {
	owner, parked = request(seed), request(seed)
	owner.RequestID, parked.RequestID = ownerID, parkedID
	return owner, parked, v1.BuildKey(owner, kanikoID)
}
