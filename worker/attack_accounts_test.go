package worker

import (
	"context"
	"encoding/json"
	"hash/fnv"
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
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/tenantapi"
)

// Attacks of tenant "mallory" on tenant "acme" against the commit that put
// tenants into NATS accounts of their own and added possession
// (98418f0). Mallory sends only what a tenant can: requests on
// buildq.requests.mallory (any body, any header, any timing), status and
// cancel on her own services, and objects under contexts/mallory/. Where a
// test needs an interleaving (a handler paused for a few milliseconds, a
// slow settle pass) it says so: invariant 10 requires the invariants under
// any interleaving.
//
// Tests whose name says "Attack" demonstrate a break and fail on 98418f0;
// the others are attacks that are refused and stay as regression tests.

// ---- helpers ----

// acctFetchFails plays the node for a Job whose fetch-context init
// container exits with code (kaniko.FetchExit*): what a build Pod does
// when the request's context object is missing (4) or holds other bytes
// (3).
func (e *env) acctFetchFails(job *batchv1.Job, code int32, message string) {
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
	j.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: "Container fetch-context for pod exited with code", LastTransitionTime: now},
		{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonPodFailurePolicy, Message: "Container fetch-context for pod exited with code", LastTransitionTime: now},
	}
	if _, err := e.kube.BatchV1().Jobs(job.Namespace).UpdateStatus(ctx, j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// acctClaims waits until mallory's request id either claimed key (its
// Job exists: returned) or was answered without a claim (nil: a worker
// that checks possession before anything else refuses it at once, and
// the attack that needs her claim cannot start).
func (e *env) acctClaims(results *resultCollector, key, id string) *batchv1.Job {
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

// acctTenantJob waits for a Job of tenant's (found by its label, whatever
// its key).
func (e *env) acctTenantJob(tenant string) *batchv1.Job {
	e.t.Helper()
	var job *batchv1.Job
	eventually(e.t, 10*time.Second, "a Job of "+tenant, func() bool {
		l, err := e.kube.BatchV1().Jobs(testNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: kaniko.LabelTenant + "=" + tenant})
		if err != nil || len(l.Items) == 0 {
			return false
		}
		job = &l.Items[0]
		return true
	})
	return job
}

// acctRunJob waits for the Job of the given run of key (the Job name is the
// key's; a new run replaces the Job of the one before).
func (e *env) acctRunJob(key, run string) *batchv1.Job {
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

// acctParked reports whether tenant's request id is parked on key.
func (e *env) acctParked(key, tenant, id string) bool {
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return false
	}
	ent, err := kv.Get(ctx, ledger.WaiterKey(key, tenant, id))
	if err != nil {
		return false
	}
	v, ok := ledger.ParseWaiter(ent.Value())
	return ok && v.Parked
}

// acctLedger reads tenant's request id's ledger entry (nil: none).
func (e *env) acctLedger(tenant, id string) *v1.RequestEntry {
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

// acctTags lists the tags of tenant's repository "web" in tr (none when
// the repository does not exist).
func acctTags(t *testing.T, tr *testRegistry, tenant string) []string {
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

// acctResult waits for the one result of id.
func acctResult(t *testing.T, results *resultCollector, id string) v1.Result {
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

// acctPause pauses, once, the first goroutine that reads the worker's
// clock from inside a function whose name ends with fn — a handler
// descheduled (a GC pause, a slow KV round trip) at that point.
type acctPause struct {
	fn      string
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func newAcctPause(t *testing.T, fn string) *acctPause {
	p := &acctPause{fn: fn, entered: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(p.open)
	return p
}

func (p *acctPause) open() { p.once.Do(func() { close(p.release) }) }

func (p *acctPause) now() time.Time {
	if p.armed.Load() && calledFrom(p.fn) && p.armed.CompareAndSwap(true, false) {
		close(p.entered)
		<-p.release
	}
	return time.Now()
}

func (p *acctPause) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-p.entered:
	case <-time.After(10 * time.Second):
		t.Fatalf("no goroutine reached %s", p.fn)
	}
}

// calledFrom reports whether a function whose name ends with suffix is on
// the caller's stack.
func calledFrom(suffix string) bool {
	pcs := make([]uintptr, 48)
	n := runtime.Callers(2, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.Function, suffix) {
			return true
		}
		if !more {
			return false
		}
	}
}

// acctPublishRaw publishes body on subject with headers hdr and returns
// the PubAck or the server's error.
func acctPublishRaw(js jetstream.JetStream, subject string, hdr map[string]string, body []byte) (*jetstream.PubAck, error) {
	m := nats.NewMsg(subject)
	for k, v := range hdr {
		m.Header[k] = []string{v}
	}
	m.Data = body
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return js.PublishMsg(ctx, m)
}

// ---- breaks ----

// Attack (possession bypass, park): mallory holds nothing of acme's
// content, but knows its digest. She claims the key herself (run r1 —
// her context object is missing, so r1 will fail) and sends a second
// request M2 for the key. M2's handler reads the record (mallory's own
// run: no possession check, tenants are checked only against foreign
// runs), then parks: it writes its waiter entry and reads the record
// again, and parks if the record is "building with an owner" — it never
// compares the run it read again with the run it checked (park.go:129).
// If, between the two reads, r1 fails and acme's request claims the
// key (run r2, acme's content), M2 parks on acme's run; when r2 succeeds,
// settleWaiter (park.go:269-300) answers every parked waiter from the
// record as it is, whatever run it parked on, without a possession check: mallory gets
// acme's digest and acme's image copied into her repository. The window
// is a few KV round trips; mallory may try as often as she likes (each
// try is one more request of hers). Here M2's handler is paused for that
// window (invariant 10: any interleaving). Breaks invariant 8 ("its
// answer can come only from a build of content the tenant itself holds").
func TestAttackParkOnAnotherRunBypassesPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	pause := newAcctPause(t, ".(*parking).park")
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store; c.Now = pause.now })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's unreleased app"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive) // acme holds the content; mallory holds nothing
	key := v1.BuildKey(a, kanikoID)

	// Mallory claims the key: run r1, hers.
	m1 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m1); err != nil {
		t.Fatal(err)
	}
	j1 := e.acctClaims(results, key, m1.RequestID)
	if j1 == nil {
		return // refused before any claim: nothing to park on
	}
	r1 := e.claim(key)
	if r1 == nil || r1.Tenant != "mallory" {
		t.Fatalf("record %+v, want mallory's run", r1)
	}

	// M2 reads mallory's own run and is about to park on it.
	pause.armed.Store(true)
	m2 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m2); err != nil {
		t.Fatal(err)
	}
	pause.waitEntered(t)

	// r1 fails (mallory's object is missing); acme's request claims run r2.
	e.acctFetchFails(j1, kaniko.FetchExitRefused, "context object missing")
	if r := acctResult(t, results, m1.RequestID); r.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory's first request: %s", mustJSON(t, r))
	}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	var r2 *v1.BuildRecord
	eventually(t, 10*time.Second, "acme's run", func() bool {
		r2 = e.claim(key)
		return r2 != nil && r2.State == v1.StateBuilding && r2.Tenant == "acme" && r2.Run != r1.Run
	})
	j2 := e.acctRunJob(key, r2.Run)

	// M2 goes on: it parks (or, fixed, does not).
	pause.open()
	eventually(t, 10*time.Second, "mallory's second request parked or answered", func() bool {
		return e.acctParked(key, "mallory", m2.RequestID) || len(byID(results.snapshot())[m2.RequestID]) > 0
	})

	// acme's run succeeds.
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	ar := acctResult(t, results, a.RequestID)
	if ar.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's request: %s", mustJSON(t, ar))
	}
	mr := acctResult(t, results, m2.RequestID)
	if mr.Data.Status == v1.StatusSucceeded || mr.Data.Digest != "" || mr.Data.Image != "" || mr.Data.LogTail != "" {
		t.Errorf("mallory, who holds nothing of acme's content, was answered from acme's run: %s (acme's digest %s)",
			mustJSON(t, mr.Data), ar.Data.Digest)
	}
	if tags := acctTags(t, tr, "mallory"); len(tags) > 0 {
		t.Errorf("acme's image was copied into mallory's repository: tags %v", tags)
	}
}

