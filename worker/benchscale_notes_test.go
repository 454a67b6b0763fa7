//go:build benchscale && linux

package worker

import (
	"fmt"
	"slices"
	"strings"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// The scale benchmark's notes: what the figures of one run say.

// leadersNote says, on a cluster, which node leads each stream and bucket
// (one Raft group each, whose leader takes all its writes) and how much
// CPU each node spent.
func leadersNote(topo scaleTopology, after map[string]streamSize, natsCPU []float64, n int) string {
	var leaders []string
	for _, st := range scaleStreams {
		if l := after[st.stream].leader; l != "" {
			leaders = append(leaders, st.label+" on "+strings.TrimPrefix(l, topo.name+"-"))
		}
	}
	var per []string
	for i, c := range natsCPU {
		per = append(per, fmt.Sprintf("nats-%d %.0f", i, c))
	}
	ledger := after["KV_"+v1.RequestsBucket]
	return fmt.Sprintf(
		"%s: every stream and bucket is one Raft group whose leader takes all its writes (%.1f ledger writes per request); stream leaders: %s; CPU-s by node: %s.",
		topo.label, float64(ledger.lastSeq)/float64(max(n, 1)), strings.Join(leaders, ", "), strings.Join(per, ", "))
}

// costTrendNote compares an answer's CPU cost in the last quarter of the
// answers with the first of the second and third quarters that began
// after publishing ended (before, publishing and intake share the CPU);
// "" when the quarters are too short to compare.
func costTrendNote(topo scaleTopology, arrivals []time.Time, published time.Time, cost, rate func(a, b int) float64, ledger, res streamSize) string {
	n := len(arrivals)
	last := rate(n-n/4, n-1)
	base := 0
	for q := 1; q <= 2 && n >= 8; q++ {
		if arrivals[n*q/4].After(published) {
			base = q
			break
		}
	}
	// The CPU is sampled every second: quarters shorter than 10 s are
	// not compared.
	long := func(a, b int) bool { return arrivals[b].Sub(arrivals[a]) >= 10*time.Second }
	if base == 0 || !long(n*base/4, n*(base+1)/4) || !long(n-n/4, n-1) {
		return ""
	}
	c2, c4 := cost(n*base/4, n*(base+1)/4), cost(n-n/4, n-1)
	second := rate(n*base/4, n*(base+1)/4)
	which := map[int]string{1: "second", 2: "third"}[base]
	if c4 > 1.2*c2 {
		return fmt.Sprintf(
			"%s: an answer's CPU cost (all processes) rose %.0f%% from the %s quarter of the answers to the last (%.1f → %.1f ms) while the ledger grew to %d entries (%.1f MiB) and the results stream to %d: the cost grows with the stored state.",
			topo.label, 100*(c4/c2-1), which, c2, c4, ledger.msgs, float64(ledger.bytes)/(1<<20), res.msgs)
	}
	return fmt.Sprintf(
		"%s: an answer's CPU cost (all processes) went from %.1f ms in the %s quarter of the answers to %.1f ms in the last while the ledger grew to %d entries (%.1f MiB) and the results stream to %d: nothing here costs more as the stored state grows; the rate (%.0f → %.0f/s) followed the CPU the machine's other load left over.",
		topo.label, c2, which, c4, ledger.msgs, float64(ledger.bytes)/(1<<20), res.msgs, second, last)
}

// largerClusterNote says what 5 and 7 nodes would do, from this run's NATS
// CPU per answer: with replicas 3 every write still costs three nodes'
// work, so more nodes spread the Raft groups (their leaders and replicas),
// not the work per answer; the ceiling rises with the nodes only as far
// as the groups spread evenly, and one group's leader — the busiest node's
// share at best — bounds it whatever the nodes.
func largerClusterNote(topo scaleTopology, natsCPU []float64, n int) string {
	if n == 0 || len(natsCPU) == 0 {
		return ""
	}
	perAnswer := 1000 * sum(natsCPU) / float64(n) // ms, all nodes
	busiest := 1000 * slices.Max(natsCPU) / float64(n)
	at := func(nodes int) float64 { return float64(nodes) * 1000 / perAnswer }
	return fmt.Sprintf("%s: larger clusters, from this run's CPU: the servers spent %.2f ms of CPU per answer in all, %.2f ms on the busiest node. With replicas 3 a write costs three nodes' work however many there are, so 5 or 7 nodes spread the six Raft groups (three streams, three buckets), not the work: with the groups evenly spread and a core per node, about %.0f answers/s on 5 nodes and %.0f on 7 (nodes × 1000 / the ms per answer; the same reckoning gives %.0f for these %d). A single group's leader does not split: BUILDQ_RESULTS and the ledger, every request's writes, each bound the cluster at what one core gives them, which is where partitioning the streams by tenant comes in.",
		topo.label, perAnswer, busiest, at(5), at(7), at(topo.nodes), topo.nodes)
}
