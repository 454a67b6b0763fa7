//go:build benchscale && linux

package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/publisher"
)

// runScale runs one topology: NATS nodes, the registry, the workers; it
// publishes every request, waits for every result and checks them.
func runScale(t *testing.T, s scaleSettings, topo scaleTopology) scaleOutcome {
	dir := t.TempDir()
	p := topo.name + ": "
	var out scaleOutcome
	row := func(metric, unit string, v float64) {
		out.rows = append(out.rows, benchfmt.Plain(p+metric, unit, v))
	}
	var parentCPU0 = cpuSeconds()

	// The registry every worker's preflight, index check and node push
	// goes to: the test world's, in this process, over TLS.
	regCA := filepath.Join(dir, "registry.pem")
	reg := newTLSRegistry(t, scaleRegistryHost, regCA)
	defer reg.srv.Close()
	regHost := reg.host

	// NATS.
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
	replicas := min(topo.nodes, 3)
	// The streams and buckets, as a worker creates them (Setup waits for
	// a cluster still electing its meta leader).
	sw, err := New(nc, nil, Config{ID: "bench-setup", Replicas: replicas, Naming: naming.Policy{Registry: regHost},
		Logger: zaptest.NewLogger(t, zaptest.Level(zapcore.WarnLevel))})
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	err = sw.Setup(sctx)
	cancel()
	if err != nil {
		t.Fatalf("setting up the streams: %v", err)
	}
	ctx := context.Background()
	before := streamSizes(ctx, js)

	// Every result publish, as a subscriber sees it.
	answers := logAnswers(t, nc, v1.ResultsPrefix+".>")
	var census *subjectCensus
	if s.Census {
		census = startCensus(t, nc)
	}

	// Workers.
	var workers []*scaleProc
	for i := range s.Workers {
		spec := scaleChild{Role: "worker", Name: fmt.Sprintf("%s-w%02d", topo.name, i), NATS: natsURL,
			Registry: regHost, RegAddr: reg.addr, RegCA: regCA,
			InFlight: s.InFlight, Build: s.Build, Replicas: replicas}
		if s.ProfileDir != "" && i == 0 {
			spec.Profile = filepath.Join(s.ProfileDir, topo.name+"-worker.pprof")
		}
		workers = append(workers, startScaleChild(t, dir, "TestBenchScaleWorker", spec))
	}
	for _, w := range workers {
		w.waitReady(t, 2*time.Minute)
	}
	t.Logf("%s: %d NATS node(s), %d workers ready; publishing %d requests over %d keys of %d tenants",
		topo.label, topo.nodes, s.Workers, s.Requests, s.Keys, s.Tenants)

	// Publish everything as fast as the stream takes it (a backlog), 32
	// publishers at once, each waiting for its PubAck.
	pub, err := publisher.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	// The CPU time of every process of the benchmark, every second: the
	// cost of an answer, apart from what else runs on the machine.
	ourCPU := func() float64 {
		c := cpuSeconds()
		for _, p := range append(slices.Clone(nodes), workers...) {
			c += procCPU(p.cmd.Process.Pid)
		}
		return c
	}
	cpuSamples := []cpuSample{{at: time.Now(), cpu: ourCPU()}}
	start := time.Now()
	publishDone, published := publishBacklog(t, s, func(ctx context.Context, req *v1.Request) error {
		_, err := pub.Publish(ctx, req)
		return err
	})

	// Wait for every answer, sampling the rate every 10 s.
	const window = 10 * time.Second
	deadline := start.Add(s.PhaseTimeout)
	var (
		publishTook time.Duration
		lastCount   int64
		lastAt      = start
		complete    bool
	)
	busy0, total0 := cpuTicks()
	busyStart, totalStart := busy0, total0
	out.series = benchfmt.Series{Name: "P9 " + topo.label, XLabel: "elapsed (s)", YLabel: "results/s (10 s windows)"}
	tick := time.NewTicker(time.Second)
	for !complete {
		<-tick.C
		cpuSamples = append(cpuSamples, cpuSample{at: time.Now(), cpu: ourCPU()})
		select {
		case publishTook = <-publishDone:
			t.Logf("%s: %d requests published in %s", topo.label, published.Load(), publishTook.Round(time.Millisecond))
		default:
		}
		n := answers.answered.Load()
		now := time.Now()
		complete = n >= int64(s.Requests)
		if now.Sub(lastAt) >= window || complete {
			rate := float64(n-lastCount) / now.Sub(lastAt).Seconds()
			out.series.Points = append(out.series.Points, benchfmt.Point{X: now.Sub(start).Seconds(), Y: rate})
			sz := streamSizes(ctx, js)
			busy1, total1 := cpuTicks()
			cpu := 100 * float64(busy1-busy0) / float64(max(total1-total0, 1))
			busy0, total0 = busy1, total1
			t.Logf("%s: %6.0fs  answered %7d  %6.0f results/s  machine %3.0f%% busy  queued %d  ledger %d msgs %.1f MiB  builds %d msgs",
				topo.label, now.Sub(start).Seconds(), n, rate, cpu,
				sz[v1.RequestsStream].msgs+sz[v1.QueueStream].msgs, sz["KV_"+v1.RequestsBucket].msgs,
				float64(sz["KV_"+v1.RequestsBucket].bytes)/(1<<20), sz["KV_"+v1.BuildsBucket].msgs)
			lastCount, lastAt = n, now
		}
		if !complete && now.After(deadline) {
			t.Errorf("%s: %d of %d requests answered after %s", topo.label, n, s.Requests, s.PhaseTimeout)
			break
		}
	}
	tick.Stop()
	cpuSamples = append(cpuSamples, cpuSample{at: time.Now(), cpu: ourCPU()})
	busyEnd, totalEnd := cpuTicks()
	machineBusy := 100 * float64(busyEnd-busyStart) / float64(max(totalEnd-totalStart, 1))
	if publishTook == 0 {
		select {
		case publishTook = <-publishDone:
		case <-time.After(time.Minute):
		}
	}
	arrivals := answers.arrivals()
	republished := 0
	answers.mu.Lock()
	for _, c := range answers.publishes {
		republished += c - 1
	}
	answers.mu.Unlock()
	wall := time.Since(start)
	if len(arrivals) > 0 {
		wall = arrivals[len(arrivals)-1].Sub(start)
	}

	// Nothing left in the queues, nothing held.
	var q QueueState
	eventually := time.Now().Add(time.Minute)
	for {
		q, err = ReadQueueState(ctx, js)
		if err == nil && q.Messages == 0 && q.Held == 0 {
			break
		}
		if time.Now().After(eventually) {
			t.Errorf("%s: requests left in the streams: %+v (%v)", topo.label, q, err)
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	waitersLeft := 0
	if kv, err := js.KeyValue(ctx, v1.RequestsBucket); err == nil {
		if l, err := kv.ListKeysFiltered(ctx, "w.>"); err == nil {
			for range l.Keys() {
				waitersLeft++
			}
		}
	}
	if waitersLeft > 0 {
		t.Errorf("%s: %d waiter entries left in the ledger", topo.label, waitersLeft)
	}

	// Every stored result: one per request, every one a success, one
	// digest per key.
	stored := map[string]int{}
	origins := map[v1.Origin]int{}
	handling := map[v1.Origin][]float64{}
	var buildMs []float64 // the builds' own time: claim to outcome
	digests := map[string]string{}
	bad := 0
	rs, err := js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	ri, err := rs.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Read back from a consumer created anew (from the next sequence)
	// whenever a fetch fails: on a cluster a new consumer can take a moment
	// to answer.
	var (
		nextSeq  uint64 = 1
		failures int
		oc       jetstream.Consumer
	)
	for read := uint64(0); read < ri.State.Msgs; {
		if oc == nil {
			oc, err = rs.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
				DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: nextSeq})
		}
		var batch jetstream.MessageBatch
		if err == nil {
			batch, err = oc.Fetch(1000, jetstream.FetchMaxWait(5*time.Second))
		}
		if err != nil {
			if failures++; failures > 20 {
				t.Fatalf("reading the results: %v", err)
			}
			oc, err = nil, nil
			time.Sleep(500 * time.Millisecond)
			continue
		}
		got := 0
		for m := range batch.Messages() {
			got++
			read++
			if meta, err := m.Metadata(); err == nil {
				nextSeq = meta.Sequence.Stream + 1
			}
			var r v1.Result
			if err := json.Unmarshal(m.Data(), &r); err != nil {
				t.Errorf("result %s: %v", m.Data(), err)
				continue
			}
			stored[m.Headers().Get(v1.MsgIDHeader)]++
			origins[r.Data.Origin]++
			handling[r.Data.Origin] = append(handling[r.Data.Origin], r.Data.Timings.FinishedAt.Sub(r.Data.Timings.StartedAt).Seconds()*1000)
			if r.Data.Origin == v1.OriginBuild {
				buildMs = append(buildMs, float64(r.Data.Timings.BuildMs))
			}
			if r.Data.Status != v1.StatusSucceeded {
				if bad++; bad <= 5 {
					t.Errorf("%s: request %s: %s %s: %s", topo.label, r.Data.RequestID, r.Data.Status, r.Data.Reason, r.Data.Message)
				}
			}
			if d, ok := digests[r.Data.Key]; ok && d != r.Data.Digest {
				t.Errorf("%s: key %s answered with digests %s and %s", topo.label, r.Data.Key, d, r.Data.Digest)
			}
			digests[r.Data.Key] = r.Data.Digest
		}
		if got == 0 {
			if err := batch.Error(); err != nil && failures < 20 {
				failures++
				oc = nil
				continue
			}
			t.Fatalf("reading the results: nothing after %d of %d (%v)", read, ri.State.Msgs, batch.Error())
		}
	}
	if bad > 0 {
		t.Errorf("%s: %d results did not succeed", topo.label, bad)
	}
	twice := 0
	for _, c := range stored {
		if c > 1 {
			twice++
		}
	}
	missing := 0
	for i := range s.Requests {
		r := scaleRequest(s, i)
		if stored[v1.MsgID(r.Tenant, r.RequestID)] == 0 {
			missing++
		}
	}
	if twice > 0 || missing > 0 || len(stored) != s.Requests {
		t.Errorf("%s: %d results stored for %d requests: %d requests without a result, %d with more than one",
			topo.label, ri.State.Msgs, s.Requests, missing, twice)
	}
	if len(digests) != s.Keys {
		t.Errorf("%s: results name %d keys, want %d", topo.label, len(digests), s.Keys)
	}
	after := streamSizes(ctx, js)

	// Workers down: their Jobs and figures.
	jobs := map[string]int{}
	jobsLeft := 0
	var rss, wcpu []float64
	metrics := map[string]float64{}
	var slotSamples [][]slotSample
	for _, w := range workers {
		rep := w.stop(t, time.Minute)
		for name, c := range rep.Jobs {
			jobs[name] += c
		}
		jobsLeft += rep.JobsLeft
		rss = append(rss, rep.RSSMiB)
		wcpu = append(wcpu, rep.CPUSeconds)
		slotSamples = append(slotSamples, rep.Slots)
		for k, v := range rep.Metrics {
			metrics[k] += v
		}
		for _, e := range rep.Errors {
			t.Errorf("%s: emulated kubelet: %s", rep.Name, e)
		}
	}
	created, multi := 0, 0
	for _, c := range jobs {
		created += c
		if c > 1 {
			multi++
		}
	}
	if len(jobs) != s.Keys || multi > 0 {
		t.Errorf("%s: %d Jobs created for %d keys (%d keys had more than one)", topo.label, created, s.Keys, multi)
	}
	if jobsLeft > 0 {
		t.Errorf("%s: %d Jobs left behind", topo.label, jobsLeft)
	}
	_ = nc.Drain()

	// NATS down: store size and figures.
	var natsRSS, natsCPU, store []float64
	natsMetrics := map[string]float64{}
	for i, n := range nodes {
		rep := n.stop(t, time.Minute)
		natsRSS = append(natsRSS, rep.RSSMiB)
		natsCPU = append(natsCPU, rep.CPUSeconds)
		for k, v := range rep.Metrics {
			natsMetrics[k] += v
		}
		store = append(store, float64(duBytes(filepath.Join(dir, fmt.Sprintf("store-%d", i))))/(1<<20))
	}
	parentCPU := cpuSeconds() - parentCPU0

	// Figures.
	rate := func(from, to int) float64 {
		if to >= len(arrivals) || from >= to {
			return 0
		}
		return float64(to-from) / arrivals[to].Sub(arrivals[from]).Seconds()
	}
	n := len(arrivals)
	row("requests answered", "requests", float64(n))
	row("wall time", "s", wall.Seconds())
	row("throughput", "requests/s", float64(n)/wall.Seconds())
	for q := range 4 {
		row(fmt.Sprintf("throughput, answers %d–%d%%", 25*q, 25*(q+1)), "requests/s", rate(n*q/4, min(n*(q+1)/4, n-1)))
	}
	// What an answer costs in CPU, all processes together: a cost that
	// rises as the buckets and streams grow is what stops scaling; a rate
	// that falls at a flat cost is the machine's other load.
	cost := func(a, b int) float64 {
		return 1000 * cpuBetween(cpuSamples, arrivals[a], arrivals[b]) / float64(b-a)
	}
	for q := range 4 {
		if a, b := n*q/4, min(n*(q+1)/4, n-1); a < b {
			row(fmt.Sprintf("CPU per answer, all processes, answers %d–%d%%", 25*q, 25*(q+1)), "ms", cost(a, b))
		}
	}
	// How busy the slots were: all slots in use means the answers wait on
	// the builds (or on the handlers); idle slots with a backlog mean they
	// wait on what feeds the slots.
	busy := func(from, to time.Time) float64 {
		var used, n float64
		for _, ss := range slotSamples {
			for _, x := range ss {
				if at := time.UnixMilli(x.At); !at.Before(from) && at.Before(to) {
					used += float64(x.Busy)
					n++
				}
			}
		}
		if n == 0 {
			return 0
		}
		return 100 * used / n / float64(s.InFlight)
	}
	for q := range 4 {
		if a, b := n*q/4, min(n*(q+1)/4, n-1); a < b {
			row(fmt.Sprintf("worker slots in use, answers %d–%d%%", 25*q, 25*(q+1)), "%", busy(arrivals[a], arrivals[b]))
		}
	}
	row("publish time (all requests stored)", "s", publishTook.Seconds())
	row("Jobs created", "Jobs", float64(created))
	row("answers from a build", "requests", float64(origins[v1.OriginBuild]))
	row("answers joining a build in flight", "requests", float64(origins[v1.OriginInflight]))
	row("answers from the index", "requests", float64(origins[v1.OriginCache]))
	for _, o := range []v1.Origin{v1.OriginBuild, v1.OriginInflight, v1.OriginCache} {
		if hs := handling[o]; len(hs) > 0 {
			row(fmt.Sprintf("handling time of an answer %s, p50", originLabel[o]), "ms", benchfmt.Percentile(hs, 50))
			row(fmt.Sprintf("handling time of an answer %s, p99", originLabel[o]), "ms", benchfmt.Percentile(hs, 99))
		}
	}
	row(fmt.Sprintf("a build's time from its claim to its outcome (emulated build: %s), p50", s.Build), "ms", benchfmt.Percentile(buildMs, 50))
	row("results published again (same result, dropped by the stream)", "publishes", float64(republished))
	row("cache hits answered at intake (one ledger write)", "requests", metrics["buildq_cache_hits_answered_total/intake"])
	row("cache hits answered from the queue (one ledger write)", "requests", metrics["buildq_cache_hits_answered_total/queue"])
	row("requests held at intake while their key built, answered where held (one ledger write)", "requests", metrics["buildq_cache_hits_answered_total/held"])
	row("requests parked", "requests", metrics["buildq_parked_requests_total"])
	row("transient retries", "retries", metrics["buildq_retries_total"])
	row("worker peak RSS, max", "MiB", slices.Max(rss))
	row("worker peak RSS, mean", "MiB", mean(rss))
	row("NATS peak RSS, max node", "MiB", slices.Max(natsRSS))
	row("NATS store on disk, max node", "MiB", slices.Max(store))
	if topo.nodes > 1 {
		row("NATS store on disk, all nodes", "MiB", sum(store))
	}
	for _, st := range scaleStreams {
		b, a := before[st.stream], after[st.stream]
		if strings.HasPrefix(st.stream, "KV_") {
			row(st.label+" messages, before", "messages", float64(b.msgs))
			row(st.label+" bytes, before", "MiB", float64(b.bytes)/(1<<20))
		}
		row(st.label+" messages, after", "messages", float64(a.msgs))
		row(st.label+" bytes, after", "MiB", float64(a.bytes)/(1<<20))
		row(st.label+" writes per request", "writes", float64(a.lastSeq-b.lastSeq)/float64(max(n, 1)))
	}
	row("messages into the NATS servers per request (clients and routes)", "messages", natsMetrics["in_msgs"]/float64(max(n, 1)))
	row("messages out of the NATS servers per request", "messages", natsMetrics["out_msgs"]/float64(max(n, 1)))
	ledger := after["KV_"+v1.RequestsBucket]
	row("ledger bytes per request", "B", float64(ledger.bytes)/float64(max(n, 1)))
	row("CPU, NATS (all nodes)", "CPU-s", sum(natsCPU))
	row("CPU, workers (all)", "CPU-s", sum(wcpu))
	row("CPU, harness (registry, publisher, result reader)", "CPU-s", parentCPU)
	machine := (cpuSamples[len(cpuSamples)-1].cpu - cpuSamples[0].cpu) / (cpuSamples[len(cpuSamples)-1].at.Sub(cpuSamples[0].at).Seconds() * float64(benchfmt.ThisMachine().CPUs))
	row("CPU of the machine used by this benchmark's processes", "%", 100*machine)
	row("CPU of the machine busy (all processes, /proc/stat)", "%", machineBusy)

	if census != nil {
		out.notes = append(out.notes, topo.label+": "+census.report(n))
		t.Log(out.notes[len(out.notes)-1])
	}
	// What bounds it.
	total := sum(natsCPU) + sum(wcpu) + parentCPU
	if n > 1 {
		// Over the same window as the bare protocol's: from the first
		// publish to the last answer.
		out.sum = scaleSummary{wall: wall.Seconds(), hitRate: rate(n-n/4, n-1), msgsIn: natsMetrics["in_msgs"] / float64(n),
			cpuPerAnswer: 1000 * cpuBetween(cpuSamples, start, arrivals[n-1]) / float64(n), natsCPU: sum(natsCPU), clientCPU: sum(wcpu) + parentCPU,
			hitCPU: cost(n/2, n-1)}
	}
	// The first answers include every build (the first request of each key);
	// the second quarter on are answered mostly from the index.
	second, last := rate(n/4, n/2), rate(n-n/4, n-1)
	out.notes = append(out.notes, fmt.Sprintf(
		"%s: %d requests answered in %.0f s (%.0f/s; answers 25–50%%: %.0f/s, 75–100%%: %.0f/s); CPU: NATS %.0f%%, workers %.0f%%, harness %.0f%% of %.0f CPU-s; the machine was %.0f%% busy (%.0f%% by these processes).",
		topo.label, n, wall.Seconds(), float64(n)/wall.Seconds(), second, last,
		100*sum(natsCPU)/total, 100*sum(wcpu)/total, 100*parentCPU/total, total, machineBusy, 100*machine))
	// What stops scaling first: the CPU each kind of process spends per
	// answer. Workers scale out; a NATS server's share does not, and on a
	// cluster its busiest node (the leaders of the hottest streams) bounds.
	if n > 0 {
		natsPer := 1000 * slices.Max(natsCPU) / float64(n)
		workerPer := 1000 * sum(wcpu) / float64(n)
		out.notes = append(out.notes, fmt.Sprintf(
			"%s: what stops scaling: per answer (whole run, builds included), the busiest NATS node spent %.2f ms of CPU and the workers %.2f ms together. Workers scale out; that NATS node does not: at one core of its own it would answer at most about %.0f requests/s, the ceiling of this topology whatever the number of workers. Worker memory stayed flat (peak RSS %.0f MiB at most); the NATS node's grew with what it stores (peak %.0f MiB for a %.0f MiB store).",
			topo.label, natsPer, workerPer, 1000/natsPer, slices.Max(rss), slices.Max(natsRSS), slices.Max(store)))
	}
	// The builds: the first answers, one per key.
	if hs := handling[v1.OriginBuild]; len(hs) > 0 && n >= 4 {
		slots := s.Workers * s.InFlight
		used := busy(arrivals[0], arrivals[n/4])
		held := benchfmt.Percentile(hs, 50)
		out.notes = append(out.notes, fmt.Sprintf(
			"%s: the builds come first (the first request of every key): %d slots (%d workers × %d) were %.0f%% in use during the first quarter of the answers and a build held its slot %.0f ms (p50; %s emulated, %.0f ms from claim to outcome), so builds ran at about %.0f/s: bound by slots × build time, not by the queue.",
			topo.label, slots, s.Workers, s.InFlight, used, held, s.Build, benchfmt.Percentile(buildMs, 50), float64(slots)*used/100/(held/1000)))
	}
	// What grows with the traffic: the ledger and the results are kept for
	// --results-max-age (7 days by default), one entry each per request.
	res := after[v1.ResultsStream]
	perReq := float64(ledger.bytes+res.bytes) / float64(max(n, 1))
	out.notes = append(out.notes, fmt.Sprintf(
		"%s: kept per request: %.0f B of ledger and %.0f B of result; at this run's %.0f requests/s sustained, the default 7-day retention (--results-max-age) would hold %.0f GiB per replica — linear in traffic × retention, the first thing to size.",
		topo.label, float64(ledger.bytes)/float64(max(n, 1)), float64(res.bytes)/float64(max(n, 1)), float64(n)/wall.Seconds(),
		perReq*float64(n)/wall.Seconds()*7*24*3600/(1<<30)))
	if note := costTrendNote(topo, arrivals, start.Add(publishTook), cost, rate, ledger, res); note != "" {
		out.notes = append(out.notes, note)
	}
	if topo.nodes > 1 {
		out.notes = append(out.notes, leadersNote(topo, after, natsCPU, n))
		out.notes = append(out.notes, largerClusterNote(topo, natsCPU, n))
	}
	return out
}