// Attack (possession bypass, settle): the same hole at its other end.
// Mallory's M2 parks on her own run r1 the ordinary way. r1 fails; the
// pass that answers r1's parked waiters reads the record only after
// listing them — and once a waiter is parked, settleWaiter answers it
// from whatever final record the key has, never checking the run it
// parked on (ledger.Waiter.Run is written, park.go:115, and never read) nor
// possession.
// If acme's request claims the key (run r2) before that pass reads the
// record, M2 stays parked on acme's run and is answered from it. The pass
// is slowed here by holding its per-key lock (mallory can slow it herself:
// the listing reads every waiter entry of the key, and she can park as
// many requests on her run as she likes). Breaks invariant 8.
func TestAttackSettleAnswersParkedRequestFromAnotherRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	rw := e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store }, nil, nil)
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's other app"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	key := v1.BuildKey(a, kanikoID)

	m1 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m1); err != nil {
		t.Fatal(err)
	}
	j1 := e.acctClaims(results, key, m1.RequestID)
	if j1 == nil {
		return // refused before any claim: nothing to park on
	}
	r1 := e.claim(key)
	m2 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "mallory's second request parked", func() bool { return e.acctParked(key, "mallory", m2.RequestID) })

	// The settle pass of the key is slow.
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	mu := &rw.w.park.settling[h.Sum32()%uint32(len(rw.w.park.settling))]
	mu.Lock()
	locked := true
	unlock := func() {
		if locked {
			locked = false
			mu.Unlock()
		}
	}
	defer unlock()

	e.acctFetchFails(j1, kaniko.FetchExitRefused, "context object missing")
	if r := acctResult(t, results, m1.RequestID); r.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory's first request: %s", mustJSON(t, r))
	}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	var r2 *v1.BuildRecord
	eventually(t, 10*time.Second, "acme's run", func() bool {
		r2 = e.claim(key)
		return r2 != nil && r2.State == v1.StateBuilding && r2.Tenant == "acme" && r2.Run != r1.Run
	})
	j2 := e.acctRunJob(key, r2.Run)
	unlock()
	// Let the pass (and a sweep) run before acme's run ends.
	time.Sleep(300 * time.Millisecond)

	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	ar := acctResult(t, results, a.RequestID)
	if ar.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's request: %s", mustJSON(t, ar))
	}
	mr := acctResult(t, results, m2.RequestID)
	if mr.Data.Status == v1.StatusSucceeded || mr.Data.Digest != "" || mr.Data.Image != "" {
		t.Errorf("mallory's request parked on her own run r1 was answered from acme's run r2: %s (acme's digest %s)",
			mustJSON(t, mr.Data), ar.Data.Digest)
	}
	if tags := acctTags(t, tr, "mallory"); len(tags) > 0 {
		t.Errorf("acme's image was copied into mallory's repository: tags %v", tags)
	}
}

