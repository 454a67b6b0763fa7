//go:build integration && benche2e

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
)

// TestBenchE2ECacheHits measures P3: cache hits answered per second by one
// worker, against a bare program doing what a hit needs at the least:
// fetch → KV get → publish → ack, with the worker's concurrency.
func TestBenchE2ECacheHits(t *testing.T) {
	start := time.Now()
	const n = 2000
	s := newSuite(t, options{})
	w := s.startBenchWorker("bench-1")
	src := s.benchSource()
	results := s.resultClock()
	first := src.request("hits", "hit")
	src.publish(first)
	results.wait(t, []string{first.RequestID}, time.Minute)
	w.stop(t, syscall.SIGTERM)

	// The same key n times, queued while no worker runs.
	var ids []string
	for range n {
		req := src.request("hits", "hit")
		src.publish(req)
		ids = append(ids, req.RequestID)
	}
	s.startBenchWorker("bench-2").profile(t, "p3-cache-hits", 2*time.Second)
	results.wait(t, ids, 5*time.Minute)
	results.check(t, ids)
	rate := func(times []time.Time) float64 {
		slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
		return float64(len(times)-1) / times[len(times)-1].Sub(times[0]).Seconds()
	}
	var got []time.Time
	for _, id := range ids {
		got = append(got, results.arrival(id))
	}
	buildqRate := rate(got)

	// What one cache hit asks of the server: every message any client
	// sends, by kind, over a further round of requests (counted apart
	// from the measurement, which the counting would slow).
	const counted = 200
	traffic := s.countTraffic()
	var more []string
	for range counted {
		req := src.request("hits", "hit")
		src.publish(req)
		more = append(more, req.RequestID)
	}
	results.wait(t, more, 2*time.Minute)
	perHit := traffic()

	// The baseline, on the same server: the build record the worker
	// stored, the same request bodies.
	ctx := context.Background()
	js := s.js()
	idx, err := js.KeyValue(ctx, "buildq-builds")
	if err != nil {
		t.Fatal(err)
	}
	key := results.res[first.RequestID].Key
	rec, err := idx.Get(ctx, key)
	if err != nil {
		t.Fatalf("the build record of %s: %v", key, err)
	}
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "bench-p3"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "k", rec.Value()); err != nil {
		t.Fatal(err)
	}
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH_P3", Subjects: []string{"bench.p3.in"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH_P3_OUT", Subjects: []string{"bench.p3.out.>"}}); err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(first)
	for range n {
		if _, err := js.Publish(ctx, "bench.p3.in", body); err != nil {
			t.Fatal(err)
		}
	}
	var bmu sync.Mutex
	var baseAt []time.Time
	sub, err := s.nc.Subscribe("bench.p3.out.>", func(*nats.Msg) {
		bmu.Lock()
		baseAt = append(baseAt, time.Now())
		bmu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	_ = s.nc.Flush()
	bnc, err := nats.Connect(s.natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer bnc.Close()
	bjs, _ := jetstream.New(bnc)
	bkv, _ := bjs.KeyValue(ctx, "bench-p3")
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "bench", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 16})
	if err != nil {
		t.Fatal(err)
	}
	it, err := cons.Messages()
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan jetstream.Msg)
	var wg sync.WaitGroup
	seq := 0
	var seqMu sync.Mutex
	for range 16 { // the worker's --max-in-flight
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range msgs {
				var req v1.Request
				if err := json.Unmarshal(m.Data(), &req); err != nil {
					t.Error(err)
				}
				e, err := bkv.Get(ctx, "k")
				if err != nil {
					t.Error(err)
					continue
				}
				seqMu.Lock()
				seq++
				id := strconv.Itoa(seq)
				seqMu.Unlock()
				out := nats.NewMsg("bench.p3.out." + id)
				out.Header.Set(v1.MsgIDHeader, id)
				out.Data = e.Value()
				if _, err := bjs.PublishMsg(ctx, out); err != nil {
					t.Error(err)
				}
				_ = m.Ack()
			}
		}()
	}
	go func() {
		for range n {
			m, err := it.Next()
			if err != nil {
				break
			}
			msgs <- m
		}
		close(msgs)
	}()
	eventually(t, 2*time.Minute, "the baseline's answers", func() bool {
		bmu.Lock()
		defer bmu.Unlock()
		return len(baseAt) >= n
	})
	it.Stop()
	wg.Wait()
	bmu.Lock()
	baseRate := rate(baseAt)
	bmu.Unlock()
	rows := []benchfmt.Row{benchfmt.Compared(fmt.Sprintf("P3 cache hits answered (%d queued, one worker)", n), "req/s", buildqRate, baseRate)}
	total := 0.0
	for _, k := range slices.Sorted(maps.Keys(perHit)) {
		v := float64(perHit[k]) / counted
		total += v
		rows = append(rows, benchfmt.Plain("P3 messages to the server per hit: "+k, "messages", v))
	}
	rows = append(rows, benchfmt.Compared("P3 messages to the server per hit, all (the producer's publish included)", "messages", total, 5))
	met := buildqRate >= 0.4*baseRate && total <= 7
	writeResult(t, benchfmt.Result{ID: "P3", Title: "cache hits answered per second (no Job)",
		Baseline: "a bare program on the same NATS server: fetch → KV get of the same build record → JetStream publish → ack, 16 at a time like the worker: with the producer's publish, 5 messages to the server per request (fewer with batched fetches)",
		Rows:     rows,
		Goal:     "at least 0.4× the baseline, with at most 7 messages to the server per hit", Met: benchfmt.Bool(met), Seconds: time.Since(start).Seconds(),
		Notes: append([]string{p3How}, notMet(met, p3Why)...)})
}

