package worker

// Helpers for tests of one tenant against another. Tenant "acme" is the
// victim, "mallory" the attacker (and "globex" a third tenant): mallory
// publishes only on her own subjects (buildq.requests.mallory,
// buildq.api.*.mallory) and reads only hers; she controls every byte of her
// bodies and headers, the timing of her requests, and the objects under
// contexts/mallory/. Where a test needs an interleaving (a handler paused,
// a slow settle pass) it says so: the invariants hold under any.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
)

func mallorys(seed string) *v1.Request {
	r := request(seed)
	r.Tenant = "mallory"
	r.Source.S3.Key = strings.Replace(r.Source.S3.Key, "contexts/acme/", "contexts/mallory/", 1)
	return r
}

// tenantRequestFor is a request of tenant for the context digest, its
// object under the tenant's own prefix.
func tenantRequestFor(tenant, digest string) *v1.Request {
	r := request("possession")
	r.Tenant, r.ContextDigest = tenant, digest
	r.Source.S3.Key = s3store.TenantContextKey(tenant, digest)
	return r
}

// objectStore is a ContextSource whose objects a test sets and whose reads
// it counts.
type objectStore struct {
	mu      sync.Mutex
	objects map[string][]byte
	opens   map[string]int
}

func (s *objectStore) put(key string, b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.objects[key] = b
}

func (s *objectStore) reads(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opens[key]
}

// Version is the object's version as S3 tells it with a HEAD (an ETag):
// here a hash of its bytes.
func (s *objectStore) Version(_ context.Context, _, key string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.objects[key]
	if !ok {
		return "", s3store.ErrNotFound
	}
	return hex64(string(b)), nil
}

func (s *objectStore) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opens[key]++
	b, ok := s.objects[key]
	if !ok {
		return nil, s3store.ErrNotFound
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

func newObjectStore() *objectStore {
	return &objectStore{objects: map[string][]byte{}, opens: map[string]int{}}
}

// faultyStore is an objectStore whose Open can be gated (blocks until
// released or its caller gives up, as an S3 GET does), made to panic once,
// and whose bytes read are counted.
type faultyStore struct {
	*objectStore
	mu        sync.Mutex
	gate      chan struct{} // nil: open
	entered   chan struct{} // closed at the first Open while gated
	enterOnce sync.Once
	panicOnce atomic.Bool
	bytesRead atomic.Int64
}

func (s *faultyStore) hold() {
	s.mu.Lock()
	s.gate = make(chan struct{})
	s.mu.Unlock()
}

func (s *faultyStore) release() {
	s.mu.Lock()
	if s.gate != nil {
		close(s.gate)
		s.gate = nil
	}
	s.mu.Unlock()
}

func (s *faultyStore) Open(ctx context.Context, bucket, key string) (io.ReadCloser, error) {
	if s.panicOnce.CompareAndSwap(true, false) {
		panic("s3: nil pointer dereference in the response parser (injected)")
	}
	s.mu.Lock()
	gate := s.gate
	s.mu.Unlock()
	if gate != nil {
		s.enterOnce.Do(func() { close(s.entered) })
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, fmt.Errorf("s3 GET %s: %w", key, ctx.Err())
		}
	}
	body, err := s.objectStore.Open(ctx, bucket, key)
	if err != nil {
		return nil, err
	}
	return &countingBody{ReadCloser: body, n: &s.bytesRead}, nil
}

