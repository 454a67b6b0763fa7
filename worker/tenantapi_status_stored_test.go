package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// A finished build's result is published first (succeeded, stored); its
// record is lost (a KV write that failed). A cancel then records
// "canceled" before its own publish, which the stream answers as a
// duplicate of the stored succeeded; the cancel's adopt write is lost as
// well. The entry holds "canceled", unpublished, while the stored result is
// "succeeded". The status service answers an entry with a result as it
// stands, without looking at what was stored: publisher.Wait, asking the
// status once after it subscribed (the result went out before), returns
// "canceled".
//
// A recorded decision is no longer final once results are published
// first: status shows what the stream stored, and Wait takes what status
// shows. (Found by an attack on the publish-first rule.)
func TestStatusNeverShowsARecordedDecisionTheStreamDidNotStore(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("attack2-status")
	req.RequestID = "attack2-status"
	var released atomic.Bool
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		losePublishedMarks(w, req.Tenant, req.RequestID, func() bool { return !released.Load() })
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	stored := results.waitFor(t, 1, 10*time.Second)[0]
	if stored.Data.Status != v1.StatusSucceeded {
		t.Fatalf("stored %s, want succeeded", mustJSON(t, stored))
	}
	rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), req.RequestID)
	if rep.Canceled || !strings.HasSuffix(rep.Message, "already has its result: succeeded") {
		t.Fatalf("cancel reply %+v, want the stored result named: succeeded", rep)
	}
	ent := e.ledgerEntry(req.Tenant, req.RequestID)
	t.Logf("entry: result %v published %v", ent.Result != nil && ent.Result.Status == v1.StatusCanceled, ent.Published)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := e.pub.Wait(ctx, req.Tenant, req.Name, req.RequestID, time.Time{})
	released.Store(true)
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	if n := len(e.resultsStoredFor(req.RequestID)); n != 1 {
		t.Fatalf("%d stored results", n)
	}
	if got.Data.Status != stored.Data.Status {
		t.Fatalf("publisher.Wait returned %s (from the status service), and the request's stored result is %s",
			got.Data.Status, stored.Data.Status)
	}
}

func (e *env) resultsStoredFor(id string) []v1.Result {
	var out []v1.Result
	for _, r := range e.resultsStored() {
		if r.Data.RequestID == id {
			out = append(out, r)
		}
	}
	return out
}

var _ = json.Marshal

// landThenHold lands one Update that hold selects, then holds its caller
// (a worker stalled, or killed, right after that write) until release.
type landThenHold struct {
	jetstream.KeyValue
	hold    func(key string, value []byte) bool
	held    chan struct{}
	release chan struct{}
	once    atomic.Bool
}

func (k *landThenHold) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	r, err := k.KeyValue.Update(ctx, key, value, rev)
	if err == nil && k.hold(key, value) && k.once.CompareAndSwap(false, true) {
		close(k.held)
		<-k.release
	}
	return r, err
}

// The same with one fault only: the handler's record of the result it
// published first is lost once (RecordError: retried later), and the
// cancel stalls right after its record of "canceled" lands, before its
// publish (a slow worker, or one killed there). Until the handler's retry,
// or the cancel's adopt, the entry holds "canceled" and status says so.
func TestStatusNeverShowsACancelsRecordBeforeItsPublish(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("attack2-status-2")
	req.RequestID = "attack2-status-2"
	lk := RequestIndexKey(req.Tenant, req.RequestID)
	var lost atomic.Bool
	hold := &landThenHold{held: make(chan struct{}), release: make(chan struct{}), hold: func(k string, value []byte) bool {
		return k == lk && bytes.Contains(value, []byte(`"status":"canceled"`)) && !bytes.Contains(value, []byte(`"published":true`))
	}}
	defer func() {
		select {
		case <-hold.release:
		default:
			close(hold.release)
		}
	}()
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		hold.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(&hookedKV{KeyValue: hold, onUpdate: func(k string, value []byte) error {
			if k == lk && bytes.Contains(value, []byte(`"published":true`)) && lost.CompareAndSwap(false, true) {
				return errors.New("write lost")
			}
			return nil
		}})
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	stored := results.waitFor(t, 1, 10*time.Second)[0]
	replied := make(chan v1.CancelReply, 1)
	go func() { replied <- cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), req.RequestID) }()
	select {
	case <-hold.held:
	case <-time.After(10 * time.Second):
		t.Fatal("the cancel did not record canceled")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := e.pub.Wait(ctx, req.Tenant, req.Name, req.RequestID, time.Time{})
	close(hold.release)
	t.Logf("cancel reply: %+v", <-replied)
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	if got.Data.Status != stored.Data.Status {
		t.Fatalf("publisher.Wait returned %s (from the status service), and the request's stored result is %s",
			got.Data.Status, stored.Data.Status)
	}
}

// A cache hit's entry is created with its decision and never marked
// published (its mark is written only when its ack fails): the decision
// is final as written (Final), and status shows it without reading the
// results stream.
func TestStatusShowsACacheHitsUnmarkedResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	built := e.buildThrough(t, tr, results, request("status-hit"), 1)
	hit := request("status-hit")
	hit.RequestID = "status-hit-again"
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	got := byID(results.waitFor(t, 2, 10*time.Second))[hit.RequestID]
	if len(got) != 1 || got[0].Data.Origin != v1.OriginCache || got[0].Data.Digest != built.Data.Digest {
		t.Fatalf("the hit: %s", mustJSON(t, got))
	}
	ent := e.ledgerEntry(hit.Tenant, hit.RequestID)
	if ent.Published || !ent.Final {
		t.Fatalf("the hit's entry: published %v, final %v; want unmarked and final", ent.Published, ent.Final)
	}
	m, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), hit.RequestID, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var rep v1.StatusReply
	if err := json.Unmarshal(m.Data, &rep); err != nil || rep.Request == nil || rep.Request.Result == nil || rep.Request.Result.Digest != built.Data.Digest {
		t.Fatalf("status of the hit: %s (%v)", m.Data, err)
	}
}
