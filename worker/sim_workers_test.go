package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	batchv1 "k8s.io/api/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
)

// The simulation's worker processes: their configuration, start, kill,
// termination and replacement.

func (w *simWorld) workerConfig(id string, slot int, skew time.Duration) Config {
	enc := zap.NewDevelopmentEncoderConfig()
	enc.TimeKey = ""
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w.logs), zapcore.InfoLevel)
	logger := zap.New(core)
	return Config{
		ID:              id,
		MaxInFlight:     simMaxInFlight,
		AckWait:         w.sc.ackWaits[slot],
		MaxDeliver:      simMaxDeliver,
		Lease:           w.sc.leases[slot],
		ShutdownTimeout: 5 * time.Second,
		Naming:          naming.Policy{Registry: w.world.reg.host},
		Registry:        w.world.reg.client,
		Logger:          logger.Named(id),
		Metrics:         w.metrics,
		Now:             func() time.Time { return time.Now().Add(skew) },
		Fair:            w.fair(),
		HoldAtIntake:    w.holdAtIntake(slot),
		FirstAge:        w.firstAge(slot),
		// Under the node's least time from a Job's creation to its push
		// (podStart and simBuildFloor), as the default is under a real
		// node's.
		TagCheckBeside: podStart + simBuildFloor - 50*time.Millisecond,
	}
}

// firstAge varies, by seed and worker, how young a request must be for a
// finished build's result to be published before its decision is
// recorded: the default (half the duplicate window: every request of a
// schedule), or a second or two, so that later decisions are recorded
// first and their publishes look for a result stored first
// (ledger.Results.Find).
func (w *simWorld) firstAge(slot int) time.Duration {
	return []time.Duration{0, 2 * time.Second, 700 * time.Millisecond}[(int(w.seed)+slot)%3]
}

// holdAtIntake varies, by seed and worker, whether intake holds requests
// whose key is being built (intakehold.go) and for how long: never (its
// duplicates are queued and parked by their handlers), a few seconds
// (holds run out within the schedule and are admitted), or the default.
func (w *simWorld) holdAtIntake(slot int) time.Duration {
	if w.sc.noHolds {
		return -1
	}
	return []time.Duration{-1, 3 * time.Second, 0}[(int(w.seed)/2+slot)%3]
}

// simMaxInFlight is each simulated worker's build slots.
const simMaxInFlight = 4

// simUnlimited reports whether seed's workers run without fair-queueing
// rules (even seeds; see fair).
func simUnlimited(seed int64) bool { return seed%2 == 0 }

// fair gives odd seeds fair-queueing rules: acme at most 2 requests at
// once across all workers, globex twice acme's share.
func (w *simWorld) fair() FairConfig {
	if simUnlimited(w.seed) {
		return FairConfig{}
	}
	return FairConfig{Concurrency: map[string]int{"acme": 2}, Weights: map[string]int{"globex": 2}}
}

var simKaniko = func() kaniko.Config {
	kc := testKaniko
	kc.InsecureRegistries = nil
	return kc
}()

// simFetchKaniko is simKaniko in the production shape, for the schedules
// with tags pushed by hand while they run ("late-hand-tags") and half of
// those with tags pushed by hand before (simSchedule.fetchContext):
// contexts through fetch-context, whose --absent the node checks. Their
// workers start a fresh key's build before its tag's HEAD, sent once the
// Job is created (checksTagBeside); the others' after it.
var simFetchKaniko = func() kaniko.Config {
	kc := simKaniko
	kc.FetchImage = "ghcr.io/buildq/buildq@sha256:" + hex64("sim-fetch")
	return kc
}()

// simPresign is the simulation's presigner: the object's own s3://
// address, which the node reads as the context (simContentOf).
func simPresign(_ context.Context, bucket, key string, _ time.Duration) (string, error) {
	return "s3://" + bucket + "/" + key, nil
}

// kaniko is the Job configuration of w's workers.
func (w *simWorld) kaniko() kaniko.Config {
	if w.sc.fetchContext() {
		return simFetchKaniko
	}
	return simKaniko
}

