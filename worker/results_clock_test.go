package worker

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// How old a request is, is judged by the server's clock: the time stamp
// of an info response plus the time since its request was sent, an upper
// bound of the server's time now.
func TestTheServerClockJudgesARequestsAge(t *testing.T) {
	t.Parallel()
	var c serverClock
	server := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	if c.young(server, 5*time.Minute) {
		t.Fatal("young with no sample: an unknown clock must not be trusted")
	}
	c.sample(server, time.Now().Add(-sampleMaxAge/2), 10*time.Minute) // sent a moment ago
	for _, tc := range []struct {
		age  time.Duration // before the sample's stamp
		want bool
	}{
		{0, true},
		{5*time.Minute - sampleMaxAge/2 - time.Second, true},
		{5*time.Minute - sampleMaxAge/2 + time.Second, false}, // with the time since the send: 5 min 1 s
		{time.Hour, false},
	} {
		if got := c.young(server.Add(-tc.age), 5*time.Minute); got != tc.want {
			t.Errorf("a request %s older than the server's stamp: young = %v, want %v", tc.age, got, tc.want)
		}
	}
	// A window narrowed on the stream by hand: half of it bounds the age.
	c.sample(server, time.Now(), 2*time.Minute)
	if c.young(server.Add(-90*time.Second), 5*time.Minute) {
		t.Error("a request 90 s old is young under a duplicate window of 2 min")
	}
	// A sample past its age (the info requests failing since, the worker
	// paused) is no longer trusted: a window narrowed, or a server
	// restarted on another clock, since then would go unseen.
	c.sample(server, time.Now().Add(-sampleMaxAge-time.Second), 10*time.Minute)
	if c.young(server, 5*time.Minute) {
		t.Error("young by a sample older than sampleMaxAge")
	}
	c.sample(server, time.Now(), 2*time.Minute)
	// A response without a stamp (an older server) changes nothing.
	c.sample(time.Time{}, time.Now(), 10*time.Minute)
	if c.young(server.Add(-90*time.Second), 5*time.Minute) {
		t.Error("a sample without a time stamp replaced the last one")
	}
}

// A worker whose own clock runs 10 minutes ahead still publishes a fresh
// request's result first: its clock decides nothing (a clock behind would
// otherwise publish an old request's result blind).
func TestAWorkersOwnClockDoesNotJudgeARequestsAge(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("clock-ahead")
	req.RequestID = "clock-ahead"
	var results *resultCollector
	var at resultAtRecord
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Now = func() time.Time { return time.Now().Add(10 * time.Minute) }
	}, nil, func(w *Worker) { at.hook(w, req.Tenant, req.RequestID, &results) })
	results = e.collect()
	e.buildOnce(t, tr, results, req)
	if !<-at.seen {
		t.Fatal("the result went out only after its decision was recorded: the worker judged the request's age by its own clock")
	}
}

// The status service's look for a stored result reads a bounded number of
// the stream's newest messages, whatever the tenant stored under the name
// before; the worker's own look (Find) reads them all.
func TestRecentReadsABoundedNumberOfStoredResults(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	const k = 3 * recentMsgs
	for i := range k {
		m := nats.NewMsg(v1.ResultsIngestPrefix + ".acme.web")
		m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", fmt.Sprintf("other-%d", i)))
		m.Data = []byte(`{}`)
		if _, err := e.js.PublishMsgAsync(m); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-e.js.PublishAsyncComplete():
	case <-time.After(60 * time.Second):
		t.Fatal("storing the results timed out")
	}
	r := storedResults{js: e.js}
	since := time.Now().Add(-time.Hour)
	if d, scanned, err := r.find(t.Context(), "acme", "web", "absent", since, recentMsgs); err != nil || d != nil || scanned > recentMsgs {
		t.Fatalf("Recent read %d results (found %v, %v), want at most %d", scanned, d, err, recentMsgs)
	}
	if d, scanned, err := r.find(t.Context(), "acme", "web", "absent", since, 0); err != nil || d != nil || scanned != k {
		t.Fatalf("Find read %d results (found %v, %v), want all %d", scanned, d, err, k)
	}
	if d, _, err := r.find(t.Context(), "acme", "web", "other-10", since, 0); err != nil || d == nil {
		t.Fatalf("Find of an old result: %v, %v", d, err)
	}
}
