package worker

// One schedule of the fault simulation: build the world, drive the
// schedule, heal, wait until everything is quiet, and judge.

import (
	"github.com/prometheus/client_golang/prometheus"

	"cmp"
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/publisher"
)

// How long the oracle waits, after healing, for the world to settle. Far
// longer than a correct worker needs (the longest retry delay is a minute).
var (
	simResultsTimeout = 80 * time.Second
	simQueueTimeout   = 30 * time.Second
	simJobsTimeout    = simTTL + simBuildFloor + simBuildSpan + 15*time.Second
)

type simViolation struct {
	class  string
	detail string
}

// simOutcome is what one schedule came to.
type simOutcome struct {
	seed       int64
	dur        time.Duration
	violations []simViolation
	infra      int
	kinds      []string
	report     string
	results    map[string]int // stored results by status/reason
	atIntake   int            // cache hits answered at intake
	queuedHits int            // plain cache hits taken from the queue, answered with one write
	held       int            // requests held at intake (intakehold.go)
	heldHits   int            // held requests answered from the cache where they were held
	direct     int            // requests taken straight from intake (fairq's direct.go)
	parked     int            // requests parked on a build in progress
	requeued   int            // parked requests published again
	// publishedFirst: results published before their decision was
	// recorded; lostPublishes: publishes of another status than the
	// result stored first (a cancel's race with a build's end).
	publishedFirst, lostPublishes int
	// republished: requests whose (same) result was published more than
	// once: not a violation (a worker killed between its publish and its
	// ack publishes it again), but each copy reaches core subscribers.
	republished int
	// stalled: the seconds of the schedule in which the machine could
	// not keep up (simStalls); worstSecond: the most lateness in one.
	stalled     int
	worstSecond time.Duration
}

var (
	simIdentityOnce sync.Once
	simIdentity     string
)

// simExecutorIdentity is the kaniko backend's identity (part of build keys).
func simExecutorIdentity(t *testing.T) string {
	simIdentityOnce.Do(func() {
		cs := newAPIServer().newClient("identity", nil)
		watcher, err := kube.NewWatcher(kube.NewInformerFactory(cs, simKaniko.Namespace), nil)
		if err != nil {
			t.Fatal(err)
		}
		b, err := NewKubeBackend(cs, watcher, simKaniko)
		if err != nil {
			t.Fatal(err)
		}
		simIdentity = b.Identity()
	})
	return simIdentity
}

func simRequestFor(seed int64, ctx, variant int, id, tenant, name, prio string, platforms []string) *v1.Request {
	d := hex64(fmt.Sprintf("sim-%d-context-%d", seed, ctx))
	labels := map[string]string{"team": "platform"}
	if variant != 0 {
		labels["variant"] = fmt.Sprint(variant)
	}
	return &v1.Request{
		APIVersion: v1.APIVersion, RequestID: id, Tenant: tenant, Name: name,
		Source:        v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: "contexts/sha256/" + d + ".tar.gz"}},
		ContextDigest: "sha256:" + d,
		BuildArgs:     map[string]string{"VERSION": fmt.Sprint(ctx)},
		Labels:        labels,
		SubmittedAt:   time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC),
		// Priorities spread over the schedule's requests (unless the plan
		// names one); not in the key.
		Priority:  cmp.Or(prio, []string{"", v1.PriorityHigh, v1.PriorityLow}[len(id)%3]),
		Platforms: platforms,
	}
}

func (w *simWorld) newSub(id string, ctx, variant int, tenant, name, prio string, platforms []string) *simSub {
	req := simRequestFor(w.seed, ctx, variant, id, tenant, name, prio, platforms)
	key := v1.BuildKey(req, w.identity)
	content := func(r *v1.Request) string {
		args, err := kaniko.Args(kaniko.Spec{Request: r, Key: v1.BuildKey(r, w.identity), Destinations: []string{"sim.invalid/x:y"}}, simKaniko.Defaults())
		if err != nil {
			w.t.Fatalf("harness: kaniko args: %v", err)
		}
		return simContentArgs(args)
	}
	label := fmt.Sprintf("C%d", ctx)
	if variant != 0 {
		label += fmt.Sprintf("/L%d", variant)
	}
	s := &simSub{id: id, req: req, key: key, label: label}
	names := map[string]string{key: fmt.Sprintf("K%d", ctx)}
	if multiPlatform(req) {
		names[key] += "[" + strings.Join(req.PlatformsOrDefault(), "+") + "]"
		for _, p := range req.PlatformsOrDefault() {
			sub := platformRequest(req, p)
			pk := v1.BuildKey(sub, w.identity)
			s.platforms = append(s.platforms, simPlatform{platform: p, key: pk, content: content(sub)})
			names[pk] = fmt.Sprintf("K%d/%s", ctx, p)
		}
	} else {
		s.content = content(req)
		if len(req.Platforms) == 1 {
			names[key] = fmt.Sprintf("K%d/%s", ctx, req.Platforms[0])
		}
	}
	w.mu.Lock()
	w.subs = append(w.subs, s)
	w.subByID[id] = s
	for k, n := range names {
		if _, ok := w.keyNames[k]; !ok {
			w.keyNames[k] = n
		}
	}
	w.mu.Unlock()
	return s
}