// start starts the slot's next worker.
func (w *simWorld) start(s *simSlot) {
	s.mu.Lock()
	id := fmt.Sprintf("w%d.%d", s.idx, s.gen)
	s.gen++
	s.pending = nil
	s.mu.Unlock()

	client := w.world.api.newClient(id, w.runtimeRand())
	client.onFault = func(verb, name string, err error) {
		w.trace.add("api   %s: %s job %s failed: %v", id, verb, name, err)
	}
	nc, err := w.connectTo(s.proxy.url(), id, nats.ReconnectBufSize(-1)) // as `buildq worker` connects
	if err != nil {
		w.t.Errorf("harness: connect %s: %v", id, err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &simProc{id: id, slot: s, nc: nc, client: client, cancel: cancel, done: make(chan struct{})}
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()
	w.mu.Lock()
	w.procs = append(w.procs, p)
	w.mu.Unlock()
	w.trace.add("work  %s started (clock %+v)", id, s.skew)

	factory := kube.NewInformerFactory(client, simKaniko.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		w.t.Errorf("harness: watcher: %v", err)
		cancel()
		close(p.done)
		return
	}
	backend, err := NewKubeBackend(client, watcher, w.kaniko())
	if err != nil {
		w.t.Errorf("harness: backend: %v", err)
		cancel()
		close(p.done)
		return
	}
	backend.WithPresigner(simPresign)
	w.mu.Lock()
	if w.identity == "" {
		w.identity = backend.Identity()
	}
	w.mu.Unlock()
	factory.Start(ctx.Done())
	cfg := w.workerConfig(id, s.idx, s.skew)
	go func() {
		defer close(p.done)
		defer factory.Shutdown()
		defer nc.Close()
		sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
		synced := watcher.WaitForSync(sctx)
		scancel()
		if !synced {
			if ctx.Err() == nil {
				w.trace.add("work  %s: informers did not sync", id)
			}
			return
		}
		for ctx.Err() == nil {
			wk, err := New(nc, backend, cfg)
			if err != nil {
				w.t.Errorf("harness: New(%s): %v", id, err)
				return
			}
			wk.faults = &faultHooks{
				loseAck: func(requestID string) bool {
					if p.killed.Load() || !w.faultsOn.Load() {
						return false
					}
					for {
						n := w.lostAcks.Load()
						if n <= 0 {
							return false
						}
						if w.lostAcks.CompareAndSwap(n, n-1) {
							w.trace.add("fault %s: ack of %s lost", id, requestID)
							return true
						}
					}
				},
				beforeRenew: func(key string) {
					if d := s.takePause("renew"); d > 0 && !p.killed.Load() {
						w.trace.add("fault %s: paused %s before renewing %s", id, d, w.keyName(key))
						time.Sleep(d)
						w.trace.add("fault %s: resumed (renew %s)", id, w.keyName(key))
					}
				},
				beforeWalk: func(key string) {
					s.mu.Lock()
					d := s.stallNext
					s.mu.Unlock()
					if d == 0 || p.killed.Load() || !w.faultsOn.Load() || !w.claimable(key) {
						return
					}
					s.mu.Lock()
					d, s.stallNext = s.stallNext, 0
					s.mu.Unlock()
					if d > 0 {
						// Cut off, its heartbeats fail and its request is
						// redelivered elsewhere; it goes on afterwards
						// with what it knew.
						s.proxy.partition()
						w.trace.add("fault %s: a handler stalls %s before reading %s, the worker cut off NATS", id, d.Round(time.Millisecond), w.keyName(key))
						time.Sleep(d)
						s.proxy.heal()
						w.trace.add("fault %s: the stalled handler goes on (%s)", id, w.keyName(key))
					}
				},
				beforeFinalize: func(key string) {
					if d := s.takePause("finalize"); d > 0 && !p.killed.Load() {
						w.trace.add("fault %s: paused %s before finalizing %s", id, d, w.keyName(key))
						time.Sleep(d)
						w.trace.add("fault %s: resumed (finalize %s)", id, w.keyName(key))
					}
				},
			}
			// One Setup at a time in a world: nats-server 2.15 races
			// (-race) between a stream update and a consumer create
			// from two clients at once.
			w.setupMu.Lock()
			sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
			err = wk.Setup(sctx)
			scancel()
			w.setupMu.Unlock()
			if err == nil {
				err = wk.Run(ctx)
			}
			if ctx.Err() != nil {
				break
			}
			if !p.killed.Load() {
				w.trace.add("work  %s: Run returned %v; starting it again", id, err)
			}
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
			}
		}
		if !p.killed.Load() {
			w.trace.add("work  %s stopped", id)
		}
	}()
}

// kill is SIGKILL: the connection drops first (no hand-back, no ack), the
// API client dies, then everything is abandoned.
func (w *simWorld) kill(p *simProc) {
	p.killed.Store(true)
	p.nc.Close()
	p.client.dead.Store(true)
	w.world.api.breakWatches(p.client, false)
	p.cancel()
	w.trace.add("fault %s killed (SIGKILL)", p.id)
}

// term is SIGTERM: the worker hands its requests back and stops.
func (w *simWorld) term(p *simProc) {
	w.trace.add("fault %s terminated (SIGTERM)", p.id)
	p.cancel()
}

// replace stops the slot's worker and starts another after delay.
func (w *simWorld) replace(s *simSlot, hard bool, delay time.Duration) {
	s.mu.Lock()
	p := s.proc
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	if hard {
		w.kill(p)
	} else {
		w.term(p)
	}
	s.mu.Lock()
	s.pending = time.AfterFunc(delay, func() {
		s.mu.Lock()
		stale := s.pending == nil
		s.mu.Unlock()
		if !stale {
			w.start(s)
		}
	})
	s.mu.Unlock()
}

// restartNATS stops the server and starts it again on the same store and
// port after down.
func (w *simWorld) restartNATS(down time.Duration) {
	w.trace.add("fault nats-server stopped (down %s)", down)
	if err := w.world.nats.Restart(down); err != nil {
		w.t.Errorf("harness: restart nats-server: %v", err)
		return
	}
	w.trace.add("fault nats-server started again")
}

// runtimeRand is a per-client random source for the runtime choices of
// injected faults; seeded, though timing decides which call draws what.
func (w *simWorld) runtimeRand() func() float64 {
	var mu sync.Mutex
	w.mu.Lock() // slots restart concurrently (replace's timers)
	n := len(w.procs)
	w.mu.Unlock()
	x := uint64(w.seed)*0x9E3779B97F4A7C15 + uint64(n+1)*0xBF58476D1CE4E5B9
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		return float64(x>>11) / float64(1<<53)
	}
}

