package worker

// Builder (build.go, index.go): requests answered from the index, per
// second. A benchmark: it reports figures and asserts nothing.

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"k8s.io/client-go/kubernetes/fake"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/publisher"
)

// BenchmarkCacheHit measures requests/s through the dedupe path when the
// key is already built: decode, validate, KV lookup, result publish with
// PubAck, ack — no Job. It reports req/s; it asserts nothing.
//
// Origin: dedupe end to end (d7f9faf).
func BenchmarkCacheHit(b *testing.B) {
	_, nc, _ := testnats.JetStream(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	client := fake.NewClientset()
	factory := kube.NewInformerFactory(client, testNamespace)
	watcher, _ := kube.NewWatcher(factory, nil)
	factory.Start(ctx.Done())
	watcher.WaitForSync(ctx)
	backend, err := NewKubeBackend(client, watcher, testKaniko)
	if err != nil {
		b.Fatal(err)
	}
	w, err := New(nc, backend, Config{ID: "bench", MaxInFlight: 64, Naming: naming.Policy{Registry: "registry.test"}})
	if err != nil {
		b.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		b.Fatal(err)
	}
	req := request("bench")
	key := v1.BuildKey(req, backend.Identity())
	repo, _ := w.cfg.Naming.Repository(req)
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateSucceeded, RequestID: "seed", Repository: repo,
		Image: repo + ":" + v1.DefaultTag(key), Digest: digestOf("bench")})
	if _, err := w.runs.Bucket().Put(ctx, key, rec); err != nil {
		b.Fatal(err)
	}
	go func() { _ = w.Run(ctx) }()

	js, _ := jetstream.New(nc)
	pub, _ := publisher.New(nc)
	cons, err := js.OrderedConsumer(ctx, v1.ResultsStream, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverNewPolicy})
	if err != nil {
		b.Fatal(err)
	}
	it, err := cons.Messages()
	if err != nil {
		b.Fatal(err)
	}
	defer it.Stop()

	b.ResetTimer()
	start := time.Now()
	go func() {
		for i := range b.N {
			r := request("bench")
			r.RequestID = fmt.Sprintf("bench-%d", i)
			if _, err := pub.Publish(ctx, r); err != nil {
				b.Error(err)
				return
			}
		}
	}()
	for range b.N {
		m, err := it.Next()
		if err != nil {
			b.Fatal(err)
		}
		var res v1.Result
		if err := json.Unmarshal(m.Data(), &res); err != nil || res.Data.Origin != v1.OriginCache {
			b.Fatalf("unexpected result %s (%v)", m.Data(), err)
		}
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
}
