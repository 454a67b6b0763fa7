package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// A finished build's result is published first and stored; its record is
// lost (the worker killed right after the PubAck, or the KV write failed:
// the entry stays undecided until a redelivery records it). Meanwhile
// the deployment stores more than recentMsgs (1,024) other results, and
// the same tenant's next result under the same name. The status service
// reads an undecided entry's stored result with Recent: the subject's
// last result (another request's), then the subject's results among the
// 1,024 stream messages before it — the request's is older, so status
// answers "no result". publisher.Wait subscribed after the result went
// out, and a redelivery's publish is a duplicate, which the stream does
// not republish: the subscription never sees it. Wait asks again now and
// then while status shows no result, so it returns the stored result
// once the redelivery has recorded it. (From an attack on the status
// service's bounded read: Wait asked once, and never returned.)
func TestWaitAsksAgainAndGetsAResultStatusCouldNotShowAtFirst(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("wait-asks-again")
	req.RequestID = "wait-asks-again"
	var lose atomic.Bool
	lose.Store(true)
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) { losePublishedMarks(w, req.Tenant, req.RequestID, lose.Load) })
	results := e.collect()
	stored := e.buildOnce(t, tr, results, req)
	if stored.Data.RequestID != req.RequestID {
		t.Fatalf("stored %s", mustJSON(t, stored))
	}

	// Other tenants' results (a busy deployment), then the tenant's next
	// result under the same name.
	for i := range recentMsgs + 100 {
		m := nats.NewMsg(v1.ResultsIngestPrefix + ".zeta.api")
		m.Header.Set(v1.MsgIDHeader, v1.MsgID("zeta", fmt.Sprintf("busy-%d", i)))
		m.Data = resultBody(t, "zeta", "api", fmt.Sprintf("busy-%d", i))
		if _, err := e.js.PublishMsgAsync(m); err != nil {
			t.Fatal(err)
		}
	}
	m := nats.NewMsg(v1.ResultsIngestPrefix + ".acme.web")
	m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", "wait-asks-again-next"))
	m.Data = resultBody(t, "acme", "web", "wait-asks-again-next")
	if _, err := e.js.PublishMsgAsync(m); err != nil {
		t.Fatal(err)
	}
	select {
	case <-e.js.PublishAsyncComplete():
	case <-time.After(60 * time.Second):
		t.Fatal("storing the results timed out")
	}
	ent := e.ledgerEntry(req.Tenant, req.RequestID)
	t.Logf("entry: state %s, result %v, published %v", ent.State, ent.Result != nil, ent.Published)

	sm, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), req.RequestID, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var rep v1.StatusReply
	_ = json.Unmarshal(sm.Data, &rep)
	t.Logf("status: %s", sm.Data)

	// Wait asks while the entry is undecided; then the record lands (the
	// redelivery's), and Wait's next question finds it.
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	type waited struct {
		r   *v1.Result
		err error
	}
	done := make(chan waited, 1)
	go func() {
		r, err := e.pub.Wait(ctx, req.Tenant, req.Name, req.RequestID, time.Time{})
		done <- waited{r, err}
	}()
	time.Sleep(time.Second)
	lose.Store(false)
	eventually(t, 20*time.Second, "the entry recorded by a redelivery", func() bool {
		ent := e.ledgerEntry(req.Tenant, req.RequestID)
		return ent != nil && ent.Published && ent.Result != nil
	})
	t.Log("the entry is recorded and marked published now")
	var wr waited
	select {
	case wr = <-done:
	case <-time.After(25 * time.Second): // Wait asks after 5 s, then 10 s more
		cancel()
		wr = <-done
	}
	got, err := wr.r, wr.err
	if err != nil {
		t.Fatalf("publisher.Wait: %v; the request's stored result is %s (status showed result %v)", err, stored.Data.Status,
			rep.Request != nil && rep.Request.Result != nil)
	}
	if got.Data.Status != stored.Data.Status {
		t.Fatalf("Wait returned %s, stored %s", got.Data.Status, stored.Data.Status)
	}
}

// resultBody is a stored result of tenant's request id under name.
func resultBody(t *testing.T, tenant, name, id string) []byte {
	b, err := json.Marshal(v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: tenant, Name: name,
		Status: v1.StatusSucceeded, Origin: v1.OriginCache}, time.Now()))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A result published first whose record failed on the request's last
// try (its entry stays undecided until it ages out) is the request's
// stored result. More than recentMsgs results of other tenants and one
// more of the request's own subject are stored after it, out of the
// status service's bounded read (Recent). Once the key's run has ended
// a while ago, status looks for the undecided entry's result in full,
// and publisher.Wait, asking again, returns it. (From an attack on the
// bounded read; before, Wait never returned.)
func TestAStoredResultWhoseRecordFailedForGoodIsShownOnceTheRunEndedAWhileAgo(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	const id = "record-lost-for-good"
	e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.MaxDeliver = 1 }, nil,
		func(w *Worker) { losePublishedMarks(w, "acme", id, always) })
	results := e.collect()
	req := request(id)
	req.RequestID = id
	got := e.buildOnce(t, tr, results, req)
	if got.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, got))
	}
	e.atkSettled(t, 15*time.Second)
	if ent := e.ledgerEntry("acme", id); ent == nil || ent.Result != nil {
		t.Fatalf("premise: the entry is undecided, got %s", mustJSON(t, ent))
	}
	// Other tenants' results, then one more of acme/web.
	ctx := context.Background()
	for i := range recentMsgs + 100 {
		m := nats.NewMsg(v1.ResultsIngestPrefix + ".other.web")
		oid := fmt.Sprintf("r-%d", i)
		m.Header.Set(v1.MsgIDHeader, v1.MsgID("other", oid))
		m.Data, _ = json.Marshal(v1.NewResult("/test", v1.ResultData{RequestID: oid, Tenant: "other", Name: "web", Status: v1.StatusFailed, Reason: "X"}, time.Now()))
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	later := v1.NewResult("/test", v1.ResultData{RequestID: "later", Tenant: "acme", Name: "web", Status: v1.StatusFailed}, time.Now())
	b, _ := json.Marshal(later)
	m := nats.NewMsg(v1.ResultsIngestPrefix + ".acme.web")
	m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", "later"))
	m.Data = b
	if _, err := e.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	if stored := e.resultsStoredFor(id); len(stored) != 1 {
		t.Fatalf("premise: %d stored results of %s", len(stored), id)
	}
	wctx, cancel := context.WithTimeout(ctx, 40*time.Second) // asked at 0, 5 and 15 s; the run ended 10 s before
	defer cancel()
	w, err := e.pub.Wait(wctx, "acme", "web", id, time.Time{})
	if err != nil || w.Data.Status != v1.StatusSucceeded {
		msg, _ := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), id, 5*time.Second)
		var status string
		if msg != nil {
			status = string(msg.Data)
		}
		t.Fatalf("publisher.Wait = %+v, %v; the stored result is succeeded. status: %s", w, err, status)
	}
}
