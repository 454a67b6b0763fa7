package worker

// Fair queue (worker/internal/fairq): one tenant's wait behind another's
// flood, and distinct requests behind a crowd of duplicates. Benchmarks:
// they report figures and assert nothing.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/publisher"
)

// sleepBackend "builds" by sleeping: the benchmarks below measure the
// queue, not a build.
type sleepBackend struct {
	// d gives a build's duration by its request's name.
	d func(name string) time.Duration
}

func (s sleepBackend) Identity() string { return "bench-sleep/v1" }

func (s sleepBackend) Run(ctx context.Context, b Build, started Started) (Outcome, error) {
	job := "bench-" + b.Key[:12]
	started(job, true, b.Request.RequestID)
	at := time.Now()
	select {
	case <-time.After(s.d(b.Request.Name)):
	case <-ctx.Done():
		return Outcome{}, ctx.Err()
	}
	return Outcome{Succeeded: true, Digest: digestOf(b.Key), Job: job, Run: b.Run, StartedAt: at, FinishedAt: time.Now()}, nil
}

func (sleepBackend) Cleanup(context.Context, string, string) error { return nil }

// benchStack is an embedded NATS server with one worker on sleepBackend.
type benchStack struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	pub *publisher.Client

	mu      sync.Mutex
	results map[string]v1.ResultData // by request id
	arrived map[string]time.Time
	ch      chan struct{}
}

func (s *benchStack) publish(b *testing.B, r *v1.Request) {
	if _, err := s.pub.Publish(context.Background(), r); err != nil {
		b.Fatal(err)
	}
}

// wait returns the results of ids once all arrived.
func (s *benchStack) wait(b *testing.B, timeout time.Duration, ids ...string) []v1.ResultData {
	deadline := time.After(timeout)
	for {
		s.mu.Lock()
		var out []v1.ResultData
		for _, id := range ids {
			if d, ok := s.results[id]; ok {
				out = append(out, d)
			}
		}
		s.mu.Unlock()
		if len(out) == len(ids) {
			return out
		}
		select {
		case <-s.ch:
		case <-deadline:
			b.Fatalf("%d of %d results after %s", len(out), len(ids), timeout)
		}
	}
}

func (s *benchStack) arrivedAt(id string) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.arrived[id]
}

