package worker

// The fault simulation's oracle (sim_oracle_test.go): each test stages
// what the simulation once misjudged — a false positive, or a defect it
// reported only by its effect — and checks the oracle's verdict.

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
)

// Seed 504 (handled-after-answer, an oracle false positive): w0's handler
// took s504-r03 at 3.77 s and published its "queued" event; the stall
// fault then cut w0 off NATS before its client flushed the event. The
// request was redelivered and answered on w1 at 4.94 s; the stalled
// handler went on at 7.38 s, found the key's build in the index (starting
// nothing), and its client sent the buffered event at the reconnect. The
// oracle judged the take by when it saw the event (7.50 s): "took request
// s504-r03 again". It now judges by when the worker published it. The
// same late event with a late worker time is still a violation.
//
// Origin: the fault simulation, seed 504 (handled-after-answer, an oracle false positive), issue 24 (85ff387).
func TestSimOracleJudgesATakeByWhenTheWorkerTookTheRequest(t *testing.T) {
	t.Parallel()
	const s = time.Second
	judge := func(sent time.Duration) *simOutcome {
		w := &simWorld{
			published: []simPublish{{id: "s504-r03", at: 4936 * time.Millisecond}},
			events: []simEvent{{at: 7498 * time.Millisecond, sent: sent, id: "s504-r03", tenant: "acme",
				phase: v1.PhaseQueued, worker: "w0.0"}},
		}
		out := &simOutcome{}
		w.judgeHandledAfterAnswer(out)
		return out
	}
	if out := judge(3769 * time.Millisecond); len(out.violations) != 0 {
		t.Errorf("a take before the answer, seen late, was judged a violation: %+v", out.violations)
	}
	if out := judge(7 * s); len(out.violations) != 1 || out.violations[0].class != "handled-after-answer" {
		t.Errorf("a take after the answer was not judged a violation: %+v", out.violations)
	}
	if out := judge(0); len(out.violations) != 1 {
		t.Errorf("an event of unknown time, seen after the answer, was not judged a violation: %+v", out.violations)
	}
}

// Seed 171 (redundant-build): the oracle reported the rebuild, the effect
// of a record that indexed its image where the run had not pushed it
// (TestRunFollowedAfterATakeOverIsIndexedWhereItWasPushed). It now
// reports the misplaced index itself, with or without a rebuild after it,
// and says of a rebuild whether the index pointed at the image.
//
// Origin: the fault simulation, seed 171 (redundant-build), issue 24 (85ff387).
func TestSimOracleReportsAnIndexWhereTheImageIsNot(t *testing.T) {
	t.Parallel()
	const repo, other, digest = "registry.test/acme/api", "registry.test/acme/web", "sha256:d1"
	judge := func(indexedRepo string, rebuild bool) *simOutcome {
		recs := []simRecordRev{
			{at: 1 * time.Second, key: "k", rev: 1, rec: v1.BuildRecord{Key: "k", State: v1.StateBuilding, Run: "r1", Repository: indexedRepo}},
			{at: 2 * time.Second, key: "k", rev: 2, rec: v1.BuildRecord{Key: "k", State: v1.StateSucceeded, Run: "r1", Repository: indexedRepo,
				Digest: digest, Pushed: []string{repo + ":t"}}},
		}
		if rebuild {
			recs = append(recs, simRecordRev{at: 2100 * time.Millisecond, key: "k", rev: 3,
				rec: v1.BuildRecord{Key: "k", State: v1.StateBuilding, Run: "r2", Repository: repo}})
		}
		w := &simWorld{node: &simNode{jobs: map[string]*simJob{}}, records: recs, indexed: map[string]error{
			repo + "@" + digest:  nil,
			other + "@" + digest: fmt.Errorf("head: %w", registry.ErrNotFound),
		}}
		out := &simOutcome{}
		w.judgeRecords(out)
		return out
	}
	classes := func(out *simOutcome) (cs []string) {
		for _, v := range out.violations {
			cs = append(cs, v.class)
		}
		return cs
	}
	if out := judge(repo, false); len(out.violations) != 0 {
		t.Errorf("a record indexing its pushed image: %v", out.violations)
	}
	if got := classes(judge(other, false)); !slices.Equal(got, []string{"index-misplaced"}) {
		t.Errorf("a record indexing an image that is not there: %v, want index-misplaced", got)
	}
	out := judge(other, true)
	if got := classes(out); !slices.Equal(got, []string{"index-misplaced", "redundant-build"}) ||
		!strings.Contains(out.violations[1].detail, "where no image was ever pushed") {
		t.Errorf("a rebuild after a misplaced index: %+v", out.violations)
	}
	out = judge(repo, true)
	if got := classes(out); !slices.Equal(got, []string{"redundant-build"}) ||
		!strings.Contains(out.violations[0].detail, "still in the registry") {
		t.Errorf("a rebuild while the indexed image is there: %+v", out.violations)
	}
}

// TestSimStuckRequestsSayWhatTheWorkersSaidOfThem: a request left without
// a result is reported with its own events and the workers' log lines
// that name it, and nothing of another request's.
//
// Origin: the fault simulation, seed 83 (stuck, seen once in about a
// thousand runs, with nothing in the report to say where the request was).
func TestSimStuckRequestsSayWhatTheWorkersSaidOfThem(t *testing.T) {
	t.Parallel()
	w := &simWorld{
		events: []simEvent{
			{at: 6500 * time.Millisecond, id: "s83-r06", phase: v1.PhaseQueued, worker: "w1.0", msg: "taken by w1.0"},
			{at: 6600 * time.Millisecond, id: "s83-r12", phase: v1.PhaseQueued, worker: "w0.0", msg: "taken by w0.0"},
		},
		logs: &simLogBuffer{},
	}
	fmt.Fprintln(w.logs, `INFO	w1.0	parked request not settled yet	{"requestId": "s83-r06"}`)
	fmt.Fprintln(w.logs, `INFO	w0.0	request done	{"requestId": "s83-r12"}`)
	said := strings.Join(w.saidOf("s83-r06"), "\n")
	for _, want := range []string{`6.500s w1.0 queued "taken by w1.0"`, `log: INFO	w1.0	parked request not settled yet`} {
		if !strings.Contains(said, want) {
			t.Errorf("said of s83-r06:\n%s\nwant %q", said, want)
		}
	}
	if strings.Contains(said, "s83-r12") {
		t.Errorf("said of s83-r06 names another request:\n%s", said)
	}
	if got := w.saidOf("s83-r99"); len(got) != 1 || got[0] != "no event" {
		t.Errorf("said of a request nobody saw: %q, want no event", got)
	}
}
