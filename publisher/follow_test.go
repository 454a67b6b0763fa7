package publisher_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// resumeWorld is a restartable server with the results stream, an
// operator's connection that reconnects at once (the workers'), and a
// stand-in for the workers' stored-results service of tenant acme.
type resumeWorld struct {
	srv   *testnats.Server
	admin *nats.Conn
	js    jetstream.JetStream
}

func newResumeWorld(t *testing.T) *resumeWorld {
	t.Helper()
	srv := testnats.Start(t, testnats.Config{})
	admin, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	js, _ := jetstream.New(admin)
	if _, _, err := worker.EnsureStreams(context.Background(), js, worker.Config{}); err != nil {
		t.Fatal(err)
	}
	w := &resumeWorld{srv: srv, admin: admin, js: js}
	// The stored-results service, as a worker answers it (its contract:
	// api/v1 ResultsRequest/ResultsReply), reading acme's subjects only.
	if _, err := admin.Subscribe(v1.APIResultsSubject("acme"), func(m *nats.Msg) {
		var req v1.ResultsRequest
		_ = json.Unmarshal(m.Data, &req)
		rep := v1.ResultsReply{Next: req.AfterSeq}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s, err := js.Stream(ctx, v1.ResultsStream)
		if err != nil {
			rep.Error = err.Error()
		} else {
			rep.FirstSeq = s.CachedInfo().State.FirstSeq
			rep.Truncated = req.AfterSeq+1 < rep.FirstSeq
			for seq := req.AfterSeq + 1; ; {
				sm, err := s.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(v1.ResultsPrefix+".acme.*"))
				if err != nil {
					break
				}
				rep.Results = append(rep.Results, v1.StoredResult{Seq: sm.Sequence, Time: sm.Time, Event: sm.Data})
				rep.Next, seq = sm.Sequence, sm.Sequence+1
			}
		}
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
	}); err != nil {
		t.Fatal(err)
	}
	return w
}

// publish stores acme's result id as a worker does (the stream stores it
// and republishes it on buildq.results.acme.web).
func (w *resumeWorld) publish(t *testing.T, id string) {
	t.Helper()
	b, _ := json.Marshal(v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: "acme", Name: "web", Status: v1.StatusSucceeded}, time.Now()))
	m := nats.NewMsg(v1.ResultsIngestPrefix + ".acme.web")
	m.Header.Set(v1.MsgIDHeader, id)
	m.Data = b
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := w.js.PublishMsg(ctx, m)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("publish %s: %v", id, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// follower runs Follow on a connection of its own that reconnects only
// after reconnectWait, and records what it delivers and reports.
type follower struct {
	mu   sync.Mutex
	ids  []string
	gaps []publisher.Gap
	done chan error
}

func (f *follower) snapshot() ([]string, []publisher.Gap) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ids), slices.Clone(f.gaps)
}

func (w *resumeWorld) follow(t *testing.T, filter publisher.Filter, reconnectWait time.Duration) *follower {
	t.Helper()
	nc, err := nats.Connect(w.srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(reconnectWait), nats.ReconnectJitter(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	c, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &follower{done: make(chan error, 1)}
	t.Cleanup(func() {
		cancel()
		if err := <-f.done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("follow ended with %v", err)
		}
	})
	go func() {
		f.done <- c.Follow(ctx, filter, func(r v1.Result) error {
			f.mu.Lock()
			f.ids = append(f.ids, r.ID)
			f.mu.Unlock()
			return nil
		}, publisher.OnGap(func(g publisher.Gap) {
			f.mu.Lock()
			f.gaps = append(f.gaps, g)
			f.mu.Unlock()
		}))
	}()
	// Subscribed once a result published now arrives.
	return f
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A NATS restart while following: the results stored after the server
// came back but before the follower's connection did (the workers'
// reconnect first) are replayed once the follower is back, each result
// is delivered exactly once, and the Gap says how many were missed —
// through the tenant's stored-results service (a tenant) and through
// the stream (an operator, no tenant).
func TestFollowResumesAcrossANATSRestart(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		filter publisher.Filter
	}{
		{"tenant, through its stored-results service", publisher.Filter{Tenant: "acme"}},
		{"operator, through the stream", publisher.Filter{}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			w := newResumeWorld(t)
			f := w.follow(t, c.filter, 3*time.Second)
			waitFor(t, "the first result", 10*time.Second, func() bool {
				w.publish(t, publisher.NewRequestID())
				ids, _ := f.snapshot()
				return len(ids) > 0
			})
			if err := w.srv.Restart(100 * time.Millisecond); err != nil {
				t.Fatal(err)
			}
			// The operator's connection is back long before the
			// follower's (3 s).
			w.publish(t, "gap-1")
			w.publish(t, "gap-2")
			waitFor(t, "the gap report", 30*time.Second, func() bool { _, g := f.snapshot(); return len(g) > 0 })
			w.publish(t, "after")
			waitFor(t, "the result after the restart", 10*time.Second, func() bool { ids, _ := f.snapshot(); return slices.Contains(ids, "after") })
			ids, gaps := f.snapshot()
			for _, want := range []string{"gap-1", "gap-2", "after"} {
				if n := count(ids, want); n != 1 {
					t.Errorf("%s delivered %d times: %v", want, n, ids)
				}
			}
			if i, j := slices.Index(ids, "gap-1"), slices.Index(ids, "gap-2"); i > j {
				t.Errorf("the gap out of order: %v", ids)
			}
			if g := gaps[0]; g.Err != nil || g.Replayed != 2 || g.AfterSeq == 0 {
				t.Errorf("gap %+v, want 2 replayed after the first result's sequence", g)
			}
		})
	}
}

// Results of the gap the stream no longer holds (aged out): the Gap says
// so with ErrResultsLost, and Follow goes on.
func TestFollowSaysWhenTheGapAgedOut(t *testing.T) {
	t.Parallel()
	w := newResumeWorld(t)
	f := w.follow(t, publisher.Filter{Tenant: "acme"}, 3*time.Second)
	waitFor(t, "the first result", 10*time.Second, func() bool {
		w.publish(t, publisher.NewRequestID())
		ids, _ := f.snapshot()
		return len(ids) > 0
	})
	if err := w.srv.Restart(100 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	w.publish(t, "lost")
	w.publish(t, "kept")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := w.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	last := s.CachedInfo().State.LastSeq
	if err := s.Purge(ctx, jetstream.WithPurgeSequence(last)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the gap report", 30*time.Second, func() bool { _, g := f.snapshot(); return len(g) > 0 })
	ids, gaps := f.snapshot()
	if !errors.Is(gaps[0].Err, publisher.ErrResultsLost) {
		t.Fatalf("gap %+v: want ErrResultsLost", gaps[0])
	}
	if count(ids, "kept") != 1 || count(ids, "lost") != 0 {
		t.Fatalf("delivered %v", ids)
	}
	w.publish(t, "after")
	waitFor(t, "a result after the lost gap", 10*time.Second, func() bool { ids, _ := f.snapshot(); return slices.Contains(ids, "after") })
}

func count(ids []string, id string) int {
	n := 0
	for _, x := range ids {
		if x == id {
			n++
		}
	}
	return n
}
