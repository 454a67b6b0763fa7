package worker

// TestFaultSimulation: the seeded, randomized fault simulation (issue 9).
//
//	go test ./worker/ -run '^TestFaultSimulation$'                      # seeds 1..8
//	BUILDQ_SIM_SEEDS=200 go test ./worker/ -run '^TestFaultSimulation$' # seeds 1..200
//	BUILDQ_SIM_SEED=17 go test ./worker/ -run '^TestFaultSimulation$' -v # replay seed 17
//	BUILDQ_SIM_SEED=17 BUILDQ_SIM_REPEAT=5 go test ./worker/ -run …      # … five times
//
// Variables (or the flags -sim.seeds, -sim.seed, -sim.first,
// -sim.parallel): BUILDQ_SIM_SEEDS (how many seeds), BUILDQ_SIM_FIRST (the
// first seed, default 1), BUILDQ_SIM_SEED (one seed), BUILDQ_SIM_PARALLEL
// (schedules at once), BUILDQ_SIM_REPEAT (runs of each seed, default 1:
// a replay repeats the schedule, while goroutines may interleave
// differently, so a timing-dependent violation may need a few runs),
// BUILDQ_SIM_LOGS=1 (add the workers' logs to a
// failing seed's report), BUILDQ_SIM_STOP=1 (start no more schedules once
// one found a violation: the mutation tests need one kill, not all).

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var (
	simSeedsFlag    = flag.Int("sim.seeds", 0, "fault simulation: how many seeds (BUILDQ_SIM_SEEDS; default 8)")
	simFirstFlag    = flag.Int64("sim.first", 0, "fault simulation: the first seed (BUILDQ_SIM_FIRST; default 1)")
	simSeedFlag     = flag.Int64("sim.seed", 0, "fault simulation: run only this seed (BUILDQ_SIM_SEED)")
	simParallelFlag = flag.Int("sim.parallel", 0, "fault simulation: schedules run at once (BUILDQ_SIM_PARALLEL)")
)

func simSetting(flagValue int64, env string, def int64, t *testing.T) int64 {
	if flagValue != 0 {
		return flagValue
	}
	if v := os.Getenv(env); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: %v", env, v, err)
		}
		return n
	}
	return def
}

func TestFaultSimulation(t *testing.T) {
	first := simSetting(*simFirstFlag, "BUILDQ_SIM_FIRST", 1, t)
	n := simSetting(int64(*simSeedsFlag), "BUILDQ_SIM_SEEDS", 8, t)
	if one := simSetting(*simSeedFlag, "BUILDQ_SIM_SEED", 0, t); one != 0 {
		first, n = one, 1
	}
	// A replay repeats the schedule, not every thread switch: run a seed
	// several times to see a timing-dependent violation again.
	repeat := simSetting(0, "BUILDQ_SIM_REPEAT", 1, t)
	stopEarly := os.Getenv("BUILDQ_SIM_STOP") != ""
	var violated atomic.Bool
	parallel := simSetting(int64(*simParallelFlag), "BUILDQ_SIM_PARALLEL", min(n*repeat, 8), t)
	if testing.Short() && n > 2 {
		n = 2
	}

	began := time.Now()
	var (
		mu       sync.Mutex
		outcomes []simOutcome
		wg       sync.WaitGroup
		sem      = make(chan struct{}, parallel)
	)
	var runs []int64
	for seed := first; seed < first+n; seed++ {
		for range repeat {
			runs = append(runs, seed)
		}
	}
	for i, seed := range runs {
		name := fmt.Sprintf("seed=%d", seed)
		if repeat > 1 {
			name += fmt.Sprintf("/run=%d", i%int(repeat)+1)
		}
		sem <- struct{}{}
		if stopEarly && violated.Load() {
			<-sem
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t.Run(name, func(t *testing.T) {
				out := runSimSchedule(t, seed)
				mu.Lock()
				outcomes = append(outcomes, out)
				mu.Unlock()
				if len(out.violations) > 0 {
					violated.Store(true)
					t.Error(out.report)
				} else if len(runs) == 1 {
					t.Log(out.report)
				}
			})
		}()
	}
	wg.Wait()
	t.Log(simSummary(outcomes, first, n, time.Since(began)))
}

