//go:build benchscale && linux

package worker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
)

// P9's bare baseline: the same requests, published the same way into the
// same cluster, answered by the least protocol that keeps buildq's
// guarantees of one decision per request and one build per key, with
// nothing else — no fair queue, no tenant limits, no registry, no Jobs,
// no progress events, no cancel index, no leases. Per request: the
// producer's publish (one write), its delivery and ack from one shared
// pull consumer, a read of the key's build record (none once the watch
// below showed the key built), the decision created in a ledger bucket
// (one write), the result published under the request's message id (one
// write). Per key, once: the build record created, the emulated build (a
// sleep holding one of the process's slots), the record set done (two
// writes). A request whose key is being built waits, holding no slot, for
// the record's update, which every process watches. What this protocol
// reaches on the machine is the floor P9's figures are read against.

const (
	bareRequestsStream = "BARE_REQUESTS"
	bareResultsStream  = "BARE_RESULTS"
	bareLedgerBucket   = "bare-ledger"
	bareBuildsBucket   = "bare-builds"
	bareConsumer       = "bare-workers"
)

// setupBare creates the bare protocol's streams, buckets and consumer;
// a cluster still electing its meta leader does not answer: tried again.
func setupBare(ctx context.Context, js jetstream.JetStream, replicas int) error {
	for {
		tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := trySetupBare(tctx, js, replicas)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-time.After(time.Second):
		case <-ctx.Done():
			return fmt.Errorf("%w; the last try: %w", ctx.Err(), err)
		}
	}
}

func trySetupBare(ctx context.Context, js jetstream.JetStream, replicas int) error {
	req, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: bareRequestsStream, Subjects: []string{"bare.requests.>"},
		Retention: jetstream.WorkQueuePolicy, Storage: jetstream.FileStorage, Replicas: replicas, Duplicates: 2 * time.Minute})
	if err != nil {
		return err
	}
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: bareResultsStream, Subjects: []string{"bare.results.>"},
		Storage: jetstream.FileStorage, Replicas: replicas, Duplicates: 2 * time.Minute}); err != nil {
		return err
	}
	for _, b := range []string{bareLedgerBucket, bareBuildsBucket} {
		if _, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: b, Storage: jetstream.FileStorage, Replicas: replicas}); err != nil {
			return err
		}
	}
	_, err = req.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: bareConsumer, AckPolicy: jetstream.AckExplicitPolicy,
		AckWait: 5 * time.Minute, MaxAckPending: 1 << 20, MaxWaiting: 512})
	return err
}

