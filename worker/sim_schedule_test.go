package worker

// The fault simulation's schedules: everything random about a run is drawn
// here, from the seed, before the world starts. (Timing still interleaves
// goroutines differently from run to run: a replay repeats the schedule,
// not every thread switch.)

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// Fault kinds. "skew", "labels", "no-ttl" (no TTL controller: the workers
// alone delete the Jobs) and "mixed" (workers with different leases and
// AckWaits) shape the whole schedule; the others are events at times
// within the fault window. "lag" delays a worker's NATS traffic and API
// calls; "partition" cuts a worker off NATS for longer than the lease.
var simKinds = []string{
	"kill", "term", "nats-restart", "lost-ack", "api-errors", "watch-break", "job-delete", "pod-delete",
	"cancel", "dup-publish", "pause-renew", "pause-finalize", "skew", "labels", "no-ttl",
	"lag", "partition", "mixed",
}

// simMaxSkew bounds the clock skew between workers: ±5 leases.
const simMaxSkew = 5 * simLease

type simSchedule struct {
	seed     int64
	window   time.Duration
	workers  int
	contexts int
	failProb float64
	kinds    []string
	skews    []time.Duration
	// leases and ackWaits per worker slot ("mixed"; else simLease and
	// simAckWait).
	leases   []time.Duration
	ackWaits []time.Duration
	reqs     []simReqPlan
	faults   []simFault
	burst    *simBurst
	// noHolds: no worker holds requests at intake (the frozen scenarios,
	// found before holds existed, run the paths they found); otherwise
	// holds vary by seed and worker (simWorld.holdAtIntake).
	noHolds bool
	// legacyContexts: the workers read contexts as before fetch-context
	// (fetchContext), unless tags are pushed by hand while they run.
	legacyContexts bool
	// frozen: drawn for a frozen scenario (newFrozenSchedule), whose
	// schedule stays what it was when the scenario was found.
	frozen bool
}

type simReqPlan struct {
	at      time.Duration
	id      string
	ctx     int
	variant int
	tenant  string
	name    string
	// prio, when set, is the request's priority ("" : spread by id).
	prio string
	// platforms, when set, are the request's ("platforms": an image index
	// or one platform, sharing platforms' builds with other requests of
	// the same content).
	platforms []string
}

// simBurst is a tenant's burst of distinct builds, then one request of
// the other tenant and one of a higher priority of the burst's own: who is
// taken next when a slot frees (the shares and the priorities) is what it
// tries. No fault comes near it, so the order can be judged.
type simBurst struct {
	at            time.Duration
	tenant, other string
	n             int
	// extra builds of the burst's tenant after the first n, where no
	// tenant has a concurrency limit: enough to keep every slot busy for
	// two more rounds, so that the other tenant's request has waited past
	// simOrderSlack while slots still free (a burst only as long as the
	// slots it fills is worked off before the order can be judged).
	extra int
}

type simFault struct {
	at   time.Duration
	kind string
	slot int
	dur  time.Duration
	p    float64
	flag bool // watch-break: 410 Gone; api-errors: creates may commit; cancel: by key
	req  int  // cancel, dup-publish: index of the target request
	// cancel: 0 no resubmit, 1 resubmit after the reply, 2 resubmit racing it
	resubmit int
	pick     int
	lag      time.Duration // lag: the most a message or API call is held
}

func (s *simSchedule) has(kind string) bool { return slices.Contains(s.kinds, kind) }

var simTenants = []string{"acme", "globex"}
var simNames = []string{"web", "api"}

func newSimSchedule(seed int64) *simSchedule { return drawSimSchedule(seed, false) }

// newFrozenSchedule is seed's schedule for a frozen scenario
// (sim_frozen_test.go): drawn as it was when the scenario was found, and
// run on the paths it found then.
func newFrozenSchedule(seed int64) *simSchedule {
	s := drawSimSchedule(seed, true)
	s.noHolds = true
	s.legacyContexts = true
	// Found before tags pushed by hand were modeled: the paths they
	// found run without them.
	s.kinds = slices.DeleteFunc(s.kinds, func(k string) bool { return k == "hand-tags" })
	return s
}