// startScaleNodes starts topo's NATS nodes, their stores under dir, and
// waits until each serves; natsURL names them all.
func startScaleNodes(t *testing.T, s scaleSettings, topo scaleTopology, dir string) (nodes []*scaleProc, natsURL string) {
	t.Helper()
	ports := make([]int, topo.nodes)
	cports := make([]int, topo.nodes)
	for i := range topo.nodes {
		ports[i] = freePort(t)
		if topo.nodes > 1 {
			cports[i] = freePort(t)
		}
	}
	var urls []string
	for i := range topo.nodes {
		spec := scaleChild{Role: "nats", Name: fmt.Sprintf("%s-nats-%d", topo.name, i), Port: ports[i],
			StoreDir: filepath.Join(dir, fmt.Sprintf("store-%d", i))}
		if topo.nodes > 1 {
			spec.ClusterPort = cports[i]
			for j := range topo.nodes {
				if j != i {
					spec.Routes = append(spec.Routes, fmt.Sprintf("nats-route://127.0.0.1:%d", cports[j]))
				}
			}
		}
		if s.ProfileDir != "" && i == 0 {
			spec.Profile = filepath.Join(s.ProfileDir, topo.name+"-nats.pprof")
		}
		nodes = append(nodes, startScaleChild(t, dir, "TestBenchScaleNATS", spec))
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", ports[i]))
	}
	for _, n := range nodes {
		n.waitReady(t, time.Minute)
	}
	return nodes, strings.Join(urls, ",")
}
