//go:build integration && benche2e

package integration

import (
	"fmt"
	"slices"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/benchfmt"
)

// TestBenchE2EPlatforms measures P11 on the real node: the wall time of
// one request for linux/amd64 and linux/386 (a RUN each, so each is a
// real kaniko build; 386 runs on the amd64 node by
// --platform-node-selector), from submit to its result, against the
// slower of the two one-platform requests of other content in the same
// round: what building the image index costs over building its slowest
// platform.
func TestBenchE2EPlatforms(t *testing.T) {
	start := time.Now()
	node := startRealNode(t)
	s := newSuite(t, options{node: node})
	s.startBenchWorker("w1", "--platform-node-selector", "linux/386=kubernetes.io/arch=amd64")
	res := s.collect()
	base := goarchIndex(t, node, "amd64", "386")

	const rounds = 4
	done := 0
	build := func(content string, platforms ...string) time.Duration {
		dir := contextDir(t, map[string]string{
			"Dockerfile": "ARG BASE\nFROM $BASE\nRUN [\"/hello\"]\nCOPY f /f\n",
			"f":          content,
		})
		began := time.Now()
		got := done
		done++
		s.submitWith(dir, "bench", 1, func(r *v1.Request) {
			r.BuildArgs = map[string]string{"BASE": base}
			r.Platforms = platforms
		})
		r := res.wait(t, got+1, 10*time.Minute)[got]
		if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
			t.Fatalf("result %s, want a build of its own", mustJSON(r))
		}
		return time.Since(began)
	}
	var index, slowest, overhead []float64
	for i := range rounds {
		amd := build(fmt.Sprintf("amd64 %d", i), "linux/amd64")
		i386 := build(fmt.Sprintf("386 %d", i), "linux/386")
		both := build(fmt.Sprintf("both %d", i), "linux/amd64", "linux/386")
		worst := max(amd, i386)
		index, slowest = append(index, ms(both)), append(slowest, ms(worst))
		overhead = append(overhead, ms(both-worst))
		t.Logf("round %d: linux/amd64 %s, linux/386 %s, both as one index %s", i+1,
			amd.Round(time.Millisecond), i386.Round(time.Millisecond), both.Round(time.Millisecond))
	}
	idx50, _ := pct(index)
	slow50, _ := pct(slowest)
	over50, _ := pct(overhead)
	writeResult(t, benchfmt.Result{ID: "P11", Title: "an image index of two platforms against its slower platform built alone",
		Baseline: "the slower of a linux/amd64 and a linux/386 request of other content, one at a time, in the same round",
		Rows: []benchfmt.Row{
			benchfmt.Compared("submit → result, linux/amd64 + linux/386 as one index, p50", "ms", idx50, slow50),
			benchfmt.Plain("index over its slower platform, p50", "ms", over50),
			benchfmt.Plain("rounds", "", rounds),
		},
		Goal: "the index costs about its slower platform: both platforms build side by side",
		Met:  benchfmt.Bool(idx50 <= 1.5*slow50),
		Notes: []string{
			"Each build runs a RUN (a static program for its architecture) and a COPY of content no other build has, so every request is a kaniko build of its own.",
			"The two platforms' Jobs run at once on the one 2-core node; the index's own step (each platform's manifest read, the index pushed to its tags) is a few registry round trips.",
			fmt.Sprintf("Per round (ms): index %v; slower platform alone %v.", rounded(index), rounded(slowest)),
		},
		Seconds: time.Since(start).Seconds()})
}

func rounded(xs []float64) []int {
	out := make([]int, len(xs))
	for i, x := range xs {
		out[i] = int(x + 0.5)
	}
	return slices.Clip(out)
}