// submit publishes a submission; a failed publish is retried with the same
// id (as a producer would) until a PubAck says it is stored.
func (w *simWorld) submit(s *simSub) {
	w.mu.Lock()
	s.start = w.now()
	w.mu.Unlock()
	ctx := context.Background()
	for attempt := range 40 {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		req := *s.req
		ack, err := w.pub.Publish(pctx, &req)
		cancel()
		if err == nil {
			w.mu.Lock()
			s.accepted = true
			w.mu.Unlock()
			extra := ""
			if attempt > 0 {
				extra = fmt.Sprintf(" after %d failed attempts", attempt)
			}
			if ack.Duplicate && attempt == 0 {
				extra += " (DUPLICATE?)"
			}
			w.trace.add("req   %s %s %s/%s %s published seq %d%s", s.id, s.label, s.req.Tenant, s.req.Name, w.keyName(s.key), ack.Sequence, extra)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	w.trace.add("req   %s: never stored (NATS unavailable)", s.id)
}

// republish publishes an accepted request again, same id and body.
func (w *simWorld) republish(s *simSub) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req := *s.req
	ack, err := w.pub.Publish(ctx, &req)
	switch {
	case err != nil:
		w.trace.add("fault duplicate publish of %s: %v", s.id, err)
	case ack.Duplicate:
		w.trace.add("fault duplicate publish of %s: dropped as duplicate", s.id)
	default:
		w.mu.Lock()
		s.reacc++
		w.mu.Unlock()
		w.trace.add("fault duplicate publish of %s: STORED AGAIN as seq %d (the stream forgot the id)", s.id, ack.Sequence)
		w.note("a duplicate publish of %s was stored again by the stream (seq %d)", s.id, ack.Sequence)
	}
}

// cancel sends a cancel for a key or request id and records the answer.
func (w *simWorld) cancel(target, key, tenant, name string) *simCancel {
	c := &simCancel{target: target, key: key, tenant: tenant, name: name, sent: w.now(), done: simNever}
	w.mu.Lock()
	w.cancels = append(w.cancels, c)
	w.mu.Unlock()
	what := w.keyName(key)
	if target != key {
		what = "request " + target
	}
	m, err := tenantAPIRequest(w.obs, tenant, v1.CancelSubject(tenant, name), target, 5*time.Second)
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		c.done, c.reply = c.sent, "no responders"
	case err != nil:
		c.canceled, c.reply = true, "unknown: "+err.Error()
	default:
		var rep v1.CancelReply
		_ = json.Unmarshal(m.Data, &rep)
		c.done, c.canceled, c.reply = w.now(), rep.Canceled, rep.Message
	}
	w.trace.add("fault cancel %s (%s/%s): canceled=%v %q", what, tenant, name, c.canceled, c.reply)
	return c
}