// countTraffic counts every message clients send to the suite's NATS
// server from now on, by kind, until the returned function is called.
// Replies to inboxes, consumers' deliveries and the server's own
// advisories are not counted: each request to the server counts once.
func (s *suite) countTraffic() func() map[string]int {
	s.t.Helper()
	nc, err := nats.Connect(s.natsURL)
	if err != nil {
		s.t.Fatal(err)
	}
	var mu sync.Mutex
	counts := map[string]int{}
	sub, err := nc.Subscribe(">", func(m *nats.Msg) {
		if strings.HasPrefix(m.Reply, "$JS.ACK.") {
			return // a consumer's delivery, sent by the server
		}
		kind := trafficKind(m.Subject)
		if kind == "" {
			return
		}
		mu.Lock()
		counts[kind]++
		mu.Unlock()
	})
	if err != nil {
		s.t.Fatal(err)
	}
	_ = sub.SetPendingLimits(-1, -1)
	_ = nc.Flush()
	return func() map[string]int {
		_ = nc.Flush()
		time.Sleep(200 * time.Millisecond) // the last messages in flight
		_ = sub.Unsubscribe()
		nc.Close()
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(counts)
	}
}

// trafficKind names what a message to subject does: a JetStream API call
// by its operation, a KV write by bucket, an ack, a stream publish or a
// core message by its subject's first tokens ("" for replies).
func trafficKind(subject string) string {
	tok := strings.Split(subject, ".")
	switch {
	case strings.HasPrefix(subject, "_INBOX") || strings.HasPrefix(subject, "$SYS") || strings.HasPrefix(subject, "$JS.EVENT."):
		return ""
	case strings.HasPrefix(subject, "$JS.ACK."):
		return "ack/nak/progress of a consumer's message"
	case strings.HasPrefix(subject, "$JS.API.DIRECT.GET.") && len(tok) > 4:
		return "KV get " + strings.TrimPrefix(tok[4], "KV_")
	case strings.HasPrefix(subject, "$JS.API.") && len(tok) > 3:
		op := tok[2] + "." + tok[3]
		if len(tok) > 4 && (tok[3] == "MSG" || tok[3] == "CONSUMER") {
			op += "." + tok[4]
		}
		return "JetStream API " + op
	case strings.HasPrefix(subject, "$KV.") && len(tok) > 1:
		return "KV write " + tok[1]
	case len(tok) >= 2:
		return "publish " + tok[0] + "." + tok[1]
	}
	return "publish " + subject
}