// simSummary aggregates the outcomes: which invariants failed, in which
// seeds.
func simSummary(outs []simOutcome, first, n int64, took time.Duration) string {
	sort.Slice(outs, func(i, j int) bool { return outs[i].seed < outs[j].seed })
	var b strings.Builder
	failed := 0
	bySeeds := map[string][]int64{}
	counts := map[string]int{}
	infra, infraSeeds := 0, 0
	var slowest simOutcome
	var total, worst time.Duration
	stalled, stalledSeeds := 0, 0
	for _, o := range outs {
		if o.stalled > 0 {
			stalled += o.stalled
			stalledSeeds++
		}
		worst = max(worst, o.worstSecond)
		if len(o.violations) > 0 {
			failed++
		}
		seen := map[string]bool{}
		for _, v := range o.violations {
			counts[v.class]++
			if !seen[v.class] {
				seen[v.class] = true
				bySeeds[v.class] = append(bySeeds[v.class], o.seed)
			}
		}
		if o.infra > 0 {
			infra += o.infra
			infraSeeds++
		}
		if o.dur > slowest.dur {
			slowest = o
		}
		total += o.dur
	}
	fmt.Fprintf(&b, "fault simulation: %d schedules (seeds %d..%d) in %s, %d with violations", len(outs), first, first+n-1, took.Round(time.Second), failed)
	if len(outs) > 0 {
		fmt.Fprintf(&b, "; schedule time mean %s, max %s (seed %d)", (total / time.Duration(len(outs))).Round(100*time.Millisecond), slowest.dur.Round(100*time.Millisecond), slowest.seed)
		// The machine's pace: seconds in which it could not keep up are
		// not judged for order (simStalls).
		fmt.Fprintf(&b, "; %d stalled seconds in %d seeds, the worst second %s late", stalled, stalledSeeds, worst.Round(time.Millisecond))
	}
	b.WriteString("\n")
	var classes []string
	for c := range bySeeds {
		classes = append(classes, c)
	}
	slices.SortFunc(classes, func(a, b string) int { return len(bySeeds[b]) - len(bySeeds[a]) })
	for _, c := range classes {
		seeds := bySeeds[c]
		var ss []string
		for i, s := range seeds {
			if i == 12 {
				ss = append(ss, fmt.Sprintf("… %d more", len(seeds)-12))
				break
			}
			ss = append(ss, strconv.FormatInt(s, 10))
		}
		fmt.Fprintf(&b, "  %-24s %4d violations in %3d seeds: %s\n", c, counts[c], len(seeds), strings.Join(ss, " "))
		// The fault kinds every one of those seeds had: a first hint.
		common := map[string]int{}
		for _, o := range outs {
			if slices.Contains(seeds, o.seed) {
				for _, k := range o.kinds {
					common[k]++
				}
			}
		}
		var all []string
		for _, k := range simKinds {
			if common[k] == len(seeds) {
				all = append(all, k)
			}
		}
		if len(all) > 0 {
			fmt.Fprintf(&b, "  %-24s (every one of those seeds had: %s)\n", "", strings.Join(all, " "))
		}
	}
	results := map[string]int{}
	for _, o := range outs {
		for k, v := range o.results {
			results[k] += v
		}
	}
	var rs []string
	for k, v := range results {
		rs = append(rs, fmt.Sprintf("%s %d", k, v))
	}
	slices.Sort(rs)
	fmt.Fprintf(&b, "  results stored: %s\n", strings.Join(rs, ", "))
	parked, requeued, atIntake, fromQueue, direct, held, heldHits := 0, 0, 0, 0, 0, 0, 0
	nFirst, nLost := 0, 0
	for _, o := range outs {
		nFirst += o.publishedFirst
		nLost += o.lostPublishes
		atIntake += o.atIntake
		fromQueue += o.queuedHits
		held += o.held
		heldHits += o.heldHits
		direct += o.direct
		parked += o.parked
		requeued += o.requeued
	}
	fmt.Fprintf(&b, "  cache hits answered at intake: %d; from the queue with one write: %d\n", atIntake, fromQueue)
	fmt.Fprintf(&b, "  requests held at intake while their key built: %d (answered where held: %d; the others went to the queue)\n", held, heldHits)
	fmt.Fprintf(&b, "  requests taken straight from intake (no queue hop): %d\n", direct)
	fmt.Fprintf(&b, "  requests parked on builds in progress: %d (requeued: %d)\n", parked, requeued)
	fmt.Fprintf(&b, "  results published before their decision was recorded: %d; publishes that lost to another result stored first: %d\n", nFirst, nLost)
	republished := 0
	var republishedSeeds []string
	for _, o := range outs {
		if o.republished > 0 {
			republished += o.republished
			republishedSeeds = append(republishedSeeds, strconv.FormatInt(o.seed, 10))
		}
	}
	fmt.Fprintf(&b, "  results published more than once (the same decision; the stream keeps one, core subscribers see each): %d in %d seeds", republished, len(republishedSeeds))
	if len(republishedSeeds) > 0 {
		fmt.Fprintf(&b, " (seeds %s)", strings.Join(republishedSeeds[:min(len(republishedSeeds), 20)], " "))
	}
	b.WriteString("\n")
	if infra > 0 {
		fmt.Fprintf(&b, "  InfrastructureError results under injected API errors (allowed): %d in %d seeds\n", infra, infraSeeds)
	}
	return b.String()
}
