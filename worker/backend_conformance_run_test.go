package worker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
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
	"github.com/buildq/buildq/internal/s3store"
)

// Running the backend conformance cases against one backend.

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
	backend, client, down := startConformanceKube(t, w, "w1")
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
			b, _, _ := startConformanceKube(t, w, "w2")
			return b
		},
		unavailable: func(*testing.T) { down.Store(true) },
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
func startConformanceKube(t *testing.T, w *world, name string) (*KubeBackend, *apiClient, *atomic.Bool) {
	t.Helper()
	client := w.api.newClient(name, nil)
	// The API server down (unavailable): a reactor in place before any
	// informer reads the client's reactors, switched on later (adding one
	// while informers list would race with them).
	down := &atomic.Bool{}
	client.PrependReactor("*", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
		if !down.Load() {
			return false, nil, nil
		}
		return true, nil, apierrors.NewInternalError(errors.New("etcdserver: leader changed"))
	})
	factory := kube.NewInformerFactory(client, simKaniko.Namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	if err != nil {
		t.Fatal(err)
	}
	backend, err := NewKubeBackend(client, watcher, simKaniko)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		factory.Shutdown()
	})
	factory.Start(ctx.Done())
	if !watcher.WaitForSync(ctx) {
		t.Fatal("informers did not sync")
	}
	return backend, client, down
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