func newFaultyStore() *faultyStore {
	return &faultyStore{objectStore: newObjectStore(), entered: make(chan struct{})}
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// packDir packs files with contexttar and returns the digest and tar.gz.
func packDir(t *testing.T, files map[string]string) (string, []byte) {
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

// mapContexts serves context objects from memory.
type mapContexts map[string][]byte

func (m mapContexts) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	b, ok := m[key]
	if !ok {
		return nil, s3store.ErrNotFound
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

// publishRaw publishes body on subject with headers hdr and returns
// the PubAck or the server's error.
func publishRaw(js jetstream.JetStream, subject string, hdr map[string]string, body []byte) (*jetstream.PubAck, error) {
	m := nats.NewMsg(subject)
	for k, v := range hdr {
		m.Header[k] = []string{v}
	}
	m.Data = body
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return js.PublishMsg(ctx, m)
}

// oneResult waits for the one result of id.
func oneResult(t *testing.T, results *resultCollector, id string) v1.Result {
	t.Helper()
	var got []v1.Result
	eventually(t, 15*time.Second, "the result of "+id, func() bool {
		got = byID(results.snapshot())[id]
		return len(got) > 0
	})
	if len(got) != 1 {
		t.Fatalf("%d results for %s: %s", len(got), id, mustJSON(t, got))
	}
	return got[0]
}

// resultPlayingKubelet waits up to timeout for id's result, playing a successful
// kubelet for the Job of key if one is created meanwhile; nil when neither
// came.
func (e *env) resultPlayingKubelet(results *resultCollector, key, id string, timeout time.Duration) *v1.Result {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	played := false
	for time.Now().Before(deadline) {
		if got := byID(results.snapshot())[id]; len(got) > 0 {
			return &got[0]
		}
		if !played {
			if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), kaniko.JobName(key), metav1.GetOptions{}); err == nil {
				e.kubelet(j, 0, digestOf("built "+key))
				played = true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// repoTags lists the tags of tenant's repository "web" in tr (none when
// the repository does not exist).
func repoTags(t *testing.T, tr *testRegistry, tenant string) []string {
	t.Helper()
	repo, err := name.NewRepository(tr.host+"/"+tenant+"/web", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	tags, err := remote.List(repo)
	if err != nil {
		return nil
	}
	return tags
}

// ledgerEntry reads tenant's request id's ledger entry (nil: none).
func (e *env) ledgerEntry(tenant, id string) *v1.RequestEntry {
	e.t.Helper()
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return nil
	}
	ent, err := kv.Get(ctx, RequestIndexKey(tenant, id))
	if err != nil {
		return nil
	}
	var le v1.RequestEntry
	if err := json.Unmarshal(ent.Value(), &le); err != nil {
		e.t.Fatal(err)
	}
	return &le
}

// fetchFails plays the node for a Job whose fetch-context init
// container exits with code (kaniko.FetchExit*): what a build Pod does
// when the request's context object is missing (4) or holds other bytes
// (3).
func (e *env) fetchFails(job *batchv1.Job, code int32, message string) {
	t := e.t
	t.Helper()
	ctx := context.Background()
	now := metav1.Now()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: job.Name + "-fetch-" + strings.ToLower(nats.NewInbox()[7:15]), Namespace: job.Namespace,
			Labels:            merge(job.Spec.Template.Labels, map[string]string{batchv1.JobNameLabel: job.Name}),
			CreationTimestamp: now,
		},
		Spec: job.Spec.Template.Spec,
		Status: corev1.PodStatus{
			Phase: corev1.PodFailed,
			InitContainerStatuses: []corev1.ContainerStatus{{
				Name: kaniko.FetchContainerName,
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: code, Message: message, FinishedAt: now,
				}},
			}},
		},
	}
	if _, err := e.kube.CoreV1().Pods(job.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	j := job.DeepCopy()
	j.Status.StartTime = &now
	j.Status.Failed = 1
	// The Job controller's words when a FailJob rule matched.
	m := fmt.Sprintf("Container %s for pod %s/%s failed with exit code %d matching FailJob rule at index 0", kaniko.FetchContainerName, pod.Namespace, pod.Name, code)
	j.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: m, LastTransitionTime: now},
		{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: m, LastTransitionTime: now},
	}
	if _, err := e.kube.BatchV1().Jobs(job.Namespace).UpdateStatus(ctx, j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// claimOrAnswer waits until mallory's request id either claimed key (its
// Job exists: returned) or was answered without a claim (nil: a worker
// that checks possession before anything else refuses it at once, and
// the attack that needs her claim cannot start).
func (e *env) claimOrAnswer(results *resultCollector, key, id string) *batchv1.Job {
	e.t.Helper()
	var job *batchv1.Job
	eventually(e.t, 10*time.Second, "mallory's claim or her answer", func() bool {
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), kaniko.JobName(key), metav1.GetOptions{}); err == nil {
			job = j
			return true
		}
		return len(byID(results.snapshot())[id]) > 0
	})
	return job
}

// runJob waits for the Job of the given run of key (the Job name is the
// key's; a new run replaces the Job of the one before).
func (e *env) runJob(key, run string) *batchv1.Job {
	e.t.Helper()
	var job *batchv1.Job
	eventually(e.t, 10*time.Second, "the Job of run "+run, func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.Annotations[kaniko.AnnotationRun] != run {
			return false
		}
		job = j
		return true
	})
	return job
}

// goroutinesIn counts the goroutines whose stack holds fn called on the
// builder of worker w (the receiver's address is the call's first
// argument) and not notIn.
func goroutinesIn(w *Worker, fn, notIn string) int {
	buf := make([]byte, 8<<20)
	n := runtime.Stack(buf, true)
	call := fmt.Sprintf("(*builder).%s(%p", fn, w.builds)
	count := 0
	for _, g := range strings.Split(string(buf[:n]), "\n\n") {
		if strings.Contains(g, call) && (notIn == "" || !strings.Contains(g, notIn)) {
			count++
		}
	}
	return count
}