// TestBenchScaleBare is one process of P9's bare baseline.
func TestBenchScaleBare(t *testing.T) {
	spec := childSpec(t, "bare")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	stopProfile := startProfile(spec.Profile)
	nc, err := nats.Connect(spec.NATS, nats.Name(spec.Name), nats.MaxReconnects(-1), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ledger, err := js.KeyValue(ctx, bareLedgerBucket)
	if err != nil {
		t.Fatal(err)
	}
	records, err := js.KeyValue(ctx, bareBuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.Consumer(ctx, bareRequestsStream, bareConsumer)
	if err != nil {
		t.Fatal(err)
	}

	// Builds done, as the watch of the records shows them; a waiter
	// registers before it reads the record, so no update is missed.
	var (
		mu      sync.Mutex
		done    = map[string]string{}
		waiting = map[string]chan struct{}{}
	)
	watch, err := records.WatchAll(ctx, jetstream.UpdatesOnly())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = watch.Stop() }()
	go func() {
		for e := range watch.Updates() {
			if e == nil {
				continue
			}
			if d, ok := strings.CutPrefix(string(e.Value()), "done:"); ok {
				mu.Lock()
				done[e.Key()] = d
				if c := waiting[e.Key()]; c != nil {
					close(c)
					delete(waiting, e.Key())
				}
				mu.Unlock()
			}
		}
	}()

	var built, answered, retried atomic.Int64
	var errMu sync.Mutex
	var errs []string
	fail := func(format string, args ...any) {
		errMu.Lock()
		if len(errs) < 20 {
			errs = append(errs, fmt.Sprintf(format, args...))
		}
		errMu.Unlock()
	}
	sem := make(chan struct{}, spec.InFlight)
	handle := func(msg jetstream.Msg) {
		var once sync.Once
		release := func() { once.Do(func() { <-sem }) }
		defer release()
		retry := func(what string, err error) {
			retried.Add(1)
			fail("%s: %v", what, err)
			_ = msg.NakWithDelay(time.Second)
		}
		var req v1.Request
		if err := json.Unmarshal(msg.Data(), &req); err != nil {
			fail("request %q: %v", msg.Data(), err)
			_ = msg.Term()
			return
		}
		key := strings.TrimPrefix(req.ContextDigest, "sha256:")
		origin := v1.OriginCache
		mu.Lock()
		digest, ok := done[key]
		var ch chan struct{}
		if !ok {
			if ch = waiting[key]; ch == nil {
				ch = make(chan struct{})
				waiting[key] = ch
			}
		}
		mu.Unlock()
		if !ok {
			wait := false
			e, err := records.Get(ctx, key)
			switch {
			case err == nil:
				digest, ok = strings.CutPrefix(string(e.Value()), "done:")
				wait = !ok
			case errors.Is(err, jetstream.ErrKeyNotFound):
				// The claim names its claimer: a create whose answer was
				// lost is read back, and is this request's if it names it.
				mine := "running " + spec.Name + " " + req.RequestID
				_, err := records.Create(ctx, key, []byte(mine))
				if err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
					if e, gerr := records.Get(ctx, key); gerr == nil && string(e.Value()) == mine {
						err = nil
					} else if gerr == nil {
						err = jetstream.ErrKeyExists
					}
				}
				switch {
				case errors.Is(err, jetstream.ErrKeyExists):
					wait = true
				case err != nil:
					retry("creating the build record", err)
					return
				default:
					// The build, holding its slot.
					select {
					case <-time.After(spec.Build):
					case <-ctx.Done():
						_ = msg.Nak()
						return
					}
					sum := sha256.Sum256([]byte(key))
					digest = "sha256:" + hex.EncodeToString(sum[:])
					// Stored in place, however long it takes: the
					// requests waiting on the key have nobody else.
					for {
						_, err := records.Put(ctx, key, []byte("done:"+digest))
						if err == nil {
							break
						}
						if ctx.Err() != nil {
							_ = msg.Nak()
							return
						}
						retried.Add(1)
						fail("storing the build's outcome: %v", err)
						time.Sleep(100 * time.Millisecond)
					}
					built.Add(1)
					origin = v1.OriginBuild
				}
			default:
				retry("reading the build record", err)
				return
			}
			if wait {
				// Waiting holds no slot.
				release()
				select {
				case <-ch:
				case <-ctx.Done():
					_ = msg.Nak()
					return
				}
				mu.Lock()
				digest = done[key]
				mu.Unlock()
			}
		}
		now := time.Now().UTC()
		res := v1.Result{SpecVersion: "1.0", Type: v1.ResultType(v1.StatusSucceeded), Source: "/bare/" + spec.Name, ID: req.RequestID,
			Subject: req.Tenant + "/" + req.Name, Time: now, DataContentType: "application/json",
			Data: v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key,
				Status: v1.StatusSucceeded, Origin: origin, Image: scaleRegistryHost + "/" + req.Tenant + "/" + req.Name, Digest: digest,
				Timings: v1.Timings{StartedAt: now, FinishedAt: now}}}
		body, _ := json.Marshal(res)
		// One decision per request: the ledger's create; a redelivery
		// publishes what was decided.
		id := req.Tenant + "." + req.RequestID
		if _, err := ledger.Create(ctx, id, body); errors.Is(err, jetstream.ErrKeyExists) {
			e, err := ledger.Get(ctx, id)
			if err != nil {
				retry("reading the decision", err)
				return
			}
			body = e.Value()
		} else if err != nil {
			retry("creating the decision", err)
			return
		}
		out := nats.NewMsg("bare.results." + req.Tenant + "." + req.Name)
		out.Data = body
		if _, err := js.PublishMsg(ctx, out, jetstream.WithMsgID(v1.MsgID(req.Tenant, req.RequestID))); err != nil {
			retry("publishing the result", err)
			return
		}
		if err := msg.Ack(); err != nil {
			fail("ack: %v", err)
		}
		answered.Add(1)
	}

	var (
		itMu sync.Mutex
		it   jetstream.MessagesContext
	)
	open := func() {
		for ctx.Err() == nil {
			next, err := cons.Messages(jetstream.PullMaxMessages(2 * spec.InFlight))
			if err == nil {
				itMu.Lock()
				it = next
				itMu.Unlock()
				return
			}
			fail("pulling messages: %v", err)
			time.Sleep(100 * time.Millisecond)
		}
	}
	open()
	go func() {
		<-ctx.Done()
		itMu.Lock()
		if it != nil {
			it.Stop()
		}
		itMu.Unlock()
	}()
	if err := os.WriteFile(spec.Ready, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for ctx.Err() == nil {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		msg, err := it.Next()
		if err != nil {
			<-sem
			if ctx.Err() != nil {
				break
			}
			// Closed or broken while the run goes on: said, and pulled
			// again.
			fail("next message: %v", err)
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				open()
			} else {
				time.Sleep(100 * time.Millisecond)
			}
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			handle(msg)
		}()
	}
	wg.Wait()
	stopProfile()
	rep := scaleReport{Name: spec.Name, Errors: errs, Metrics: map[string]float64{
		"builds": float64(built.Load()), "answered": float64(answered.Load()), "retries": float64(retried.Load())}}
	rep.RSSMiB, rep.CPUSeconds = benchfmt.RSSMiB(os.Getpid()), cpuSeconds()
	if err := writeJSONFile(spec.Report, rep); err != nil {
		t.Fatal(err)
	}
}