// Attack (existence oracle): mallory holds nothing and asks for a key
// whose digest she guessed (a build arg, a commit, a release of acme's).
// When another tenant built it, she is refused at once, and the refusal
// says so ("this build key was built from another tenant's request",
// possession.go:150); when nobody did, her request claims the key, a Job
// is created and she sees "claimed" and "job-created" events and a
// failure of her build. Either way she learns whether acme built those
// exact inputs — an answer from a build of content she does not hold.
// Possession is checked only when the record is another tenant's
// (foreignRun), so whether it is checked at all depends on acme's build.
// Breaks invariant 8: the existence of another tenant's build is an
// answer from it.
func TestAttackPossessionRefusalRevealsAForeignBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	events := e.events()
	ctx := context.Background()

	built, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY v /v\n", "v": "release 7"})
	never, _ := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY v /v\n", "v": "release 8"})
	a := tenantRequestFor("acme", built)
	store.put(a.Source.S3.Key, archive)
	if r := e.buildThrough(t, tr, results, a, 1); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's build: %s", mustJSON(t, r))
	}

	// The same question twice: "release 7" (acme built it), "release 8"
	// (nobody did). Mallory holds neither.
	guess := func(digest string) v1.Result {
		m := tenantRequestFor("mallory", digest)
		if _, err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		var res v1.Result
		eventually(t, 15*time.Second, "mallory's answer", func() bool {
			if got := byID(results.snapshot())[m.RequestID]; len(got) > 0 {
				res = got[0]
				return true
			}
			// Her request may have claimed the key: its build fails on
			// her missing object, as in a real build Pod.
			l, err := e.kube.BatchV1().Jobs(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: kaniko.LabelTenant + "=mallory"})
			if err == nil {
				for i := range l.Items {
					if j := &l.Items[i]; j.Status.Failed == 0 && j.Status.Succeeded == 0 {
						e.acctFetchFails(j, kaniko.FetchExitRefused, "context object missing")
					}
				}
			}
			return false
		})
		return res
	}
	fingerprint := func(r v1.Result, digest string) string {
		var phases []string
		events.mu.Lock()
		for _, ev := range events.events {
			if ev.RequestID == r.ID {
				phases = append(phases, string(ev.Phase))
			}
		}
		events.mu.Unlock()
		msg := strings.ReplaceAll(r.Data.Message, strings.TrimPrefix(digest, "sha256:"), "<digest>")
		return strings.Join([]string{string(r.Data.Status), r.Data.Reason, msg, strings.Join(phases, ","),
			map[bool]string{true: "job", false: "no job"}[r.Data.Job != ""]}, " | ")
	}
	r7, r8 := guess(built), guess(never)
	time.Sleep(100 * time.Millisecond) // the last events
	f7, f8 := fingerprint(r7, built), fingerprint(r8, never)
	if f7 != f8 {
		t.Errorf("mallory, holding neither context, tells a key acme built from one nobody built:\n  acme built it: %s\n  nobody did:    %s", f7, f8)
	}
}