// waitQueued waits until intake admitted everything and at least n
// requests wait in the queues.
func (s *benchStack) waitQueued(b *testing.B, n uint64) {
	deadline := time.Now().Add(time.Minute)
	for {
		q, err := ReadQueueState(context.Background(), s.js)
		in, ierr := s.js.Stream(context.Background(), v1.RequestsStream)
		if err == nil && ierr == nil {
			if si, err := in.Info(context.Background()); err == nil && si.State.Msgs == 0 && q.Waiting >= n {
				return
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("the queue did not reach %d waiting requests", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newBenchStack(b *testing.B, inFlight int, d func(string) time.Duration) (*benchStack, context.CancelFunc) {
	srv := testnats.Start(b, testnats.Config{})
	nc := srv.Connect(b, nats.ReconnectBufSize(-1))
	ctx, cancel := context.WithCancel(context.Background())
	w, err := New(nc, sleepBackend{d: d}, Config{ID: "bench", MaxInFlight: inFlight, Naming: naming.Policy{Registry: "registry.test"}})
	if err != nil {
		b.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	js, _ := jetstream.New(nc)
	pub, _ := publisher.New(nc)
	s := &benchStack{nc: nc, js: js, pub: pub, results: map[string]v1.ResultData{}, arrived: map[string]time.Time{}, ch: make(chan struct{}, 1)}
	sub, err := nc.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		var r v1.Result
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		s.mu.Lock()
		if _, ok := s.results[r.Data.RequestID]; !ok {
			s.results[r.Data.RequestID] = r.Data
			s.arrived[r.Data.RequestID] = time.Now()
		}
		s.mu.Unlock()
		select {
		case s.ch <- struct{}{}:
		default:
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	return s, func() {
		_ = sub.Unsubscribe()
		cancel()
		<-done
		nc.Close()
		srv.Stop()
	}
}

// BenchmarkFairShareFlood floods tenant acme with 2,000 requests, then
// measures how long globex's one request waits for a slot, against the same
// request's wait on an idle queue. 4 slots, builds of 50 ms: one free
// slot's time is 50/4 ms on average and 50 ms at worst; a FIFO queue would
// make globex wait for all 2,000 (about 25 s). It prints the figures and
// asserts nothing.
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
func BenchmarkFairShareFlood(b *testing.B) {
	const build = 50 * time.Millisecond
	for range b.N {
		s, stop := newBenchStack(b, 4, func(string) time.Duration { return build })
		var idle []float64
		for i := range 5 {
			r := tenantRequest("globex", fmt.Sprint("idle-", i))
			s.publish(b, r)
			idle = append(idle, waitMs(s.wait(b, 30*time.Second, r.RequestID)[0]))
		}
		for i := range 2000 {
			s.publish(b, tenantRequest("acme", fmt.Sprint("flood-", i)))
		}
		s.waitQueued(b, 1500)
		var flooded []float64
		for i := range 5 {
			r := tenantRequest("globex", fmt.Sprint("flooded-", i))
			s.publish(b, r)
			flooded = append(flooded, waitMs(s.wait(b, time.Minute, r.RequestID)[0]))
		}
		q, _ := ReadQueueState(context.Background(), s.js)
		stop()
		mi, first, mf := median(idle), flooded[0], median(flooded)
		b.ReportMetric(mi, "idle-wait-ms")
		b.ReportMetric(first, "flooded-wait-ms")
		b.ReportMetric(first/max(mi, 0.01), "ratio")
		b.Logf("globex's queue wait: idle queue %.2f ms (median of 5); behind acme's flood of 2,000: %.2f ms for the first request, %.2f ms median of 5 (%d of acme's still queued after them); one build takes %s on 4 slots; ratio %.1f. A FIFO queue would make the first wait for acme's whole backlog (about %s).",
			mi, first, mf, q.Waiting, build, first/max(mi, 0.01), time.Duration(2000/4)*build)
	}
}

// waitMs is a result's time from its first publish to its start.
func waitMs(d v1.ResultData) float64 {
	return float64(d.Timings.StartedAt.Sub(d.Timings.QueuedAt).Microseconds()) / 1000
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkDuplicatesDoNotDelayDistinct publishes 1,000 duplicates of 3
// keys (builds of 5 s) and then 20 distinct requests (builds of 20 ms) on 8
// slots, all of one tenant: the duplicates park, so the distinct requests
// finish long before the duplicates' builds end. It prints when each group
// finished and asserts nothing.
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
func BenchmarkDuplicatesDoNotDelayDistinct(b *testing.B) {
	for range b.N {
		s, stop := newBenchStack(b, 8, func(name string) time.Duration {
			if name == "dup" {
				return 5 * time.Second
			}
			return 20 * time.Millisecond
		})
		start := time.Now()
		var dups, distinct []string
		for i := range 1000 {
			r := request(fmt.Sprint("dup-", i%3))
			r.Name = "dup"
			s.publish(b, r)
			dups = append(dups, r.RequestID)
		}
		for i := range 20 {
			r := request(fmt.Sprint("distinct-", i))
			r.Name = "distinct"
			s.publish(b, r)
			distinct = append(distinct, r.RequestID)
		}
		published := time.Since(start)
		s.wait(b, 2*time.Minute, distinct...)
		var lastDistinct time.Time
		for _, id := range distinct {
			lastDistinct = maxTime(lastDistinct, s.arrivedAt(id))
		}
		rs := s.wait(b, 2*time.Minute, dups...)
		var lastDup time.Time
		built := 0
		for i, id := range dups {
			lastDup = maxTime(lastDup, s.arrivedAt(id))
			if rs[i].Origin == v1.OriginBuild {
				built++
			}
		}
		stop()
		b.ReportMetric(lastDistinct.Sub(start).Seconds(), "distinct-done-s")
		b.ReportMetric(lastDup.Sub(start).Seconds(), "duplicates-done-s")
		b.Logf("published 1,020 in %s; the 20 distinct requests were all answered after %s, the 1,000 duplicates (%d builds of 5 s) after %s",
			published.Round(time.Millisecond), lastDistinct.Sub(start).Round(time.Millisecond), built, lastDup.Sub(start).Round(time.Millisecond))
	}
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
