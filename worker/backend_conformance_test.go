package worker

// The backend conformance suite: one table of the Backend contract
// (backend.go: Build, Outcome, Started, Backend; local.go), run against
// every backend the worker runs builds on:
//
//   - kube: KubeBackend on the test world's API server and node as the
//     harness runs them (world_test.go): a build ends when the case says;
//   - local: LocalBackend (internal/localexec) on contexts served from
//     memory, pushing to the world's registry; a build waits for its
//     context until the case says;
//   - kube-sim: KubeBackend on the simulation's node (simNodeOptions:
//     builds that end by themselves at seeded times, a TTL controller) and
//     a client of the simulation's API server, fault injection off.
//
// A case a backend cannot support by design is skipped, naming the design
// fact.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
)

// conformanceBackend is one backend under the contract, with what a case
// needs around it. Each case gets a fresh one.
type conformanceBackend struct {
	backend Backend
	reg     *testRegistry
	// build returns a Build of a key of its own, run "r1", pushing to two
	// destinations in reg, whose build succeeds (fail: fails at a build
	// step, its log tail holding failLog).
	build   func(t *testing.T, fail bool) Build
	failLog string
	// holds: a build runs until finish is called (else it ends by itself).
	holds bool
	// finish lets the build of b's run end (a no-op where builds end by
	// themselves).
	finish func(t *testing.T, b Build)
	// builds counts the builds of b's key that began (Jobs created,
	// contexts opened).
	builds func(b Build) int
	// left reports whether anything of b's run is left (a Job, a running
	// build).
	left func(b Build) bool
	// another is a second backend on the same world (another worker);
	// nil: noAnother says why there is none.
	another   func(t *testing.T) Backend
	noAnother string
	// unavailable makes the backend's infrastructure fail from now on
	// (the API server, the object store).
	unavailable func(t *testing.T)
	// removeExternally removes b's running build from outside the
	// backend; nil: noRemove says why nothing can.
	removeExternally func(t *testing.T, b Build)
	noRemove         string
}

var conformanceBackends = []struct {
	name  string
	start func(t *testing.T) *conformanceBackend
}{
	{"kube", func(t *testing.T) *conformanceBackend { return kubeConformance(t, false) }},
	{"local", localConformance},
	{"kube-sim", func(t *testing.T) *conformanceBackend { return kubeConformance(t, true) }},
}