// watchResults records every result publish (core NATS sees repeats the
// stream drops).
func (w *simWorld) watchResults() error {
	_, err := w.obs.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil {
			return
		}
		id := strings.TrimPrefix(m.Header.Get(v1.MsgIDHeader), r.Data.Tenant+"/")
		w.mu.Lock()
		w.published = append(w.published, simPublish{id: id, subject: m.Subject, at: w.now(), r: r})
		w.mu.Unlock()
		d := r.Data
		extra := d.Reason
		if d.Digest != "" {
			extra = d.Digest[7:19]
		}
		w.trace.add("res   %s %s/%s %s %s by %s", id, d.Status, d.Origin, w.keyName(d.Key), extra, strings.TrimPrefix(r.Source, "/buildq/worker/"))
	})
	if err != nil {
		return err
	}
	return w.obs.Flush()
}

// storedResults reads every message of BUILDQ_RESULTS.
type simStored struct {
	id      string
	subject string
	r       v1.Result
}

func (w *simWorld) storedResults(ctx context.Context) ([]simStored, error) {
	var out []simStored
	err := w.streamMsgs(ctx, v1.ResultsStream, func(m *jetstream.RawStreamMsg) error {
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil {
			return fmt.Errorf("result seq %d: %w", m.Sequence, err)
		}
		out = append(out, simStored{id: strings.TrimPrefix(m.Header.Get(v1.MsgIDHeader), r.Data.Tenant+"/"), subject: m.Subject, r: r})
		return nil
	})
	return out, err
}

// streamMsgs hands each message stored in stream to f, in order.
func (w *simWorld) streamMsgs(ctx context.Context, stream string, f func(m *jetstream.RawStreamMsg) error) error {
	s, err := w.js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.Msgs == 0 {
		return err
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return err
		}
		if err := f(m); err != nil {
			return err
		}
	}
	return nil
}

// queueState is the requests' state: messages left in intake and the
// tenants' queues, those waiting, and those held.
func (w *simWorld) queueState(ctx context.Context) (msgs uint64, pending uint64, ackPending int, err error) {
	q, err := ReadQueueState(ctx, w.js)
	if err != nil {
		return 0, 0, 0, err
	}
	return q.Messages, q.Waiting, q.Held, nil
}

// liveJobs lists the Jobs that exist now.
func (w *simWorld) liveJobs() []string {
	var out []string
	_ = w.world.api.do(func() error {
		l, err := w.world.api.tracker.List(jobsGVR, kindOf(jobsGVR), testNamespace)
		if err != nil {
			return err
		}
		for _, j := range l.(*batchv1.JobList).Items {
			done, ok := kube.Finished(&j)
			state := "running"
			if done {
				state = map[bool]string{true: "succeeded", false: "failed"}[ok]
			}
			if j.DeletionTimestamp != nil {
				state += ", terminating"
			}
			out = append(out, fmt.Sprintf("%s %s %s (%s)", w.keyName(j.Annotations[kaniko.AnnotationKey]), j.Name, j.UID, state))
		}
		return nil
	})
	slices.Sort(out)
	return out
}

// claimable reports whether key's build record would let a handler claim
// a new run (absent, or failed): a stall there is one after which a
// handler that forgot to check its request's answer would build again.
func (w *simWorld) claimable(key string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	kv, err := w.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		return false
	}
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return true
	}
	if err != nil {
		return false
	}
	var r v1.BuildRecord
	return json.Unmarshal(e.Value(), &r) == nil && r.State == v1.StateFailed
}
