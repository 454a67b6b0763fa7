package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// A request published without its Nats-Msg-Id header is refused under its
// body's request id, and that refusal is the id's one result: its entry
// is written with it. These tests came from an attack on the `final`
// mark and the status service's reads of the stored results.

// publishHeaderless publishes req as a producer that forgot the header.
func (e *env) publishHeaderless(t *testing.T, req *v1.Request) {
	t.Helper()
	req.APIVersion, req.SubmittedAt = v1.APIVersion, time.Now().UTC()
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(v1.RequestSubject(req.Tenant))
	m.Data = b
	if err := e.nc.PublishMsg(m); err != nil {
		t.Fatal(err)
	}
}

// narrowResultsWindow narrows the results stream's duplicate window to a
// second, so a test can send an id again past it.
func (e *env) narrowResultsWindow(t *testing.T) {
	t.Helper()
	e.narrowDuplicateWindow(t, v1.ResultsStream)
}

// narrowDuplicateWindow narrows stream's duplicate window to a second.
func (e *env) narrowDuplicateWindow(t *testing.T, stream string) {
	t.Helper()
	ctx := context.Background()
	st, err := e.js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.Duplicates = time.Second
	if _, err := e.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}

// resendPastTheWindow sends a request of id again, properly, past the
// narrowed duplicate window, and checks that it is the id's duplicate:
// nothing built, and still one result stored under the id.
func (e *env) resendPastTheWindow(t *testing.T, id string) {
	t.Helper()
	time.Sleep(1500 * time.Millisecond)
	again := request(id)
	again.RequestID = id
	if _, err := e.pub.Publish(context.Background(), again); err != nil {
		t.Fatal(err)
	}
	e.atkSettled(t, 15*time.Second)
	if n := len(e.jobs()); n != 0 {
		t.Fatalf("%d Jobs for a request id that has its one result", n)
	}
	var stored []string
	for _, r := range e.resultsStoredFor(id) {
		stored = append(stored, string(r.Data.Status)+"/"+r.Data.Reason)
	}
	if len(stored) != 1 {
		t.Fatalf("%d results stored under request %s's Nats-Msg-Id: %v, want the first alone", len(stored), id, stored)
	}
}

// The same id sent again properly, after the results stream's duplicate
// window (narrowed to a second here), is the refusal's duplicate: nothing
// is built and no second result is stored under the id. Before the
// refusal had an entry, the new message opened one, was built, and its
// result was stored beside the refusal.
func TestAHeaderlessRequestsRefusalIsItsIDsOneResultPastTheWindow(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	e.narrowResultsWindow(t)
	const id = "headerless-window"
	bad := request(id)
	bad.RequestID = id
	e.publishHeaderless(t, bad)
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest {
		t.Fatalf("the header-less request: %s", mustJSON(t, r))
	}
	e.resendPastTheWindow(t, id)
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	got, err := e.pub.Wait(wctx, "acme", "web", id, time.Time{})
	if err != nil || got.Data.Status != v1.StatusFailed {
		t.Fatalf("publisher.Wait = %+v, %v; want the stored refusal", got, err)
	}
}

// A producer that waits on the id after its refusal was stored gets it:
// the status service answers from the refusal's entry. Before, it
// answered "no request is known", Wait took that as undecided, and
// waited for a result stored before it subscribed.
func TestWaitGetsAHeaderlessRequestsStoredRefusal(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	const id = "headerless-wait"
	bad := request(id)
	bad.RequestID = id
	e.publishHeaderless(t, bad)
	stored := results.waitFor(t, 1, 10*time.Second)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := e.pub.Wait(ctx, "acme", "web", id, time.Time{})
	if err != nil {
		t.Fatalf("publisher.Wait: %v; the request's stored result is %s (%s)", err, stored.Data.Status, stored.Data.Reason)
	}
	if got.Data.Status != stored.Data.Status || got.Data.Reason != stored.Data.Reason {
		t.Fatalf("Wait returned %s/%s, stored %s/%s", got.Data.Status, got.Data.Reason, stored.Data.Status, stored.Data.Reason)
	}
}