// runSimSchedule runs one seed and judges it.
func runSimSchedule(t *testing.T, seed int64) simOutcome {
	return runSim(t, newSimSchedule(seed))
}

// runSim runs one schedule and judges it.
func runSim(t *testing.T, sc *simSchedule) simOutcome {
	began := time.Now()
	seed := sc.seed
	w := &simWorld{
		t: t, seed: seed, sc: sc, trace: &simTrace{t0: time.Now()}, logs: &simLogBuffer{},
		metrics:  NewMetrics(prometheus.NewRegistry()),
		keyNames: map[string]string{}, subByID: map[string]*simSub{},
	}
	w.identity = simExecutorIdentity(t)
	w.node = &simNode{w: w, jobs: map[string]*simJob{}}
	node := simNodeOptions(newSimPlanner(seed, func(string) float64 { return sc.failProb }), !sc.has("no-ttl"))
	node.observe, node.ended, node.pushing, node.checking = w.node.observe, w.node.ended, w.node.pushing, w.node.checking
	node.logf = w.trace.add
	w.world = newWorld(t, worldConfig{nats: natsConfig{Name: "buildq-sim"}, registry: true, node: node})
	defer w.world.nats.Stop() // now, not with the test: a scenario may run several times
	out := simOutcome{seed: seed, kinds: sc.kinds}

	var err error
	if w.obs, err = w.connect("sim-observer"); err != nil {
		t.Fatal(err)
	}
	defer w.obs.Close()
	if w.pub, err = publisher.New(w.obs); err != nil {
		t.Fatal(err)
	}
	if w.js, err = jetstream.New(w.obs); err != nil {
		t.Fatal(err)
	}
	if err := w.watchResults(); err != nil {
		t.Fatal(err)
	}
	if err := w.watchEvents(); err != nil {
		t.Fatal(err)
	}
	if err := w.watchIngest(); err != nil {
		t.Fatal(err)
	}
	// The world's images, prepared before anything is timed.
	for _, p := range sc.reqs {
		w.newSub(p.id, p.ctx, p.variant, p.tenant, p.name, p.prio, p.platforms)
	}
	for _, s := range w.subs {
		if _, err := s.want(); err != nil {
			t.Fatal(err)
		}
	}
	if sc.has("hand-tags") {
		w.pushHandTags()
	}

	for i := range sc.workers {
		s := &simSlot{idx: i, skew: sc.skews[i], pauses: map[string][]time.Duration{}}
		if s.proxy, err = newSimProxy(w.world.nats.Addr, w.runtimeRand()); err != nil {
			t.Fatal(err)
		}
		w.slots = append(w.slots, s)
		w.start(s)
	}
	defer func() {
		for _, s := range w.slots {
			s.proxy.close()
		}
	}()
	defer w.shutdown()
	// The workers create the streams; the schedule starts once they exist.
	if !simPoll(30*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _, _, err := w.queueState(ctx)
		return err == nil
	}) {
		t.Fatalf("harness: the workers did not create the streams")
	}

	w.trace.mu.Lock()
	for i, l := range w.trace.lines {
		if _, rest, ok := strings.Cut(l, "s  "); ok {
			w.trace.lines[i] = "  setup  " + rest
		}
	}
	w.trace.t0 = time.Now()
	w.trace.mu.Unlock()
	if err := w.watchRecords(context.Background()); err != nil {
		t.Fatalf("harness: %v", err)
	}
	w.faultsOn.Store(true)
	w.stalls.watch(w.now)
	defer w.stalls.end() // a harness failure's Fatal too
	w.drive()
	w.heal()
	w.trace.add("----  healed: no more faults")
	w.settle(&out)
	w.stalls.end()
	out.stalled, out.worstSecond = w.stalls.summary()
	out.dur = time.Since(began)
	if !simPoll(30*time.Second, func() bool { return w.recordsCopied(context.Background()) }) {
		t.Errorf("harness: the copy of the build records lags")
	}
	rc, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	recs, err := w.readRecords(rc)
	rcancel()
	if err != nil {
		t.Fatalf("harness: read the build records: %v", err)
	}
	lc, lcancel := context.WithTimeout(context.Background(), 30*time.Second)
	ledger, err := w.readLedger(lc)
	if err != nil {
		lcancel()
		t.Fatalf("harness: read the request ledger: %v", err)
	}
	decided, err := w.readDecided(lc)
	lcancel()
	if err != nil {
		t.Fatalf("harness: read the request ledger's writes: %v", err)
	}
	indexed := w.checkIndexed(recs)
	w.mu.Lock()
	w.records, w.ledger, w.indexed, w.decidedAt = recs, ledger, indexed, decided
	w.mu.Unlock()
	w.judge(&out)
	return out
}