// Attack (ids, nonces and requeue tokens read from the stream): JetStream
// honours Nats-Expected-Last-Msg-Id on BUILDQ_REQUESTS (no stream setting
// turns it off), and when it does not match, the PubAck's error quotes the
// stream's last message id — whoever published it. Mallory's failed probe
// stores nothing, so by probing on her own subject she reads the
// Nats-Msg-Id of the request any tenant published last: its tenant, its
// request id and its nonce. That much is a known limit of one stream for
// every tenant (docs/design.md §2b): the id gives her no power — ids are
// per tenant, the nonce guards only against a header published first, and
// a published header is no longer first. What must not leak is what would
// give power: a requeue's id showed the requeue token, from which every
// later requeue's id follows, so she could publish one first and have
// JetStream drop acme's requeue (requeueMsgID now hides the token). And a
// leaked request header, published again on her own subject, is dropped
// by the duplicate window, touching nothing of acme's.
func TestAttackExpectedLastMsgIDReadsAnotherTenantsMsgID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	probe := func(t *testing.T) string {
		t.Helper()
		_, err := acctPublishRaw(e.js, v1.RequestSubject("mallory"), map[string]string{
			v1.MsgIDHeader:              v1.MsgID("mallory", "probe-"+nats.NewInbox()[7:]),
			"Nats-Expected-Last-Msg-Id": "mallory-guess",
		}, []byte(`{}`))
		if err == nil {
			t.Fatal("the probe was stored")
		}
		return err.Error()
	}

	t.Run("a leaked request header gives no power", func(t *testing.T) {
		digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a /a\n", "a": "1"})
		a := tenantRequestFor("acme", digest)
		a.RequestID = "acme-release-2026-12-01-prod"
		store.put(a.Source.S3.Key, archive)
		if _, err := e.pub.Publish(ctx, a); err != nil {
			t.Fatal(err)
		}
		leaked := probe(t)
		i := strings.Index(leaked, "acme/")
		if i < 0 {
			t.Fatalf("the probe no longer reads the stream's last message id (%s): docs/design.md §2b's known limit is gone; say so there and here", leaked)
		}
		header := leaked[i:]
		// Replayed on her own subject: a duplicate, stored nowhere.
		if ack, err := acctPublishRaw(e.js, v1.RequestSubject("mallory"), map[string]string{v1.MsgIDHeader: header}, []byte(`{}`)); err != nil || !ack.Duplicate {
			t.Fatalf("mallory's replay of acme's header %q: %+v, %v; want a duplicate", header, ack, err)
		}
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(a, kanikoID))), 0, digestOf("acme"))
		if r := acctResult(t, results, a.RequestID); r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("acme: %s", mustJSON(t, r))
		}
	})

	t.Run("requeue token", func(t *testing.T) {
		digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a /a\n", "a": "2"})
		a := tenantRequestFor("acme", digest)
		store.put(a.Source.S3.Key, archive)
		key := v1.BuildKey(a, kanikoID)
		// Mallory claims the key (she holds the content too), acme's
		// request parks on her run, her run fails for her own input (her
		// repository refuses the push): acme's request is requeued.
		m := tenantRequestFor("mallory", digest)
		store.put(m.Source.S3.Key, archive)
		if _, err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		j1 := e.waitJob(kaniko.JobName(key))
		if _, err := e.pub.Publish(ctx, a); err != nil {
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, "acme's request parked", func() bool { return e.acctParked(key, "acme", a.RequestID) })
		token := e.acctLedger("acme", a.RequestID).RequeueToken
		e.kubelet(j1, 1, "error pushing image: failed to push to destination "+destination(j1)+": unauthorized")
		eventually(t, 10*time.Second, "acme's request requeued", func() bool { return !e.acctParked(key, "acme", a.RequestID) })
		time.Sleep(100 * time.Millisecond)
		if got := probe(t); token != "" && strings.Contains(got, token) {
			t.Errorf("mallory's probe reads the requeue token of acme's parked request (%s): %s", token, got)
		}
		var r2 *v1.BuildRecord
		eventually(t, 10*time.Second, "acme's own run", func() bool {
			r2 = e.claim(key)
			return r2 != nil && r2.Tenant == "acme" && r2.State == v1.StateBuilding
		})
		e.kubelet(e.acctRunJob(key, r2.Run), 0, digestOf("acme2"))
		if r := acctResult(t, results, a.RequestID); r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("acme: %s", mustJSON(t, r))
		}
	})
}