// The same id sent properly after its refusal, for content already
// built, is a cache hit at intake — and the id's duplicate: no entry is
// created decided (and marked final) over the stored refusal. Before, the
// hit's entry said "succeeded", final, while the stream held "failed";
// with the hit's adopting write lost, status, the cancel's reply and
// publisher.Wait all said "succeeded".
func TestAHitOfAnIDRefusedWithoutItsHeaderIsItsDuplicate(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	const id = "headerless-hit"
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) { losePublishedMarks(w, "acme", id, always) })
	results := e.collect()
	e.buildThrough(t, tr, results, request(id), 1)
	bad := request(id)
	bad.RequestID = id
	e.publishHeaderless(t, bad)
	refusal := byID(results.waitFor(t, 2, 10*time.Second))[id]
	if len(refusal) != 1 || refusal[0].Data.Status != v1.StatusFailed {
		t.Fatalf("the header-less request's result: %s", mustJSON(t, refusal))
	}

	good := request(id)
	good.RequestID = id
	if _, err := e.pub.Publish(context.Background(), good); err != nil {
		t.Fatal(err)
	}
	e.atkSettled(t, 10*time.Second)
	if ent := e.ledgerEntry("acme", id); ent == nil || ent.Result == nil || ent.Result.Status != v1.StatusFailed {
		t.Fatalf("the id's entry: %s, want the refusal", mustJSON(t, ent))
	}
	if rep := cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), id); rep.Canceled || rep.Message != "the request already has its result: failed" {
		t.Fatalf("cancel reply %+v, want the refusal named", rep)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := e.pub.Wait(ctx, "acme", "web", id, time.Time{})
	if err != nil || got.Data.Status != v1.StatusFailed {
		t.Fatalf("publisher.Wait = %+v, %v; want the stored refusal", got, err)
	}
	if stored := e.resultsStoredFor(id); len(stored) != 1 {
		t.Fatalf("%d results stored for %s, want one", len(stored), id)
	}
}

// A message whose header names no usable id is refused under a generated
// id, invalid-<its stream sequence>, which keeps no ledger entry. No
// request may take that id: the SDK refuses it before sending, and a
// message that names it anyway is refused under a generated id of its
// own — so the first message's refusal is never another request's
// answer, and the id never gets a second result. (Before, a request of
// that id was built, and its result, a duplicate of the refusal, was
// dropped for it.)
func TestNoRequestTakesAnIDGivenToAnUnreadableMessage(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()
	publishNamed := func(req *v1.Request, header string) uint64 {
		t.Helper()
		req.APIVersion, req.SubmittedAt = v1.APIVersion, time.Now().UTC()
		b, err := json.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, header)
		m.Data = b
		ack, err := e.js.PublishMsg(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	broken := request("unreadable")
	broken.RequestID = "unreadable"
	id := fmt.Sprintf("%s%d", v1.GeneratedIDPrefix, publishNamed(broken, "acme/"))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.RequestID != id || r.Data.Reason != v1.ReasonInvalidRequest {
		t.Fatalf("the unreadable message's refusal: %s, want it under %s", mustJSON(t, r), id)
	}

	good := request("unreadable")
	good.RequestID = id
	if _, err := e.pub.Publish(ctx, good); err == nil || !strings.Contains(err.Error(), v1.GeneratedIDPrefix) {
		t.Fatalf("the SDK publishing a request of the generated id %s: %v; want it refused before sending", id, err)
	}
	// Sent anyway, by hand, with a header naming the id.
	seq := publishNamed(good, "acme/"+id)
	own := fmt.Sprintf("%s%d", v1.GeneratedIDPrefix, seq)
	r := byID(results.waitFor(t, 2, 10*time.Second))[own]
	if len(r) != 1 || r[0].Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(r[0].Data.Message, v1.GeneratedIDPrefix) {
		t.Fatalf("the request naming %s: results under %s %s, want its refusal, naming the reserved prefix", id, own, mustJSON(t, r))
	}
	e.atkSettled(t, 10*time.Second)
	if n := len(e.jobs()); n != 0 {
		t.Fatalf("%d Jobs built", n)
	}
	if stored := e.resultsStoredFor(id); len(stored) != 1 || stored[0].Data.Message != results.snapshot()[0].Data.Message {
		t.Fatalf("results stored under %s: %s, want the unreadable message's refusal alone", id, mustJSON(t, stored))
	}
}

// A request given up on before it had its entry (the ledger failing on
// every delivery) gets its result only once that result is in a new
// entry of its id; until the entry can be written it is tried again. So
// the same id sent again past the duplicate window is the entry's
// duplicate: not built, no second result. (Before, the give-up result
// was published with no entry, and the id was built again.)
func TestAResultGivenUpOnIsWrittenIntoItsIDsEntryFirst(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	const id = "given-up"
	lk := RequestIndexKey("acme", id)
	var creates atomic.Int32
	e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.MaxDeliver = 2 }, nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onCreate: func(k string, _ []byte) error {
			// Every create of the id fails through both deliveries and
			// the give-up's first try at its entry.
			if k == lk && creates.Add(1) <= 3 {
				return errors.New("ledger unavailable (fault injection)")
			}
			return nil
		}})
	})
	results := e.collect()
	ctx := context.Background()
	e.narrowResultsWindow(t)
	req := request(id)
	req.RequestID = id
	if _, err := e.pub.Publish(ctx, req); err != nil {
		t.Fatal(err)
	}
	first := results.waitFor(t, 1, 30*time.Second)[0]
	if first.Data.Status != v1.StatusFailed || first.Data.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("the request given up on: %s", mustJSON(t, first))
	}
	if n := creates.Load(); n <= 3 {
		t.Fatalf("the result went out after %d creates of its entry, all failed: published with no entry", n)
	}
	if ent := e.ledgerEntry("acme", id); ent == nil || ent.Result == nil || ent.Result.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("the id's entry: %s, want the give-up result", mustJSON(t, ent))
	}
	e.resendPastTheWindow(t, id)
}