// simPoll waits until cond holds (polling; test code only).
func simPoll(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (w *simWorld) sleepUntil(at time.Duration) {
	if d := at - w.now(); d > 0 {
		time.Sleep(d)
	}
}

func (w *simWorld) proc(slot int) *simProc {
	s := w.slots[slot%len(w.slots)]
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}

func (w *simWorld) sub(id string) *simSub {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.subByID[id]
}

// latestAccepted is the accepted submission published last before now.
func (w *simWorld) latestAccepted(prefer *simSub) *simSub {
	w.mu.Lock()
	defer w.mu.Unlock()
	if prefer != nil && prefer.accepted {
		return prefer
	}
	var best *simSub
	for _, s := range w.subs {
		if s.accepted && (best == nil || s.start > best.start) {
			best = s
		}
	}
	return best
}

// drive runs the schedule's events at their times.
func (w *simWorld) drive() {
	sc := w.sc
	type ev struct {
		at  time.Duration
		req *simSub
		f   *simFault
	}
	var evs []ev
	for i := range sc.reqs {
		evs = append(evs, ev{at: sc.reqs[i].at, req: w.sub(sc.reqs[i].id)})
	}
	for i := range sc.faults {
		evs = append(evs, ev{at: sc.faults[i].at, f: &sc.faults[i]})
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	var restarting sync.Mutex
	resubmits := 0
	for _, e := range evs {
		w.sleepUntil(e.at)
		if e.req != nil {
			w.ops.Add(1)
			go func() { defer w.ops.Done(); w.submit(e.req) }()
			continue
		}
		f := *e.f
		switch f.kind {
		case "kill", "term":
			w.replace(w.slots[f.slot], f.kind == "kill", f.dur)
		case "nats-restart":
			if restarting.TryLock() {
				w.ops.Add(1)
				go func() {
					defer w.ops.Done()
					defer restarting.Unlock()
					w.restartNATS(f.dur)
				}()
			}
		case "late-hand-tag":
			w.ops.Add(1)
			go func() { defer w.ops.Done(); w.pushLateHandTag(w.sub(sc.reqs[f.req].id)) }()
		case "lost-ack":
			w.lostAcks.Add(1)
			w.trace.add("fault the next ack will be lost")
		case "api-errors":
			af := &apiFault{until: time.Now().Add(f.dur), p: f.p, committed: f.flag}
			w.mu.Lock()
			w.apiFaults++
			w.mu.Unlock()
			for i := range w.slots {
				if f.slot >= 0 && i != f.slot {
					continue
				}
				if p := w.proc(i); p != nil {
					p.client.setFault(af)
					w.trace.add("fault api errors on %s for %s (p=%.2f)", p.id, f.dur, f.p)
				}
			}
		case "lag":
			af := &apiFault{until: time.Now().Add(f.dur), lag: f.lag}
			for i, s := range w.slots {
				if f.slot >= 0 && i != f.slot {
					continue
				}
				s.proxy.setLag(f.lag)
				if p := w.proc(i); p != nil {
					p.client.setFault(af)
				}
				w.trace.add("fault lag on w%d: up to %s for %s", i, f.lag, f.dur)
				w.ops.Add(1)
				time.AfterFunc(f.dur, func() {
					defer w.ops.Done()
					s.proxy.setLag(0)
					w.trace.add("fault lag on w%d ended", i)
				})
			}
		case "stall":
			s := w.slots[f.slot]
			s.mu.Lock()
			s.stallNext = f.dur
			s.mu.Unlock()
			w.trace.add("fault w%d's next handler to read a build record stalls %s, the worker cut off NATS", f.slot, f.dur)
		case "partition":
			s := w.slots[f.slot]
			s.proxy.partition()
			w.trace.add("fault w%d cut off NATS for %s", f.slot, f.dur)
			w.ops.Add(1)
			time.AfterFunc(f.dur, func() {
				defer w.ops.Done()
				s.proxy.heal()
				w.trace.add("fault w%d reaches NATS again", f.slot)
			})
		case "watch-break":
			if p := w.proc(f.slot); p != nil {
				n := w.world.api.breakWatches(p.client, f.flag)
				w.trace.add("fault %d watches of %s broken (410 Gone: %v)", n, p.id, f.flag)
			}
		case "job-delete", "pod-delete":
			w.deleteExternally(f.kind == "pod-delete", f.pick)
		case "pause-renew", "pause-finalize":
			s := w.slots[f.slot]
			s.mu.Lock()
			hook := strings.TrimPrefix(f.kind, "pause-")
			s.pauses[hook] = append(s.pauses[hook], f.dur)
			s.mu.Unlock()
			w.trace.add("fault w%d's next %s will block %s", f.slot, hook, f.dur)
		case "dup-publish":
			target := w.latestAccepted(w.sub(w.sc.reqs[f.req].id))
			if target == nil {
				continue
			}
			w.ops.Add(1)
			go func() { defer w.ops.Done(); w.republish(target) }()
		case "cancel":
			target := w.latestAccepted(w.sub(w.sc.reqs[f.req].id))
			if target == nil {
				w.trace.add("fault cancel: nothing published yet")
				continue
			}
			resubmits++
			id := fmt.Sprintf("s%d-x%02d", w.seed, resubmits)
			w.ops.Add(1)
			go func() {
				defer w.ops.Done()
				what := target.id
				if f.flag {
					what = target.key
				}
				var re *simSub
				if f.resubmit != 0 {
					p := w.sc.reqs[0]
					for _, q := range w.sc.reqs {
						if q.id == target.id {
							p = q
						}
					}
					if strings.Contains(target.id, "-x") {
						// a resubmit of a resubmit: same content as its origin
						p.ctx, p.variant = simCtxOf(target.label)
					}
					re = w.newSub(id, p.ctx, p.variant, target.req.Tenant, target.req.Name, target.req.Priority, target.req.Platforms)
				}
				if f.resubmit == 2 {
					// One worker's deletes held up a while: if it is the
					// one that answers the cancel, the cancel's delete
					// comes after the racing resubmit's new run replaced
					// the old Job with its own.
					lag := &apiFault{until: time.Now().Add(2500 * time.Millisecond), lag: 50 * time.Millisecond, deleteLag: 1500 * time.Millisecond}
					if p := w.proc(f.slot); p != nil {
						p.client.setFault(lag)
						w.trace.add("fault deletes of %s held up 1.5s for 2.5s", p.id)
					}
					w.ops.Add(1)
					go func() {
						defer w.ops.Done()
						time.Sleep(time.Duration(f.pick%30) * time.Millisecond)
						w.submit(re)
					}()
				}
				w.cancel(what, target.key, target.req.Tenant, target.req.Name)
				if f.resubmit == 1 {
					w.submit(re)
				}
			}()
		}
	}
	w.sleepUntil(w.sc.window)
}

func simCtxOf(label string) (ctx, variant int) {
	_, _ = fmt.Sscanf(label, "C%d/L%d", &ctx, &variant)
	return ctx, variant
}

// heal ends every fault: NATS up, a worker in every slot, no injected
// errors, pauses or lost acks from now on.
func (w *simWorld) heal() {
	w.faultsOn.Store(false)
	w.lostAcks.Store(0)
	w.mu.Lock()
	procs := slices.Clone(w.procs)
	w.mu.Unlock()
	for _, p := range procs {
		p.client.setFault(nil)
	}
	for _, s := range w.slots {
		s.mu.Lock()
		s.pauses = map[string][]time.Duration{}
		s.stallNext = 0
		s.mu.Unlock()
		s.proxy.heal()
	}
	done := make(chan struct{})
	go func() { w.ops.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		w.t.Errorf("harness: the schedule's operations did not end")
	}
	if !w.world.nats.Running() {
		if err := w.world.nats.Start(); err != nil {
			w.t.Fatalf("harness: %v", err)
		}
	}
	for _, s := range w.slots {
		s.mu.Lock()
		t := s.pending
		s.pending = nil
		s.mu.Unlock()
		if t != nil {
			t.Stop()
			w.start(s)
		}
	}
}
