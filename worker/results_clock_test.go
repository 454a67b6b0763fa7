package worker

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
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
	c.sample(server, time.Now().Add(-time.Minute), 10*time.Minute) // sent a minute ago
	for _, tc := range []struct {
		age  time.Duration // before the sample's stamp
		want bool
	}{
		{0, true},
		{3*time.Minute + 50*time.Second, true},
		{4*time.Minute + 10*time.Second, false}, // with the minute since the send: 5 min 10 s
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
	lk := RequestIndexKey(req.Tenant, req.RequestID)
	var results *resultCollector
	var seen atomic.Int32 // results out at the decision's first write: 1 yes, 2 no
	e.startWorkerHooked("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Now = func() time.Time { return time.Now().Add(10 * time.Minute) }
	}, nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) error {
			if k == lk && bytes.Contains(value, []byte(`"result":`)) && seen.Load() == 0 {
				deadline := time.Now().Add(2 * time.Second)
				for len(results.pubsOf(req.Tenant, req.RequestID)) == 0 && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
				if len(results.pubsOf(req.Tenant, req.RequestID)) > 0 {
					seen.Store(1)
				} else {
					seen.Store(2)
				}
			}
			return nil
		}})
	})
	results = e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, kanikoID)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	results.waitFor(t, 1, 10*time.Second)
	eventually(t, 5*time.Second, "the decision recorded", func() bool { return seen.Load() != 0 })
	if seen.Load() != 1 {
		t.Fatal("the result went out only after its decision was recorded: the worker judged the request's age by its own clock")
	}
}