// Attack (cache poisoning through the index): with --cache-repo
// 'REGISTRY/{tenant}/cache' (accepted by a multi-tenant worker:
// checkJobConfig asks only for {tenant}), each run's Job uses the cache
// repository of the tenant whose request claimed the key, and mallory
// may push into hers (her own part of the registry, her own Secret).
// kaniko takes a RUN step's layer from the cache repository when it holds
// one under the step's cache key, without running the step. The build
// key does not name the cache (executor identity only), so the index
// entry made by mallory's run — her content, but layers from her cache —
// answers acme's request for the same content: acme deploys mallory's
// layers. The per-tenant cache was required precisely so that "a RUN
// step could [not] poison the cache for all" (cmd/buildq/worker.go); the
// index shares what it produced. The kubelet here plays kaniko's cache: a
// run whose cache repository holds an image outputs that image. Breaks
// invariant 7 ("every input that changes the image is in the build key")
// across tenants, and DESIGN §9 ("treat every Dockerfile as untrusted").
func TestAttackPerTenantCacheIsSharedThroughTheIndex(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	kc := testKaniko
	kc.CacheRepo = tr.host + "/{tenant}/cache"
	e.startWorkerWith("w1", kc, func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	// A public context both hold (an open-source release, say).
	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM docker.io/library/alpine:3.20\nCOPY src /src\nRUN /src/build.sh\n", "src": "public v1.0"})
	m := tenantRequestFor("mallory", digest)
	a := tenantRequestFor("acme", digest)
	store.put(m.Source.S3.Key, archive)
	store.put(a.Source.S3.Key, archive)

	// Mallory plants a layer in her own cache repository.
	poisoned := tr.push(t, tr.host+"/mallory/cache:step-cache-key")

	// kaniko with --cache: a cached layer is taken as it is.
	kanikoRun := func(job *batchv1.Job) string {
		cache := ""
		for _, arg := range job.Spec.Template.Spec.Containers[0].Args {
			if c, ok := strings.CutPrefix(arg, "--cache-repo="); ok {
				cache = c
			}
		}
		dest := destination(job)
		if cache != "" {
			if cr, err := name.NewRepository(cache, name.Insecure); err == nil {
				if tags, err := remote.List(cr); err == nil && len(tags) > 0 {
					if d, err := tr.client.Copy(ctx, cache+":"+tags[0], dest); err == nil {
						return d
					}
				}
			}
		}
		return tr.push(t, dest)
	}

	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	job := e.acctTenantJob("mallory")
	e.kubelet(job, 0, kanikoRun(job))
	if r := acctResult(t, results, m.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Digest != poisoned {
		t.Fatalf("mallory's build: %s (her planted layer %s)", mustJSON(t, r), poisoned)
	}

	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's answer or its own Job", func() bool {
		if len(byID(results.snapshot())[a.RequestID]) > 0 {
			return true
		}
		l, err := e.kube.BatchV1().Jobs(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: kaniko.LabelTenant + "=acme"})
		if err == nil && len(l.Items) > 0 && l.Items[0].Status.Succeeded == 0 {
			e.kubelet(&l.Items[0], 0, kanikoRun(&l.Items[0]))
		}
		return false
	})
	ar := acctResult(t, results, a.RequestID)
	if ar.Data.Digest == poisoned {
		t.Errorf("acme's request was answered (%s) with the image mallory's run made from her own cache repository %s/mallory/cache",
			ar.Data.Origin, tr.host)
	}
}

