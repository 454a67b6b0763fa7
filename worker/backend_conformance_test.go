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
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
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

// conformanceCall is one Run in flight.
type conformanceCall struct {
	mu     sync.Mutex
	starts []conformanceStart
	signal chan struct{}
	done   chan struct{}
	out    Outcome
	err    error
}

func runConformance(t *testing.T, b Backend, build Build, onStarted Started) *conformanceCall {
	return runConformanceCtx(context.Background(), t, b, build, onStarted)
}

// runConformanceCtx runs build on b; onStarted (nil: none) runs inside
// each Started call, after it was recorded.
func runConformanceCtx(ctx context.Context, t *testing.T, b Backend, build Build, onStarted Started) *conformanceCall {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	c := &conformanceCall{signal: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		defer cancel()
		c.out, c.err = b.Run(ctx, build, func(job string, created bool, creator string) {
			c.mu.Lock()
			c.starts = append(c.starts, conformanceStart{job, created, creator})
			c.mu.Unlock()
			select {
			case c.signal <- struct{}{}:
			default:
			}
			if onStarted != nil {
				onStarted(job, created, creator)
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-c.done
	})
	return c
}

func (c *conformanceCall) startsNow() []conformanceStart {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]conformanceStart(nil), c.starts...)
}

// waitStarted waits for n Started calls.
func (c *conformanceCall) waitStarted(t *testing.T, n int) []conformanceStart {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		if s := c.startsNow(); len(s) >= n {
			return s
		}
		select {
		case <-c.signal:
		case <-c.done:
			if s := c.startsNow(); len(s) >= n {
				return s
			}
			t.Fatalf("Run returned %+v, %v before Started was called %d times", c.out, c.err, n)
		case <-deadline:
			t.Fatalf("Started called %d times, want %d", len(c.startsNow()), n)
		}
	}
}

// wait waits for Run to return.
func (c *conformanceCall) wait(t *testing.T) (Outcome, error) {
	t.Helper()
	select {
	case <-c.done:
		return c.out, c.err
	case <-time.After(40 * time.Second):
		t.Fatal("Run did not return")
		return Outcome{}, nil
	}
}

func withRequestID(r *v1.Request, id string) *v1.Request {
	c := *r
	c.RequestID = id
	return &c
}

// ---- the kaniko backend ----

// kubeConformance is KubeBackend on a test world without NATS: the
// harness's node (builds end when finish says), or the simulation's (they
// end by themselves; a TTL controller).
func kubeConformance(t *testing.T, simulated bool) *conformanceBackend {
	var (
		mu    sync.Mutex
		fails = map[string]bool{} // by key
	)
	failing := func(key string) bool {
		mu.Lock()
		defer mu.Unlock()
		return fails[key]
	}
	var node nodeOptions
	if simulated {
		node = simNodeOptions(newSimPlanner(1, func(key string) float64 {
			if failing(key) {
				return 1
			}
			return 0
		}), true)
	}
	w := newWorld(t, worldConfig{noNATS: true, registry: true, node: node})
	backend, client := startConformanceKube(t, w, "w1")
	var seq atomic.Int32
	cb := &conformanceBackend{
		backend: backend,
		reg:     w.reg,
		holds:   !simulated,
		failLog: "RUN make: exit status 2",
		build: func(t *testing.T, fail bool) Build {
			req := request(fmt.Sprintf("%s-%d", t.Name(), seq.Add(1)))
			key := v1.BuildKey(req, backend.Identity())
			mu.Lock()
			fails[key] = fail
			mu.Unlock()
			tag := v1.DefaultTag(key)
			return Build{Request: req, Key: key, Run: "r1",
				Destinations: []string{w.reg.host + "/acme/web:" + tag, w.reg.host + "/acme/web-copy:" + tag}}
		},
		finish: func(t *testing.T, b Build) {
			if simulated {
				return
			}
			var job *batchv1.Job
			eventually(t, 10*time.Second, "the Job of run "+b.Run, func() bool {
				j, err := client.BatchV1().Jobs(testNamespace).Get(context.Background(), kaniko.JobName(b.Key), metav1.GetOptions{})
				if err != nil || j.Annotations[kaniko.AnnotationRun] != b.Run || j.DeletionTimestamp != nil {
					return false
				}
				job = j
				return true
			})
			if err := w.node.build(job, !failing(b.Key)); err != nil {
				t.Fatal(err)
			}
		},
		builds: func(b Build) int {
			w.node.creates.mu.Lock()
			defer w.node.creates.mu.Unlock()
			return w.node.creates.n[kaniko.JobName(b.Key)]
		},
		left: func(b Build) bool {
			j, err := client.BatchV1().Jobs(testNamespace).Get(context.Background(), kaniko.JobName(b.Key), metav1.GetOptions{})
			return err == nil && j.Annotations[kaniko.AnnotationRun] == b.Run
		},
		another: func(t *testing.T) Backend {
			b, _ := startConformanceKube(t, w, "w2")
			return b
		},
		unavailable: func(*testing.T) {
			client.PrependReactor("*", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, apierrors.NewInternalError(errors.New("etcdserver: leader changed"))
			})
		},
		removeExternally: func(t *testing.T, b Build) {
			bg := metav1.DeletePropagationBackground
			if err := w.api.do(func() error {
				return w.api.deleteJobLocked(testNamespace, kaniko.JobName(b.Key), metav1.DeleteOptions{PropagationPolicy: &bg}, "external")
			}); err != nil {
				t.Error(err)
			}
		},
	}
	return cb
}