// runScaleBare runs the bare baseline on topo: its NATS nodes, s.Workers
// bare processes of s.InFlight slots each, the same requests published
// the same way as runScale's.
func runScaleBare(t *testing.T, s scaleSettings, topo scaleTopology) scaleOutcome {
	dir := t.TempDir()
	var out scaleOutcome
	row := func(metric, unit string, v float64) {
		out.rows = append(out.rows, benchfmt.Plain(topo.name+": "+metric, unit, v))
	}
	parentCPU0 := cpuSeconds()
	nodes, natsURL := startScaleNodes(t, s, topo, dir)
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	err = setupBare(sctx, js, min(topo.nodes, 3))
	cancel()
	if err != nil {
		t.Fatalf("%s: setting up the streams: %v", topo.label, err)
	}

	answers := logAnswers(t, nc, "bare.results.>")

	var workers []*scaleProc
	for i := range s.Workers {
		spec := scaleChild{Role: "bare", Name: fmt.Sprintf("%s-b%02d", topo.name, i), NATS: natsURL, InFlight: s.InFlight, Build: s.Build}
		workers = append(workers, startScaleChild(t, dir, "TestBenchScaleBare", spec))
	}
	for _, w := range workers {
		w.waitReady(t, 2*time.Minute)
	}
	t.Logf("%s: %d NATS node(s), %d bare processes ready; publishing %d requests", topo.label, topo.nodes, s.Workers, s.Requests)

	ourCPU := func() float64 {
		c := cpuSeconds()
		for _, p := range append(slices.Clone(nodes), workers...) {
			c += procCPU(p.cmd.Process.Pid)
		}
		return c
	}
	cpu0 := ourCPU()
	busy0, total0 := cpuTicks()
	start := time.Now()
	publishDone, _ := publishBacklog(t, s, func(ctx context.Context, req *v1.Request) error {
		body, err := json.Marshal(req)
		if err != nil {
			return err
		}
		m := nats.NewMsg("bare.requests." + req.Tenant)
		m.Data = body
		_, err = js.PublishMsg(ctx, m, jetstream.WithMsgID(v1.MsgID(req.Tenant, req.RequestID)))
		return err
	})
	deadline := start.Add(s.PhaseTimeout)
	var publishTook time.Duration
	// The CPU every 100 ms: the bare protocol's hits take a few seconds.
	cpuSamples := []cpuSample{{at: time.Now(), cpu: cpu0}}
	for answers.answered.Load() < int64(s.Requests) {
		time.Sleep(100 * time.Millisecond)
		cpuSamples = append(cpuSamples, cpuSample{at: time.Now(), cpu: ourCPU()})
		select {
		case publishTook = <-publishDone:
		default:
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: %d of %d requests answered after %s", topo.label, answers.answered.Load(), s.Requests, s.PhaseTimeout)
			break
		}
	}
	if publishTook == 0 {
		select {
		case publishTook = <-publishDone:
		case <-time.After(time.Minute):
		}
	}
	cpuAll := ourCPU() - cpu0
	busy1, total1 := cpuTicks()
	arrivals := answers.arrivals()
	n := len(arrivals)
	if n == 0 {
		t.Fatalf("%s: no request answered", topo.label)
	}
	wall := arrivals[n-1].Sub(start)
	rate := func(from, to int) float64 {
		if to >= n || from >= to {
			return 0
		}
		return float64(to-from) / arrivals[to].Sub(arrivals[from]).Seconds()
	}
	out.series = benchfmt.Series{Name: "P9 " + topo.label, XLabel: "elapsed (s)", YLabel: "results/s (10 s windows)"}
	for i, from := 0, 0; i < n; i++ {
		if i == n-1 || arrivals[i].Sub(arrivals[from]) >= 10*time.Second {
			out.series.Points = append(out.series.Points, benchfmt.Point{X: arrivals[i].Sub(start).Seconds(), Y: rate(from, i)})
			from = i
		}
	}

	// One stored result per request.
	if st, err := js.Stream(ctx, bareResultsStream); err != nil {
		t.Error(err)
	} else if info, err := st.Info(ctx); err != nil {
		t.Error(err)
	} else if info.State.Msgs != uint64(s.Requests) {
		t.Errorf("%s: %d results stored for %d requests", topo.label, info.State.Msgs, s.Requests)
	}
	_ = nc.Drain()

	var wcpu []float64
	metrics := map[string]float64{}
	for _, w := range workers {
		rep := w.stop(t, time.Minute)
		wcpu = append(wcpu, rep.CPUSeconds)
		for k, v := range rep.Metrics {
			metrics[k] += v
		}
		for _, e := range rep.Errors {
			t.Errorf("%s: %s", rep.Name, e)
		}
	}
	if int(metrics["builds"]) != s.Keys {
		t.Errorf("%s: %.0f builds for %d keys", topo.label, metrics["builds"], s.Keys)
	}
	var natsCPU []float64
	natsMetrics := map[string]float64{}
	for _, nd := range nodes {
		rep := nd.stop(t, time.Minute)
		natsCPU = append(natsCPU, rep.CPUSeconds)
		for k, v := range rep.Metrics {
			natsMetrics[k] += v
		}
	}
	parentCPU := cpuSeconds() - parentCPU0

	row("requests answered", "requests", float64(n))
	row("wall time", "s", wall.Seconds())
	row("throughput", "requests/s", float64(n)/wall.Seconds())
	for q := range 4 {
		row(fmt.Sprintf("throughput, answers %d–%d%%", 25*q, 25*(q+1)), "requests/s", rate(n*q/4, min(n*(q+1)/4, n-1)))
	}
	row("publish time (all requests stored)", "s", publishTook.Seconds())
	row("builds", "builds", metrics["builds"])
	row("transient retries", "retries", metrics["retries"])
	row("messages into the NATS servers per request (clients and routes)", "messages", natsMetrics["in_msgs"]/float64(max(n, 1)))
	row("CPU per answer, all processes", "ms", 1000*cpuAll/float64(max(n, 1)))
	row("CPU, NATS (all nodes)", "CPU-s", sum(natsCPU))
	row("CPU, bare processes (all)", "CPU-s", sum(wcpu))
	row("CPU, harness (publisher, result reader)", "CPU-s", parentCPU)
	out.sum = scaleSummary{wall: wall.Seconds(), hitRate: rate(n-n/4, n-1), msgsIn: natsMetrics["in_msgs"] / float64(max(n, 1)),
		cpuPerAnswer: 1000 * cpuAll / float64(max(n, 1)), natsCPU: sum(natsCPU), clientCPU: sum(wcpu) + parentCPU,
		hitCPU: 1000 * cpuBetween(cpuSamples, arrivals[n/2], arrivals[n-1]) / float64(max(n-1-n/2, 1))}
	row("CPU per answer, all processes, answers 50–100%", "ms", out.sum.hitCPU)
	machineBusy := 100 * float64(busy1-busy0) / float64(max(total1-total0, 1))
	row("CPU of the machine busy (all processes, /proc/stat)", "%", machineBusy)
	out.notes = append(out.notes, fmt.Sprintf(
		"%s: %d requests answered in %.0f s (%.0f/s), publishing took %.0f s; %.1f messages into the servers per request; CPU: NATS %.0f, bare processes %.0f, harness %.0f CPU-s (%.2f ms per answer, all processes); the machine was %.0f%% busy. This protocol keeps only one decision per request and one build per key (see worker/benchscale_bare_test.go), on the same slots: the floor buildq's figures are read against.",
		topo.label, n, wall.Seconds(), float64(n)/wall.Seconds(), publishTook.Seconds(), natsMetrics["in_msgs"]/float64(max(n, 1)),
		sum(natsCPU), sum(wcpu), parentCPU, 1000*cpuAll/float64(max(n, 1)), machineBusy))
	return out
}