func drawSimSchedule(seed int64, frozen bool) *simSchedule {
	r := rand.New(rand.NewPCG(uint64(seed), 0xb111d9))
	dur := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(r.Int64N(int64(hi-lo)+1)) }
	s := &simSchedule{
		seed:     seed,
		frozen:   frozen,
		window:   dur(5*time.Second, 9*time.Second),
		workers:  2 + r.IntN(2),
		contexts: 2 + r.IntN(5),
		failProb: 0.15 + 0.35*r.Float64(),
	}
	for _, k := range simKinds {
		p := 0.4
		if k == "labels" {
			p = 0.2
		}
		if r.Float64() < p {
			s.kinds = append(s.kinds, k)
		}
	}
	s.skews = make([]time.Duration, s.workers)
	if s.has("skew") {
		for i := range s.skews {
			s.skews[i] = dur(-simMaxSkew, simMaxSkew).Round(time.Millisecond)
		}
	}
	for range s.workers {
		lease, ack := simLease, simAckWait
		if s.has("mixed") {
			lease = []time.Duration{simLease, 3 * simLease / 2, 2 * simLease}[r.IntN(3)]
			ack = []time.Duration{simAckWait, 2 * simAckWait}[r.IntN(2)]
		}
		s.leases = append(s.leases, lease)
		s.ackWaits = append(s.ackWaits, ack)
	}
	n := 10 + r.IntN(21)
	for i := range n {
		p := simReqPlan{
			at:     dur(0, s.window*85/100),
			id:     fmt.Sprintf("s%d-r%02d", seed, i),
			ctx:    min(r.IntN(s.contexts), r.IntN(s.contexts)), // some keys popular: dedupe
			tenant: simTenants[r.IntN(len(simTenants))],
			name:   simNames[r.IntN(len(simNames))],
		}
		if s.has("labels") && r.IntN(3) == 0 {
			p.variant = 1
		}
		s.reqs = append(s.reqs, p)
	}
	sort.SliceStable(s.reqs, func(i, j int) bool { return s.reqs[i].at < s.reqs[j].at })
	for _, k := range s.kinds {
		if k == "skew" || k == "labels" || k == "no-ttl" || k == "mixed" {
			continue
		}
		for range 1 + r.IntN(3) {
			f := simFault{at: dur(300*time.Millisecond, s.window), kind: k, slot: r.IntN(s.workers), pick: r.IntN(1000)}
			switch k {
			case "kill", "term":
				f.dur = dur(100*time.Millisecond, 2*time.Second) // until the replacement starts
			case "nats-restart":
				// Up to three leases: claims and slots lapse meanwhile.
				f.dur = dur(100*time.Millisecond, 3*simLease)
			case "api-errors":
				f.dur = dur(500*time.Millisecond, 3*time.Second)
				f.p = 0.3 + 0.6*r.Float64()
				f.flag = r.IntN(2) == 0
				if r.IntN(3) == 0 {
					f.slot = -1 // every worker
				}
			case "watch-break":
				f.flag = r.IntN(2) == 0
			case "cancel":
				f.flag = r.IntN(2) == 0
				f.req = r.IntN(n)
				f.resubmit = r.IntN(3)
			case "dup-publish":
				f.req = r.IntN(n)
			case "pause-renew", "pause-finalize":
				f.dur = dur(simLease*3/2, 3*simLease)
			case "lag":
				f.dur = dur(500*time.Millisecond, 3*time.Second)
				f.lag = dur(20*time.Millisecond, 250*time.Millisecond)
				if r.IntN(3) == 0 {
					f.slot = -1 // every worker
				}
			case "partition":
				f.dur = dur(simLease*3/2, 4*simLease)
			}
			s.faults = append(s.faults, f)
		}
	}
	sort.SliceStable(s.faults, func(i, j int) bool { return s.faults[i].at < s.faults[j].at })
	s.addBurst()
	s.addStalls()
	s.addPlatforms()
	s.addLateHandTags()
	// Tags pushed by hand before any request (simWorld.pushHandTags),
	// in two seeds of five: drawn from the seed's hash, not from r, so
	// the rest of every seed's schedule stays what it was.
	if simHash(seed, "hand-tags", 0)%5 < 2 {
		s.kinds = append(s.kinds, "hand-tags")
	}
	return s
}

// fetchContext reports whether the schedule's workers run in the
// production shape (simFetchKaniko): with tags pushed by hand while the
// requests run, and in half of the other schedules (drawn from the seed's
// hash), so that builds claimed and started before their tag's HEAD and
// builds started after it both meet every fault, tags taken among them.
// Not the frozen scenarios' (legacyContexts): the paths they found run
// as they did.
func (s *simSchedule) fetchContext() bool {
	return s.has("late-hand-tags") || (!s.legacyContexts && simHash(s.seed, "fetch-context", 0)%2 == 0)
}