// Attack (a failure of the claimer's credentials answers the joiner):
// with per-tenant registry Secrets (--tenant-registry-secret, the
// multi-tenant setup), a run pulls its base images with the credentials of
// the tenant whose request claimed it. Mallory holds the same public
// context as acme (an open-source release) and claims its key just before
// acme's CI asks for it; acme's request passes the possession check and
// parks on her run. Her run fails for a reason of her credentials, not of
// the content: her own pull quota, which she used up on purpose
// ("TOOMANYREQUESTS: You have reached your pull rate limit"), or a base
// image her credentials may not read (ECR: "DENIED: ... is not authorized
// to perform: ecr:BatchGetImage"). ClassifyLog calls both BuildFailed,
// and sharedFailure counts every BuildFailed as the content's: acme's
// request is answered "failed", with mallory's log tail, although its own
// credentials would have built it — for every request of acme's for the
// key that joins while she holds the claim. Breaks invariant 7 (the
// answer describes mallory's credentials, not the key's inputs); the
// family of TestAttackClaimersMissingContextFailsTheJoiner.
func TestAttackClaimersCredentialFailureFailsTheJoiner(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	kc := testKaniko
	kc.RegistrySecret, kc.TenantRegistrySecret = "", "buildq-registry-{tenant}"
	e.startWorkerWith("w1", kc, func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM docker.io/library/alpine:3.20\nCOPY src /src\n", "src": "public project"})
	m := tenantRequestFor("mallory", digest)
	a := tenantRequestFor("acme", digest)
	store.put(m.Source.S3.Key, archive)
	store.put(a.Source.S3.Key, archive)
	key := v1.BuildKey(a, kanikoID)

	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	j1 := e.waitJob(kaniko.JobName(key))
	secret := ""
	for _, v := range j1.Spec.Template.Spec.Volumes {
		if v.Secret != nil {
			secret += v.Secret.SecretName + " "
		}
	}
	if !strings.Contains(secret, "buildq-registry-mallory") {
		t.Fatalf("mallory's run mounts %q, want her own Secret", secret)
	}
	r1 := e.claim(key)
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's request parked on mallory's run", func() bool { return e.acctParked(key, "acme", a.RequestID) })
	e.kubelet(j1, 1, "error building image: unable to complete operation after 0 attempts, last error: GET https://index.docker.io/v2/library/alpine/manifests/3.20: TOOMANYREQUESTS: You have reached your pull rate limit as 'mallory-ci': dckr_jti_x. You may increase the limit by upgrading.")
	if r := acctResult(t, results, m.RequestID); r.Data.Status != v1.StatusFailed {
		t.Fatalf("mallory's build: %s", mustJSON(t, r))
	}
	// acme's own run, if it gets one, pulls with acme's Secret and succeeds.
	eventually(t, 15*time.Second, "acme's answer", func() bool {
		if len(byID(results.snapshot())[a.RequestID]) > 0 {
			return true
		}
		if rec := e.claim(key); rec != nil && rec.State == v1.StateBuilding && rec.Tenant == "acme" && rec.Run != r1.Run {
			if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil &&
				j.Annotations[kaniko.AnnotationRun] == rec.Run && j.Status.Succeeded == 0 {
				e.kubelet(j, 0, tr.push(t, destination(j)))
			}
		}
		return false
	})
	if ar := acctResult(t, results, a.RequestID); ar.Data.Status != v1.StatusSucceeded {
		t.Errorf("acme's request was answered with the failure of mallory's credentials: %s", mustJSON(t, ar.Data))
	}
}

// ---- refused: regression tests ----

// A record with no tenant (written before records named their claimer's
// tenant, or by any other path) counts as another tenant's: mallory,
// holding nothing, is refused and gets nothing of it.
func TestTenantlessRecordNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, _ := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY x /x\n", "x": "old"})
	m := tenantRequestFor("mallory", digest)
	key := v1.BuildKey(m, kanikoID)
	img := tr.host + "/acme/web:" + v1.DefaultTag(key)
	d := tr.push(t, img)
	rec := v1.BuildRecord{Key: key, State: v1.StateSucceeded, Run: "old-run", Repository: tr.host + "/acme/web", Image: img,
		Pushed: []string{img}, Destinations: []string{img}, Digest: d, StartedAt: time.Now().UTC(), FinishedAt: time.Now().UTC()}
	b, _ := json.Marshal(rec)
	kv, err := e.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, key, b); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	r := acctResult(t, results, m.RequestID)
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMissing || r.Data.Digest != "" {
		t.Fatalf("mallory on a tenantless record: %s", mustJSON(t, r))
	}
	if tags := acctTags(t, tr, "mallory"); len(tags) > 0 {
		t.Fatalf("copied into mallory's repository: %v", tags)
	}
}

// A git source shows no possession (the worker reads no object of it), so
// with possession checked its build key is its tenant's own
// (KeyIdentity): another tenant's request for the same repository and
// commit builds on its own, never joins nor is answered from acme's build.
func TestGitRequestIsNeverAnsweredFromAForeignBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = newObjectStore() })
	results := e.collect()
	ctx := context.Background()
	git := func(tenant string) *v1.Request {
		r := request("git")
		r.Tenant, r.ContextDigest = tenant, ""
		r.Source = v1.Source{Git: &v1.GitSource{URL: "https://git.example.com/acme/private.git", Commit: strings.Repeat("ab", 20)}}
		return r
	}
	keyOf := func(r *v1.Request) string { return v1.BuildKey(r, KeyIdentity(kanikoID, r, false, true)) }
	a, m := git("acme"), git("mallory")
	if keyOf(a) == keyOf(m) || keyOf(a) == v1.BuildKey(a, kanikoID) {
		t.Fatalf("git keys are not per tenant: %s %s", keyOf(a), keyOf(m))
	}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	ajob := e.waitJob(kaniko.JobName(keyOf(a)))
	// Mallory, while acme's build runs: a build of her own.
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	mjob := e.waitJob(kaniko.JobName(keyOf(m)))
	e.kubelet(ajob, 0, tr.push(t, destination(ajob)))
	ar := acctResult(t, results, a.RequestID)
	e.kubelet(mjob, 1, "kaniko: git clone: authentication required")
	if r := acctResult(t, results, m.RequestID); r.Data.Status != v1.StatusFailed || r.Data.Digest != "" || r.Data.Key != keyOf(m) {
		t.Fatalf("mallory's git request: %s (acme's: %s)", mustJSON(t, r), mustJSON(t, ar))
	}
	// And after acme's build: her own again, never acme's image.
	again := git("mallory")
	if _, err := e.pub.Publish(ctx, again); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(keyOf(again)))
	if job.Name == ajob.Name {
		t.Fatal("mallory's request adopted acme's Job")
	}
	if tags := acctTags(t, tr, "mallory"); len(tags) > 0 {
		t.Fatalf("copied into mallory's repository: %v", tags)
	}
}

