package worker

// Defects the fault simulation reported (seeds 171 and 504 of 600). Each
// test fails on the code before its fix (the comment says how) and passes
// with it.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
)

// simFollowBackend plays a run taken over whose record moves on (its
// first Run: another run of the key failed meanwhile, and the backend says
// the run is no longer current), then builds every later run by pushing
// an image to the run's first destination, as kaniko does.
type simFollowBackend struct {
	t     *testing.T
	tr    *testRegistry
	moved func() // writes the record of another run of the key

	mu   sync.Mutex
	runs []Build
}

func (*simFollowBackend) Identity() string { return "sim-follow" }
func (b *simFollowBackend) Run(_ context.Context, bd Build, started Started) (Outcome, error) {
	b.mu.Lock()
	b.runs = append(b.runs, bd)
	n := len(b.runs)
	b.mu.Unlock()
	if n == 1 {
		b.moved()
		return Outcome{}, errNotCurrent
	}
	started("fake-"+bd.Run, true, bd.Request.RequestID)
	d := b.tr.push(b.t, bd.Destinations[0])
	return Outcome{Succeeded: true, Digest: d, Job: "fake-" + bd.Run, Run: bd.Run}, nil
}
func (*simFollowBackend) Cleanup(context.Context, string, string) error { return nil }

func (b *simFollowBackend) built() []Build {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]Build(nil), b.runs...)
}

// Seed 171 (redundant-build): a request's handler takes over a run another
// request claimed (acme/web's, pushing to acme/web), and the record moves
// on under it (a newer run of the key failed). own() followed the record
// with build(…, held.Repository, dests, …): the run's repository in place
// of the request's own. The new run it claimed there pushed to the
// request's destinations (acme/api) while its record named acme/web as
// the repository — an index entry pointing where the image is not. The
// next request of the key found "the indexed image gone from the
// registry" and built the key again (in the simulation: 30 ms after the
// first build succeeded), and a parked request's copy from the index
// failed the same way.
func TestSimRunFollowedAfterATakeOverIsIndexedWhereItWasPushed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()

	b := &simFollowBackend{t: t, tr: tr}
	cfg := testConfig("w1")
	cfg.Logger = zaptest.NewLogger(t)
	cfg.Registry = tr.client
	cfg.Naming = naming.Policy{Registry: tr.host}
	w, err := New(e.nc, b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(ctx); err != nil {
		t.Fatal(err)
	}

	// Two requests of one build key, in two repositories.
	claimer := request("sim-follow")
	claimer.RequestID = "sim-follow-claimer"
	taker := request("sim-follow")
	taker.RequestID, taker.Name = "sim-follow-taker", "api"
	later := request("sim-follow")
	later.RequestID = "sim-follow-later"
	key := w.builds.keyOf(taker)
	if w.builds.keyOf(claimer) != key || w.builds.keyOf(later) != key {
		t.Fatal("premise: the requests do not share a build key")
	}
	repoOf := func(r *v1.Request) (string, []string) {
		repo, err := w.cfg.Naming.Repository(r)
		if err != nil {
			t.Fatal(err)
		}
		return repo, naming.Destinations(repo, key, r.Tags)
	}
	claimerRepo, claimerDests := repoOf(claimer)
	takerRepo, takerDests := repoOf(taker)
	if claimerRepo == takerRepo {
		t.Fatal("premise: the requests share a repository")
	}

	// The claimer's run, let go by its owner: the taker takes it over.
	put := func(r v1.BuildRecord) {
		t.Helper()
		v, _ := json.Marshal(r)
		if _, err := w.runs.Bucket().Put(ctx, key, v); err != nil {
			t.Fatal(err)
		}
	}
	put(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "claimers-run", LeaseMs: 2000,
		RequestID: claimer.RequestID, Seq: 1, Tenant: "acme", Name: "web", Holder: RequestIndexKey("acme", claimer.RequestID),
		Repository: claimerRepo, Destinations: claimerDests, Source: &claimer.Source, StartedAt: time.Now().UTC()})
	b.moved = func() {
		put(v1.BuildRecord{Key: key, State: v1.StateFailed, Run: "newer-run", RequestID: "someone-else", Seq: 2,
			Tenant: "acme", Name: "web", Repository: claimerRepo, Destinations: claimerDests,
			Reason: v1.ReasonBuildFailed, Message: "RUN make: exit status 2", FinishedAt: time.Now().UTC()})
	}

	rec, origin, _, err := w.builds.build(ctx, taker, key, takerRepo, takerDests, 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != v1.StateSucceeded || origin != v1.OriginBuild {
		t.Fatalf("the taker got %s/%s, want its own build", rec.State, origin)
	}
	if runs := b.built(); len(runs) != 2 || runs[1].Destinations[0] != takerDests[0] {
		t.Fatalf("premise: the taker's new run should push to %s; runs %+v", takerDests[0], runs)
	}
	stored, _, err := w.runs.Get(ctx, key)
	if err != nil || stored == nil {
		t.Fatal(stored, err)
	}
	if stored.Repository != takerRepo {
		t.Errorf("the record of the run that pushed to %s names repository %s", stored.Destinations[0], stored.Repository)
	}
	if _, err := tr.client.Head(ctx, stored.Repository+"@"+stored.Digest); err != nil {
		t.Errorf("the indexed image %s@%s is not in the registry: %v", stored.Repository, stored.Digest, err)
	}

	// The next request of the key is answered from the index, not built
	// again.
	laterRepo, laterDests := repoOf(later)
	rec, origin, _, err = w.builds.build(ctx, later, key, laterRepo, laterDests, 4, nil)
	if err != nil && !errors.Is(err, errParked) {
		t.Fatal(err)
	}
	if n := len(b.built()); n != 2 || origin != v1.OriginCache {
		t.Fatalf("the key was built again (%d runs) for a request after its build succeeded: origin %q", n, origin)
	}
	if rec.Digest != stored.Digest {
		t.Fatalf("answered with %s, the build made %s", rec.Digest, stored.Digest)
	}
}

// Seed 504 (handled-after-answer, an oracle false positive): w0's handler
// took s504-r03 at 3.77 s and published its "queued" event; the stall
// fault then cut w0 off NATS before its client flushed the event. The
// request was redelivered and answered on w1 at 4.94 s; the stalled
// handler went on at 7.38 s, found the key's build in the index (starting
// nothing), and its client sent the buffered event at the reconnect. The
// oracle judged the take by when it saw the event (7.50 s): "took request
// s504-r03 again". It now judges by when the worker published it. The
// same late event with a late worker time is still a violation.
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
// (TestSimRunFollowedAfterATakeOverIsIndexedWhereItWasPushed). It now
// reports the misplaced index itself, with or without a rebuild after it,
// and says of a rebuild whether the index pointed at the image.
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