// conformanceCases: the contract, one case per rule.
var conformanceCases = []struct {
	name string
	run  func(t *testing.T, cb *conformanceBackend)
}{
	{"identity names the executor and is stable", func(t *testing.T, cb *conformanceBackend) {
		id := cb.backend.Identity()
		if id == "" || cb.backend.Identity() != id {
			t.Fatalf("Identity() = %q, then %q", id, cb.backend.Identity())
		}
	}},

	// Backend.Run, Started, Outcome.
	{"a new build is started once by its request and reports the digest it pushed to every destination", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		c := runConformance(t, cb.backend, b, nil)
		c.waitStarted(t, 1)
		cb.finish(t, b)
		out, err := c.wait(t)
		if err != nil || !out.Succeeded || out.Digest == "" || out.Reason != "" {
			t.Fatalf("Run = %+v, %v; want a success with a digest", out, err)
		}
		if s := c.startsNow(); len(s) != 1 || !s[0].created || s[0].creator != b.Request.RequestID || s[0].job != out.Job || out.Job == "" {
			t.Errorf("Started calls %+v, outcome's build %q; want one, created, by %s, naming the outcome's build", s, out.Job, b.Request.RequestID)
		}
		for _, d := range b.Destinations {
			if got, err := cb.reg.client.Head(context.Background(), d); err != nil || got != out.Digest {
				t.Errorf("%s in the registry: %s, %v; the outcome says %s", d, got, err, out.Digest)
			}
		}
		if out.FinishedAt.IsZero() {
			t.Error("the outcome has no finish time")
		}
		if n := cb.builds(b); n != 1 {
			t.Errorf("%d builds of the key began, want 1", n)
		}
	}},
	{"a failed build reports its reason, message and log tail, and pushes nothing", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, true)
		c := runConformance(t, cb.backend, b, nil)
		c.waitStarted(t, 1)
		cb.finish(t, b)
		out, err := c.wait(t)
		if err != nil || out.Succeeded || out.Reason != v1.ReasonBuildFailed || out.Message == "" || !strings.Contains(out.LogTail, cb.failLog) {
			t.Fatalf("Run = %+v, %v; want %s with a message and a log tail holding %q", out, err, v1.ReasonBuildFailed, cb.failLog)
		}
		for _, d := range b.Destinations {
			if _, err := cb.reg.client.Head(context.Background(), d); !registry.IsNotFound(err) {
				t.Errorf("%s: %v; a failed build pushed it", d, err)
			}
		}
	}},
	{"a second Run of the run joins its build, not created, naming the request that started it", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		first := runConformance(t, cb.backend, b, nil)
		s1 := first.waitStarted(t, 1)[0]
		joiner := b
		joiner.Request = withRequestID(b.Request, b.Request.RequestID+"-joiner")
		second := runConformance(t, cb.backend, joiner, nil)
		s2 := second.waitStarted(t, 1)[0]
		if s2.created || s2.creator != b.Request.RequestID || s2.job != s1.job {
			t.Errorf("the joiner's Started %+v; want not created, by %s, build %s", s2, b.Request.RequestID, s1.job)
		}
		cb.finish(t, b)
		o1, err1 := first.wait(t)
		o2, err2 := second.wait(t)
		if err1 != nil || err2 != nil || !o1.Succeeded || !o2.Succeeded || o1.Digest != o2.Digest {
			t.Fatalf("outcomes %+v, %v and %+v, %v; want one success for both", o1, err1, o2, err2)
		}
		if n := cb.builds(b); n != 1 {
			t.Errorf("%d builds of the key began, want 1", n)
		}
	}},
	{"another backend takes over its run's build after the first caller stopped", func(t *testing.T, cb *conformanceBackend) {
		if cb.another == nil {
			t.Skip(cb.noAnother)
		}
		b := cb.build(t, false)
		ctx, cancel := context.WithCancel(context.Background())
		first := runConformanceCtx(ctx, t, cb.backend, b, func(string, bool, string) { cancel() })
		if _, err := first.wait(t); !errors.Is(err, context.Canceled) {
			t.Fatalf("the first caller's Run returned %v, want its context's error", err)
		}
		taker := b
		taker.Request = withRequestID(b.Request, b.Request.RequestID+"-taker")
		second := runConformance(t, cb.another(t), taker, nil)
		s := second.waitStarted(t, 1)[0]
		if s.created || s.creator != b.Request.RequestID {
			t.Errorf("the take-over's Started %+v; want not created, by %s", s, b.Request.RequestID)
		}
		cb.finish(t, b)
		out, err := second.wait(t)
		if err != nil || !out.Succeeded {
			t.Fatalf("the take-over's Run = %+v, %v", out, err)
		}
		if got, err := cb.reg.client.Head(context.Background(), b.Destinations[0]); err != nil || got != out.Digest {
			t.Errorf("%s: %s, %v; the outcome says %s", b.Destinations[0], got, err, out.Digest)
		}
		if n := cb.builds(b); n != 1 {
			t.Errorf("%d builds of the key began, want 1", n)
		}
	}},

	// Build.Current: a run that ended never removes the build of the run
	// that replaced it; a current one replaces a stale run's.
	{"a run that is no longer current never replaces another run's build", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		first := runConformance(t, cb.backend, b, nil)
		first.waitStarted(t, 1)
		stale := b
		stale.Run = "r0"
		stale.Request = withRequestID(b.Request, b.Request.RequestID+"-stale")
		stale.Current = func(context.Context) bool { return false }
		late := runConformance(t, cb.backend, stale, nil)
		if out, err := late.wait(t); !errors.Is(err, errNotCurrent) {
			t.Fatalf("the stale run's Run = %+v, %v; want errNotCurrent", out, err)
		}
		if s := late.startsNow(); len(s) != 0 {
			t.Errorf("the stale run was started: %+v", s)
		}
		cb.finish(t, b)
		if out, err := first.wait(t); err != nil || !out.Succeeded {
			t.Fatalf("the current run's Run = %+v, %v", out, err)
		}
		if n := cb.builds(b); n != 1 {
			t.Errorf("%d builds of the key began, want 1", n)
		}
	}},
	{"a current run replaces a stale run's build with its own", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		first := runConformance(t, cb.backend, b, nil)
		first.waitStarted(t, 1)
		newer := b
		newer.Run = "r2"
		newer.Request = withRequestID(b.Request, b.Request.RequestID+"-newer")
		newer.Current = func(context.Context) bool { return true }
		second := runConformance(t, cb.backend, newer, nil)
		s := second.waitStarted(t, 1)[0]
		if !s.created || s.creator != newer.Request.RequestID {
			t.Errorf("the newer run's Started %+v; want created, by %s", s, newer.Request.RequestID)
		}
		cb.finish(t, newer)
		out, err := second.wait(t)
		if err != nil || !out.Succeeded {
			t.Fatalf("the newer run's Run = %+v, %v", out, err)
		}
		if got, err := cb.reg.client.Head(context.Background(), newer.Destinations[0]); err != nil || got != out.Digest {
			t.Errorf("%s: %s, %v; the outcome says %s", newer.Destinations[0], got, err, out.Digest)
		}
		o1, err1 := first.wait(t)
		if cb.holds && err1 == nil && o1.Succeeded {
			t.Errorf("the replaced run's build, stopped before it ended, succeeded: %+v", o1)
		}
		if n := cb.builds(b); n != 2 {
			t.Errorf("%d builds of the key began, want 2", n)
		}
	}},

	// Backend.Cleanup.
	{"cleanup of another run leaves a running build alone", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		var cleanupErr error
		c := runConformance(t, cb.backend, b, func(string, bool, string) {
			cleanupErr = cb.backend.Cleanup(context.Background(), b.Key, "another-run")
		})
		c.waitStarted(t, 1)
		cb.finish(t, b)
		out, err := c.wait(t)
		if cleanupErr != nil || err != nil || !out.Succeeded {
			t.Fatalf("Cleanup of another run: %v; then Run = %+v, %v", cleanupErr, out, err)
		}
	}},
	{"cleanup of its run stops the running build before it pushes, and again is a no-op", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		var cleanupErrs [2]error
		c := runConformance(t, cb.backend, b, func(string, bool, string) {
			cleanupErrs[0] = cb.backend.Cleanup(context.Background(), b.Key, b.Run)
			cleanupErrs[1] = cb.backend.Cleanup(context.Background(), b.Key, b.Run)
		})
		out, err := c.wait(t)
		if cleanupErrs[0] != nil || cleanupErrs[1] != nil {
			t.Fatalf("Cleanup: %v, then %v", cleanupErrs[0], cleanupErrs[1])
		}
		if err == nil && out.Succeeded {
			t.Fatalf("a build its run's Cleanup stopped succeeded: %+v", out)
		}
		eventually(t, 10*time.Second, "nothing of the run left", func() bool { return !cb.left(b) })
		for _, d := range b.Destinations {
			if _, err := cb.reg.client.Head(context.Background(), d); !registry.IsNotFound(err) {
				t.Errorf("%s: %v; a stopped build pushed it", d, err)
			}
		}
	}},
	{"cleanup of a finished run removes what it left, only that run's, and again is a no-op", func(t *testing.T, cb *conformanceBackend) {
		ctx := context.Background()
		b := cb.build(t, false)
		c := runConformance(t, cb.backend, b, nil)
		c.waitStarted(t, 1)
		cb.finish(t, b)
		if out, err := c.wait(t); err != nil || !out.Succeeded {
			t.Fatalf("Run = %+v, %v", out, err)
		}
		before := cb.left(b)
		if err := cb.backend.Cleanup(ctx, b.Key, "another-run"); err != nil {
			t.Fatal(err)
		}
		if cb.left(b) != before {
			t.Fatal("Cleanup of another run removed what this run left")
		}
		for range 2 {
			if err := cb.backend.Cleanup(ctx, b.Key, b.Run); err != nil {
				t.Fatal(err)
			}
		}
		eventually(t, 10*time.Second, "nothing of the run left", func() bool { return !cb.left(b) })
		if err := cb.backend.Cleanup(ctx, v1.BuildKey(request("never built"), cb.backend.Identity()), b.Run); err != nil {
			t.Fatalf("Cleanup of a key never built: %v", err)
		}
	}},

	// Backend.Run's errors.
	{"a context that ends first ends Run with its error", func(t *testing.T, cb *conformanceBackend) {
		b := cb.build(t, false)
		ctx, cancel := context.WithCancel(context.Background())
		c := runConformanceCtx(ctx, t, cb.backend, b, func(string, bool, string) { cancel() })
		out, err := c.wait(t)
		if !errors.Is(err, context.Canceled) || out.Succeeded {
			t.Fatalf("Run = %+v, %v; want the context's error", out, err)
		}
	}},
	{"trouble worth retrying is a TransientError", func(t *testing.T, cb *conformanceBackend) {
		cb.unavailable(t)
		b := cb.build(t, false)
		out, err := runConformance(t, cb.backend, b, nil).wait(t)
		if !IsTransient(err) {
			t.Fatalf("Run with its infrastructure down = %+v, %v; want a *TransientError", out, err)
		}
	}},
	{"a build removed from outside ends its run as JobDeleted", func(t *testing.T, cb *conformanceBackend) {
		if cb.removeExternally == nil {
			t.Skip(cb.noRemove)
		}
		b := cb.build(t, false)
		c := runConformance(t, cb.backend, b, func(string, bool, string) { cb.removeExternally(t, b) })
		out, err := c.wait(t)
		if err != nil || out.Succeeded || out.Reason != v1.ReasonJobDeleted || out.Job == "" {
			t.Fatalf("Run = %+v, %v; want %s", out, err, v1.ReasonJobDeleted)
		}
	}},
}

func TestBackendConformance(t *testing.T) {
	t.Parallel()
	for _, be := range conformanceBackends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			for _, c := range conformanceCases {
				t.Run(c.name, func(t *testing.T) {
					t.Parallel()
					c.run(t, be.start(t))
				})
			}
		})
	}
}

// ---- running a build ----

// conformanceStart is one Started call.
type conformanceStart struct {
	job     string
	created bool
	creator string
}