// A run let go by its owner (Owner empty: a worker stopped) is taken over
// by the next request for the key — never by one whose tenant does not
// hold the content.
func TestReleasedForeignRunIsNotTakenOverWithoutPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY x /x\n", "x": "released"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	key := v1.BuildKey(a, kanikoID)
	// acme's run, let go by its owner (as at shutdown).
	rec := v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "acme-run", Tenant: "acme", Name: "web", RequestID: "acme-req",
		Seq: 1, Holder: RequestIndexKey("acme", "acme-req"), LeaseMs: 2000, Repository: "registry.test:5000/acme/web",
		Destinations: []string{"registry.test:5000/acme/web:" + v1.DefaultTag(key)}, Source: &a.Source, StartedAt: time.Now().UTC()}
	b, _ := json.Marshal(rec)
	kv, err := e.js.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, key, b); err != nil {
		t.Fatal(err)
	}
	m := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	if r := acctResult(t, results, m.RequestID); r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory on acme's released run: %s", mustJSON(t, r))
	}
	if cur := e.claim(key); cur == nil || cur.Owner != "" || cur.Holder != rec.Holder {
		t.Fatalf("the run was taken over: %+v", cur)
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d Jobs created", n)
	}
}

// A refused request of mallory's takes and blocks only ids of mallory's:
// whatever tenant, id or header form her body and header name, its id
// is the subject's tenant's, and acme's request of the id she named is
// built and answered as if she had sent nothing.
func TestRefusedRequestNeverTakesAnotherTenantsID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	ctx := context.Background()

	forged := request("refused-id")
	forged.APIVersion, forged.RequestID = v1.APIVersion, "build-7"
	body, _ := json.Marshal(forged) // tenant "acme" in the body, on mallory's subject
	for _, hdr := range []map[string]string{
		{v1.MsgIDHeader: "acme/build-7/nonce"},
		{v1.MsgIDHeader: "build-7"},
		{},
	} {
		if _, err := acctPublishRaw(e.js, v1.RequestSubject("mallory"), hdr, body); err != nil {
			t.Fatal(err)
		}
	}
	// Two results: the bare header and no header both name mallory's
	// build-7 (one result id, mallory/build-7, the stream keeps once).
	got := results.waitFor(t, 2, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	for _, r := range results.snapshot() {
		if r.Data.Tenant != "mallory" || r.Data.Reason != v1.ReasonInvalidRequest {
			t.Fatalf("refusal %s", mustJSON(t, r))
		}
	}
	a := request("refused-id")
	a.RequestID = "build-7"
	ack, err := e.pub.Publish(ctx, a)
	if err != nil || ack.Duplicate {
		t.Fatalf("acme's publish: %+v %v", ack, err)
	}
	e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(a, kanikoID))), 0, digestOf("acme"))
	_ = got
	var mine []v1.Result
	eventually(t, 10*time.Second, "acme's result", func() bool {
		mine = nil
		for _, r := range results.snapshot() {
			if r.Data.Tenant == "acme" {
				mine = append(mine, r)
			}
		}
		return len(mine) > 0
	})
	time.Sleep(100 * time.Millisecond)
	if len(mine) != 1 || mine[0].ID != "build-7" || mine[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's results: %s", mustJSON(t, mine))
	}
	if le := e.acctLedger("acme", "build-7"); le == nil || le.Result == nil || le.Result.Status != v1.StatusSucceeded {
		t.Fatalf("acme's ledger entry: %+v", le)
	}
}

