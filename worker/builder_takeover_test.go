package worker

// Builder (build.go, own.go): take-over. A run let go by a stopped worker
// is taken over at once, a dead owner's after its lease watched on the
// reader's clock — never a live owner's, whatever the clocks say — and
// the run builds on as its claimer's, its record following the request
// that took it (docs/design.md §2a).

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
)

// Origin: the build pipeline spine (0bdb2cd).
func TestStoppedWorkerHandsBackAndAnotherAdopts(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w1 := e.startWorker("w1", nil)
	results := e.collect()

	req := request("adopt")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)
	job := e.waitJob(kaniko.JobName(key))

	// SIGTERM: w1 stops fetching and hands the request back at once.
	w1.stop(t)
	e.startWorker("w2", nil)
	// w2 takes the request back well before AckWait or the lease would
	// have run out, and adopts the Job instead of creating another.
	time.Sleep(300 * time.Millisecond)
	e.kubelet(job, 0, digestOf("adopted"))

	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digestOf("adopted") {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if r.Data.Origin != v1.OriginBuild {
		t.Errorf("origin %q: the request's own Job was adopted, so it is still its build", r.Data.Origin)
	}
	if r.Data.Attempts != 2 {
		t.Errorf("attempts %d, want 2 (handed back once)", r.Data.Attempts)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

// A live owner whose clock runs an hour behind keeps its claim: leases are
// judged on the reader's clock, not by comparing timestamps.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestSkewedClockNeverTakesALiveClaim(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// One slot: busy with R1, so R2 goes to the other worker.
	e.startWorker("slow-clock", func(c *Config) {
		c.MaxInFlight = 1
		c.Now = func() time.Time { return time.Now().Add(-time.Hour) }
	})
	results := e.collect()
	r1 := request("skew")
	if _, err := e.pub.Publish(context.Background(), r1); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(r1, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	e.startWorker("fast-clock", func(c *Config) { c.Now = func() time.Time { return time.Now().Add(time.Hour) } })
	r2 := request("skew")
	if _, err := e.pub.Publish(context.Background(), r2); err != nil {
		t.Fatal(err)
	}
	// Three leases of 2 s: a lease judged across clocks lapses at once.
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		if rec := e.claim(key); rec.Owner != "slow-clock" {
			t.Fatalf("claim taken from a live owner: %+v", rec)
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.kubelet(job, 0, digestOf("skew"))
	for _, r := range results.waitFor(t, 2, 10*time.Second) {
		if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != digestOf("skew") {
			t.Fatalf("result %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Fatalf("%d jobs created", n)
	}
}

// A dead owner whose clock ran an hour ahead is taken over after its
// lease, not after its timestamp.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestDeadOwnerWithAFastClockIsTakenOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	req := request("fast-dead")
	key := v1.BuildKey(req, kanikoID)
	w := e.startWorker("w1", nil)
	results := e.collect()
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "dead-run", Owner: "dead", LeaseMs: 2000,
		LeaseUntil: time.Now().Add(time.Hour), RequestID: "gone", Tenant: "acme", Name: "web",
		Repository: "registry.test:5000/acme/web", Destinations: []string{"registry.test:5000/acme/web:" + v1.DefaultTag(key)}})
	if _, err := w.w.runs.Bucket().Put(context.Background(), key, rec); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key)) // taken over within seconds
	if job.Annotations[kaniko.AnnotationRun] != "dead-run" {
		t.Fatalf("the take-over ran another run: %q", job.Annotations[kaniko.AnnotationRun])
	}
	e.kubelet(job, 0, digestOf("fast-dead"))
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginInflight {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}

// TestTakeOverBuildsAsTheClaimer: a run taken over by another tenant's
// request still builds as the run's claimer — its tenant and name label
// the Job and pick the registry Secret it mounts, as its repository is
// where the run pushes.
//
// Origin: adversarial review of the confinement work (6f15a58).
func TestTakeOverBuildsAsTheClaimer(t *testing.T) {
	t.Parallel()
	acme := request("takeover")
	w := &builder{Worker: &Worker{cfg: Config{Now: time.Now}}}
	claim := w.newClaim(acme, "k", "registry.test/acme/takeover", []string{"registry.test/acme/takeover:abc"}, 1)
	taker := request("takeover")
	taker.Tenant, taker.Name = "mallory", "other-name"
	r := runRequest(taker, claim)
	if r.Tenant != acme.Tenant || r.Name != acme.Name || taker.Tenant != "mallory" {
		t.Fatalf("the run builds as %s/%s, want the claimer %s/%s", r.Tenant, r.Name, acme.Tenant, acme.Name)
	}
}

// followBackend plays a run taken over whose record moves on (its
// first Run: another run of the key failed meanwhile, and the backend says
// the run is no longer current), then builds every later run by pushing
// an image to the run's first destination, as kaniko does.
type followBackend struct {
	t     *testing.T
	tr    *testRegistry
	moved func() // writes the record of another run of the key

	mu   sync.Mutex
	runs []Build
}

func (*followBackend) Identity() string { return "sim-follow" }

func (b *followBackend) Run(_ context.Context, bd Build, started Started) (Outcome, error) {
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

func (*followBackend) Cleanup(context.Context, string, string) error { return nil }

func (b *followBackend) built() []Build {
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
//
// Origin: the fault simulation, seed 171 (redundant-build), issue 24 (85ff387).
func TestRunFollowedAfterATakeOverIsIndexedWhereItWasPushed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	ctx := context.Background()

	b := &followBackend{t: t, tr: tr}
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