// addLateHandTags gives a quarter of the schedules tags pushed by hand
// while the requests run ("late-hand-tags"): each a "late-hand-tag" fault
// that pushes an image of its own to one request's first tag a moment
// after that request is published — most often after its preflight found
// the tag free and before its build ends. Those schedules run the
// workers in the production shape (contexts through fetch-context, whose
// --absent check the node plays), so the build Pod is what finds the
// tag taken. Drawn from a generator of its own: the rest of a seed's
// schedule stays what it was.
func (s *simSchedule) addLateHandTags() {
	r := rand.New(rand.NewPCG(uint64(s.seed), 0x1a7e7a9))
	if r.IntN(4) != 0 || len(s.reqs) == 0 {
		return
	}
	s.kinds = append(s.kinds, "late-hand-tags")
	for range 2 + r.IntN(3) {
		i := r.IntN(len(s.reqs))
		if len(s.reqs[i].platforms) > 1 {
			continue // an image index's tags are its platforms' own
		}
		// Within 150 ms of the publish (around the preflight, or
		// before the Pod's check: podStart), or of 600 ms (while the
		// build runs, simBuildFloor at the least).
		within := []time.Duration{150 * time.Millisecond, 600 * time.Millisecond}[r.IntN(2)]
		s.faults = append(s.faults, simFault{kind: "late-hand-tag", req: i,
			at: s.reqs[i].at + time.Duration(r.Int64N(int64(within)))})
	}
	sort.SliceStable(s.faults, func(i, j int) bool { return s.faults[i].at < s.faults[j].at })
}

// simPlatformSets are the platforms a "platforms" schedule's requests ask
// for: an image index of two (in either order: one key), or one of its
// platforms alone; the default platform is the index's linux/amd64.
var simPlatformSets = [][]string{{"linux/amd64", "linux/arm64"}, {"linux/arm64", "linux/amd64"}, {"linux/arm64"}}

// addPlatforms gives a third of the schedules requests of several
// platforms ("platforms"): each platform a build of its own key, shared
// with the one-platform and default requests of the same content. Drawn
// from a generator of its own: the rest of a seed's schedule stays what
// it was.
func (s *simSchedule) addPlatforms() {
	r := rand.New(rand.NewPCG(uint64(s.seed), 0x91a7f))
	if r.IntN(3) != 0 {
		return
	}
	s.kinds = append(s.kinds, "platforms")
	for i := range s.reqs {
		if s.reqs[i].ctx < 100 && r.IntN(2) == 0 {
			s.reqs[i].platforms = simPlatformSets[r.IntN(len(simPlatformSets))]
		}
	}
}

// addStalls gives a third of the schedules a worker whose handlers stall
// while it is cut off NATS ("stall"): its requests are redelivered and
// handled elsewhere meanwhile, and a stalled handler goes on afterwards
// with what it read before. Drawn from a generator of its own.
func (s *simSchedule) addStalls() {
	r := rand.New(rand.NewPCG(uint64(s.seed), 0x57a11))
	if r.IntN(3) != 0 {
		return
	}
	s.kinds = append(s.kinds, "stall")
	for range 1 + r.IntN(2) {
		f := simFault{kind: "stall", at: 300*time.Millisecond + time.Duration(r.Int64N(int64(s.window))), slot: r.IntN(s.workers),
			dur: 3*simLease + time.Duration(r.Int64N(int64(2*simLease)))}
		if b := s.burst; b != nil && f.at+f.dur >= b.at-2*time.Second && f.at <= b.at+12*time.Second {
			continue
		}
		s.faults = append(s.faults, f)
	}
	sort.SliceStable(s.faults, func(i, j int) bool { return s.faults[i].at < s.faults[j].at })
}