// The worker trusts any _R_. reply (a service import's): no client can
// name one. A status request of tenant acme with the reply _R_.… is
// refused by nats-server itself and never answered, in the one-account
// harness as in the account per tenant.
func TestServiceReplyPrefixCannotBeForged(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	eventually(t, 5*time.Second, "the status service", func() bool {
		_, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), "nothing", time.Second)
		return err == nil
	})
	spy, err := e.nc.SubscribeSync("_R_.>")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = spy.Unsubscribe() }()
	nc, err := nats.Connect(e.srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for _, reply := range []string{"_R_.abc.def", "_R_.x"} {
		_ = nc.PublishRequest(v1.APIStatusSubject("acme"), reply, []byte("x"))
		_ = nc.PublishRequest(v1.APICancelSubject("acme"), reply, []byte(hex64("k")))
	}
	_ = nc.Flush()
	if m, err := spy.NextMsg(500 * time.Millisecond); err == nil {
		t.Fatalf("answered on a forged service reply %s: %s", m.Subject, m.Data)
	}
	// Inbox prefixes of tenants whose names share a prefix stay apart.
	for _, c := range []struct {
		tenant, reply string
		ok            bool
	}{
		{"acme-corp", "_INBOX_acme.x", false},
		{"acme", "_INBOX_acme-corp.x", false},
		{"acme-corp", "_INBOX_acme-corp.x", true},
		{"a", "_INBOX_acme.x", false},
		{"acme", "_INBOX_ACME.x", false},
		{"acme", "_inbox_acme.x", false},
	} {
		if got := tenantapi.ReplyAllowed(false, c.tenant, c.reply); got != c.ok {
			t.Errorf("replyAllowed(%s, %s) = %v, want %v", c.tenant, c.reply, got, c.ok)
		}
	}
}

// JetStream's publish controls a tenant can put on its request: the
// stream has no rollup, TTL, schedules, counters or atomic batches, so
// the server refuses those outright; Nats-Msg-Id and the Nats-Expected-*
// checks are honoured (see TestAttackExpectedLastMsgIDReadsAnotherTenantsMsgID
// for what their errors tell), and intake strips every Nats-* header
// before the queue (TestAttackJetStreamHeaderStrandsRequestInIntake).
// None of them lets mallory's publish touch another subject's messages.
func TestJetStreamPublishControlsOnRequestsTouchNothingElse(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// The streams, with no worker to take the requests: acme's waits in
	// the work queue.
	if _, _, err := EnsureStreams(context.Background(), e.js, testConfig("setup")); err != nil {
		t.Fatal(err)
	}
	a := request("controls")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	body := []byte(`{}`)
	refused := []map[string]string{
		{"Nats-Rollup": "all"},
		{"Nats-Rollup": "sub"},
		{"Nats-TTL": "1s"},
		{"Nats-Schedule": "@at 2030-01-01T00:00:00Z", "Nats-Schedule-Target": v1.RequestSubject("acme")},
		{"Nats-Incr": "1"},
		{"Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1", "Nats-Batch-Commit": "1"},
		{"Nats-Expected-Stream": "KV_buildq-builds"},
	}
	for _, h := range refused {
		if ack, err := acctPublishRaw(e.js, v1.RequestSubject("mallory"), h, body); err == nil {
			t.Errorf("headers %v: stored (%+v)", h, ack)
		}
	}
	// Stored as an ordinary message of hers (the marker headers are
	// only the server's to act on).
	for _, h := range []map[string]string{{"Nats-Marker-Reason": "Purge"}, {"Nats-Schedule-Rollup": "all"}} {
		_, _ = acctPublishRaw(e.js, v1.RequestSubject("mallory"), h, body)
	}
	st, err := e.js.Stream(context.Background(), v1.RequestsStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(context.Background(), v1.RequestSubject("acme"))
	if err != nil {
		t.Fatalf("acme's request is gone: %v", err)
	}
	if !strings.Contains(string(m.Data), a.RequestID) {
		t.Fatalf("acme's stored request changed: %s", m.Data)
	}
}

// Possession is of content, not of an object: once mallory's own object
// was shown to hold a digest's bytes, replacing or deleting it does not
// take the proof back (for the ledger's TTL). That is acceptable — she
// held the bytes and may have kept them; a proof that lapsed with the
// object would protect nothing — and what she is answered with is still
// a build of those bytes (the run's own source, checked by its build).
func TestPossessionProofOutlivesTheObject(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY y /y\n", "y": "held once"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	built := e.buildThrough(t, tr, results, a, 1)
	m := tenantRequestFor("mallory", digest)
	store.put(m.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	if r := acctResult(t, results, m.RequestID); r.Data.Digest != built.Data.Digest {
		t.Fatalf("mallory, holding the bytes: %s", mustJSON(t, r))
	}
	store.put(m.Source.S3.Key, []byte("not any more"))
	m2 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m2); err != nil {
		t.Fatal(err)
	}
	if r := acctResult(t, results, m2.RequestID); r.Data.Digest != built.Data.Digest {
		t.Fatalf("mallory after replacing her object: %s", mustJSON(t, r))
	}
}