// startConformanceKube starts a KubeBackend on w's API server with a
// client and informers of its own, as a worker does.
func startConformanceKube(t *testing.T, w *world, name string) (*KubeBackend, *apiClient) {
	t.Helper()
	client := w.api.newClient(name, nil)
	factory := kube.NewInformerFactory(client, simKaniko.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		t.Fatal(err)
	}
	backend, err := NewKubeBackend(client, watcher, simKaniko)
	if err != nil {
		t.Fatal(err)
	}
	backend.WithDigestResolver(func(ctx context.Context, ref string) (string, error) { return w.reg.client.Head(ctx, ref) })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		factory.Shutdown()
	})
	factory.Start(ctx.Done())
	if !watcher.WaitForSync(ctx) {
		t.Fatal("informers did not sync")
	}
	return backend, client
}

// ---- the local backend ----

// localConformance is LocalBackend on contexts served from memory, each
// held until finish releases it, pushing to a registry of the world.
func localConformance(t *testing.T) *conformanceBackend {
	w := newWorld(t, worldConfig{noNATS: true, registry: true})
	contexts := &heldContexts{objects: map[string][]byte{}, released: map[string]chan struct{}{}, opened: map[string]int{}}
	l := NewLocalBackend(contexts, w.reg.client, t.TempDir(), 0)
	var seq atomic.Int32
	objectOf := func(b Build) string { return b.Request.Source.S3.Key }
	return &conformanceBackend{
		backend: l,
		reg:     w.reg,
		holds:   true,
		failLog: "missing",
		build: func(t *testing.T, fail bool) Build {
			dockerfile := "FROM scratch\nCOPY app /app\n"
			if fail {
				dockerfile = "FROM scratch\nCOPY missing /missing\n"
			}
			digest, tgz := conformanceContext(t, map[string]string{"Dockerfile": dockerfile, "app": fmt.Sprintf("%s %d", t.Name(), seq.Add(1))})
			object := s3store.TenantContextKey("acme", digest)
			contexts.put(object, tgz)
			req := request("unused")
			req.ContextDigest, req.Source = digest, v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: object}}
			req.BuildArgs, req.Labels = nil, nil
			key := v1.BuildKey(req, l.Identity())
			tag := v1.DefaultTag(key)
			return Build{Request: req, Key: key, Run: "r1",
				Destinations: []string{w.reg.host + "/acme/web:" + tag, w.reg.host + "/acme/web-copy:" + tag}}
		},
		finish: func(_ *testing.T, b Build) { contexts.release(objectOf(b)) },
		builds: func(b Build) int { return contexts.opens(objectOf(b)) },
		left: func(b Build) bool {
			l.mu.Lock()
			defer l.mu.Unlock()
			r, ok := l.running[b.Key]
			return ok && r.run == b.Run
		},
		noAnother: "a local build lives in its backend's process (LocalBackend.running): another backend cannot adopt it, " +
			"and a build whose caller's context ended is canceled with it",
		unavailable: func(*testing.T) { contexts.broken.Store(true) },
		noRemove:    "a local build runs inside its backend's process: nothing outside the backend can remove it",
	}
}

// heldContexts serves context objects from memory; opening one waits
// until it is released (or the context ends), and counts.
type heldContexts struct {
	mu       sync.Mutex
	objects  map[string][]byte
	released map[string]chan struct{}
	opened   map[string]int
	broken   atomic.Bool
}

func (h *heldContexts) put(key string, b []byte) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.objects[key] = b
	h.released[key] = make(chan struct{})
}

func (h *heldContexts) release(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.released[key]:
	default:
		close(h.released[key])
	}
}

func (h *heldContexts) opens(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.opened[key]
}

func (h *heldContexts) Open(ctx context.Context, _, key string) (io.ReadCloser, error) {
	if h.broken.Load() {
		return nil, errors.New("dial tcp: connection refused (object store down)")
	}
	h.mu.Lock()
	h.opened[key]++
	b, ok := h.objects[key]
	released := h.released[key]
	h.mu.Unlock()
	if !ok {
		return nil, s3store.ErrNotFound
	}
	select {
	case <-released:
		return io.NopCloser(bytes.NewReader(b)), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// conformanceContext packs files as a build context: its digest and
// tar.gz.
func conformanceContext(t *testing.T, files map[string]string) (string, []byte) {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	res, err := contexttar.Write(context.Background(), dir, &buf, contexttar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return res.Digest, buf.Bytes()
}