// addBurst gives a quarter of the schedules a burst (simBurst), drawn from
// a generator of its own: the rest of a seed's schedule stays what it was.
// Its extra builds are not drawn: they follow from the seed's workers and
// fair-share settings (simWorld.fair), and a frozen scenario has none.
func (s *simSchedule) addBurst() {
	r := rand.New(rand.NewPCG(uint64(s.seed), 0xb0257))
	if r.IntN(4) != 0 {
		return
	}
	t := r.IntN(2)
	b := &simBurst{
		at:     time.Second + time.Duration(r.Int64N(int64(s.window/3))),
		tenant: simTenants[t], other: simTenants[1-t],
		n: 12 + r.IntN(10),
	}
	if !s.frozen && simUnlimited(s.seed) {
		b.extra = 2 * s.workers * simMaxInFlight
	}
	s.burst = b
	s.kinds = append(s.kinds, "burst")
	for i := range b.n + b.extra {
		s.reqs = append(s.reqs, simReqPlan{at: b.at + time.Duration(i)*time.Millisecond, id: fmt.Sprintf("s%d-b%02d", s.seed, i),
			ctx: 100 + i, tenant: b.tenant, name: simNames[i%2], prio: v1.PriorityLow})
	}
	later := b.at + 300*time.Millisecond
	s.reqs = append(s.reqs,
		simReqPlan{at: later, id: fmt.Sprintf("s%d-bh", s.seed), ctx: 100 + b.n + b.extra, tenant: b.tenant, name: "web", prio: v1.PriorityHigh},
		simReqPlan{at: later, id: fmt.Sprintf("s%d-bo", s.seed), ctx: 101 + b.n + b.extra, tenant: b.other, name: "web", prio: v1.PriorityNormal},
	)
	sort.SliceStable(s.reqs, func(i, j int) bool { return s.reqs[i].at < s.reqs[j].at })
	// Nothing in the way while the burst is worked off.
	quiet := s.faults[:0]
	for _, f := range s.faults {
		if f.at+f.dur < b.at-2*time.Second || f.at > b.at+12*time.Second {
			quiet = append(quiet, f)
		}
	}
	s.faults = quiet
}

func (f simFault) String() string {
	w := fmt.Sprintf("w%d", f.slot)
	if f.slot < 0 {
		w = "all workers"
	}
	var what string
	switch f.kind {
	case "kill", "term":
		what = fmt.Sprintf("%s %s, replaced after %s", f.kind, w, f.dur)
	case "nats-restart":
		what = fmt.Sprintf("nats-server restart, down %s", f.dur)
	case "lost-ack":
		what = "lose the next ack"
	case "api-errors":
		what = fmt.Sprintf("job create/delete errors on %s for %s, p=%.2f, commit-then-timeout=%v", w, f.dur, f.p, f.flag)
	case "watch-break":
		what = fmt.Sprintf("break the watches of %s (410 Gone: %v)", w, f.flag)
	case "job-delete", "pod-delete":
		what = f.kind + " (external)"
	case "cancel":
		by := "request id"
		if f.flag {
			by = "build key"
		}
		what = fmt.Sprintf("cancel request #%d by %s, resubmit: %s", f.req, by, []string{"no", "after the reply", "racing the cancel"}[f.resubmit])
	case "dup-publish":
		what = fmt.Sprintf("publish request #%d again (same Nats-Msg-Id)", f.req)
	case "pause-renew", "pause-finalize":
		what = fmt.Sprintf("%s: %s blocks %s", f.kind, w, f.dur)
	case "lag":
		what = fmt.Sprintf("lag on %s for %s: NATS traffic and API calls held up to %s", w, f.dur, f.lag)
	case "partition":
		what = fmt.Sprintf("partition: %s cut off NATS for %s", w, f.dur)
	case "stall":
		what = fmt.Sprintf("stall: %s's next handler to read a build record stalls %s, the worker cut off NATS meanwhile", w, f.dur)
	}
	return fmt.Sprintf("%7.3fs  %s", f.at.Seconds(), what)
}

func (s *simSchedule) describe() string {
	var b strings.Builder
	fmt.Fprintf(&b, "schedule: fault window %s, %d workers, %d contexts, %d requests, build failure rate %.0f%%\n",
		s.window.Round(time.Millisecond), s.workers, s.contexts, len(s.reqs), 100*s.failProb)
	fmt.Fprintf(&b, "  fault kinds: %s\n", strings.Join(s.kinds, " "))
	if s.burst != nil {
		fmt.Fprintf(&b, "  burst at %.3fs: %d builds of %s (low), then one of %s and a high one of %s\n",
			s.burst.at.Seconds(), s.burst.n+s.burst.extra, s.burst.tenant, s.burst.other, s.burst.tenant)
	}
	if s.has("mixed") {
		var cfg []string
		for i := range s.leases {
			cfg = append(cfg, fmt.Sprintf("w%d lease %s ackWait %s", i, s.leases[i], s.ackWaits[i]))
		}
		fmt.Fprintf(&b, "  workers: %s\n", strings.Join(cfg, ", "))
	}
	if s.has("skew") {
		var sk []string
		for i, d := range s.skews {
			sk = append(sk, fmt.Sprintf("w%d %+v", i, d))
		}
		fmt.Fprintf(&b, "  clock skew: %s\n", strings.Join(sk, ", "))
	}
	for _, f := range s.faults {
		fmt.Fprintf(&b, "  %s\n", f)
	}
	return b.String()
}
