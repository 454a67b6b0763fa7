package worker

import (
	"context"
	"encoding/json"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/localexec"
	"github.com/buildq/buildq/internal/s3store"
)

// Attacks of tenant "mallory" on tenant "acme" (issue 10, second round).
// Mallory publishes only on her own subjects (buildq.requests.mallory,
// buildq.api.*.mallory) and reads only hers (buildq.results.mallory.>,
// buildq.events.mallory.>); she controls every byte of her bodies and
// headers and the timing of her requests. Each failed on the code it was
// written against (f94e5fe) and passes since the fix.

// startLocalWorker runs a worker on backend (the local executor) with the
// naming policy and registry of tr.
func (e *env) startLocalWorker(id string, backend Backend, mutate func(*Config)) {
	t := e.t
	t.Helper()
	cfg := testConfig(id)
	cfg.Logger = zaptest.NewLogger(t).Named(id)
	if mutate != nil {
		mutate(&cfg)
	}
	nc, err := nats.Connect(e.srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(nc, backend, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = w.Run(ctx)
		nc.Close()
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// Attack: JetStream dedupes BUILDQ_REQUESTS on Nats-Msg-Id stream-wide, and
// NATS permissions guard subjects, not headers. Mallory publishes anything
// on her own subject with the header "acme/build-42" — the exact
// Nats-Msg-Id acme's publisher will use for its request id "build-42".
// The worker refuses her message as invalid, but JetStream has already
// taken the id: acme's real request, published within the duplicate
// window, is dropped as a duplicate (PubAck.Duplicate) and never gets a
// result. Breaks invariant 8 ("its id ... are its tenant's alone") and
// invariant 1, and docs/design.md §1 ("two tenants' equal ids never drop
// each other's request"). Request ids are caller-chosen (deterministic ids
// such as a commit or a deploy number are what idempotent producers use).
func TestAttackForgedMsgIDHeaderDropsAnotherTenantsRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	m := mallorys("forged-header")
	m.APIVersion, m.RequestID = v1.APIVersion, "whatever"
	body, _ := json.Marshal(m)
	msg := nats.NewMsg(v1.RequestSubject("mallory"))
	msg.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", "build-42"))
	msg.Data = body
	if _, err := e.js.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	// Mallory's message is refused (header and body disagree).
	results.waitFor(t, 1, 10*time.Second)

	a := request("acme-build-42")
	a.RequestID = "build-42"
	ack, err := e.pub.Publish(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	if ack.Duplicate {
		t.Fatalf("acme's request %s was dropped by JetStream as a duplicate of mallory's message (header %s)",
			a.RequestID, v1.MsgID("acme", "build-42"))
	}
	e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(a, kanikoID))), 0, digestOf("acme"))
	got := byID(results.waitFor(t, 2, 10*time.Second))[a.RequestID]
	if len(got) != 1 || got[0].Data.Tenant != "acme" || got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's result: %s", mustJSON(t, got))
	}
}

// Attack: mallory submits the same content as acme's build in flight (the
// key is predictable: public sources, or a digest she knows) and listens on
// her own event subject. The "waiting" event she gets names the request
// that claimed the build: acme's request id. Breaks invariant 8 ("its id
// ... are its tenant's alone"); ids are what JetStream dedupes on, so a
// leaked id also feeds TestAttackForgedMsgIDHeaderDropsAnotherTenantsRequest
// for acme's resubmissions.
func TestAttackJoinEventLeaksTheClaimersRequestID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	events := e.events()
	results := e.collect()

	a := request("leak-id")
	a.RequestID = "acme-secret-request-id"
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	m := mallorys("leak-id")
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "mallory's request to join", func() bool { return events.has(m.RequestID, v1.PhaseWaiting) })
	e.kubelet(job, 0, digestOf("leak-id"))
	results.waitFor(t, 2, 10*time.Second)
	for _, raw := range events.all() {
		if strings.HasPrefix(string(raw), v1.EventsPrefix+".mallory.") && strings.Contains(string(raw), a.RequestID) {
			t.Errorf("mallory's event subject carried acme's request id: %s", raw)
		}
	}
}

// Attack: the request timeout is not in the build key, and the Job of a
// shared build gets the claiming request's timeout. Mallory submits acme's
// (predictable) content first with timeout 10s; acme's request, which
// allows 2h, joins her build and is answered DeadlineExceeded when her
// Job hits its 10s deadline. Mallory decides acme's outcome with an input
// that is not part of the key. Breaks invariant 7 ("a result always
// describes the build of that key") and the brief's "make acme's request
// fail": repeatable for every resubmission, since mallory only has to be
// first.
func TestAttackClaimersShortTimeoutFailsTheJoiner(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	events := e.events()
	results := e.collect()

	m := mallorys("short-timeout")
	m.Timeout = v1.Duration{Duration: v1.MinTimeout}
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(m, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	a := request("short-timeout")
	a.Timeout = v1.Duration{Duration: 2 * time.Hour}
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "acme's request to join or build", func() bool {
		return events.has(a.RequestID, v1.PhaseWaiting) || e.creates.total() > 1
	})
	if d := job.Spec.ActiveDeadlineSeconds; d != nil && *d < int64(a.Timeout.Duration/time.Second) && events.has(a.RequestID, v1.PhaseWaiting) {
		t.Logf("acme (timeout %s) waits on a Job whose deadline is %ds", a.Timeout.Duration, *d)
	}
	// The Job controller ends mallory's Job at its deadline.
	deadlineExceeded(t, e, job)

	// Whatever acme's request does next (build on, with its own deadline),
	// it must not answer DeadlineExceeded from mallory's 10s.
	deadline := time.Now().Add(15 * time.Second)
	played := map[string]bool{job.Name + string(job.UID): true}
	for time.Now().Before(deadline) {
		if rs := byID(results.snapshot())[a.RequestID]; len(rs) > 0 {
			if rs[0].Data.Status != v1.StatusSucceeded {
				t.Fatalf("acme's request (timeout 2h) failed with mallory's 10s deadline: %s", mustJSON(t, rs[0].Data))
			}
			return
		}
		// A new Job for acme (a rebuild): let it succeed.
		jobs, _ := e.kube.BatchV1().Jobs(testNamespace).List(context.Background(), metav1.ListOptions{})
		for i := range jobs.Items {
			j := &jobs.Items[i]
			if !played[j.Name+string(j.UID)] && len(j.Status.Conditions) == 0 {
				played[j.Name+string(j.UID)] = true
				e.kubelet(j, 0, digestOf("acme-own"))
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("acme's request got no result")
}

// deadlineExceeded plays the Job controller ending job at its
// activeDeadlineSeconds.
func deadlineExceeded(t *testing.T, e *env, job *batchv1.Job) {
	t.Helper()
	now := metav1.Now()
	j, err := e.kube.BatchV1().Jobs(job.Namespace).Get(context.Background(), job.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	j.Status.StartTime = &now
	j.Status.Failed = 1
	msg := "Job was active longer than specified deadline"
	j.Status.Conditions = []batchv1.JobCondition{
		{Type: batchv1.JobFailureTarget, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonDeadlineExceeded, Message: msg, LastTransitionTime: now},
		{Type: batchv1.JobFailed, Status: corev1.ConditionTrue, Reason: batchv1.JobReasonDeadlineExceeded, Message: msg, LastTransitionTime: now},
	}
	if _, err := e.kube.BatchV1().Jobs(job.Namespace).UpdateStatus(context.Background(), j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// gatedContexts serves context objects from memory; opening a key listed in
// hold waits until release is closed (S3 latency, which mallory's timing
// stands in for).
type gatedContexts struct {
	objects mapContexts
	hold    map[string]bool
	release chan struct{}
	mu      sync.Mutex
	opened  []string
}

func (g *gatedContexts) Open(ctx context.Context, bucket, key string) (io.ReadCloser, error) {
	g.mu.Lock()
	g.opened = append(g.opened, key)
	g.mu.Unlock()
	if g.hold[key] {
		select {
		case <-g.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return g.objects.Open(ctx, bucket, key)
}

// Attack: the S3 location of a context is not in the build key (only its
// digest is), and a shared build reads the context from the claiming
// request's location. Mallory sends acme's contextDigest (the key is
// predictable) with a source key that does not exist, before acme; acme's
// request joins and is answered failed/ContextMissing although acme's own
// context is in place. (With an object of other bytes the answer is
// ContextMismatch the same way.) Mallory decides acme's outcome with an
// input that is not part of the key. Breaks invariant 7 and 8 ("its answer
// can come only from a build of the same verified content": no build of
// that content happened).
func TestAttackClaimersMissingContextFailsTheJoiner(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's app"})
	acmeKey := s3store.TenantContextKey("acme", digest)
	mallorysKey := s3store.TenantContextKey("mallory", digest) // never uploaded
	contexts := &gatedContexts{objects: mapContexts{acmeKey: tgz}, hold: map[string]bool{mallorysKey: true}, release: make(chan struct{})}
	e.startLocalWorker("w1", NewLocalBackend(contexts, tr.client, t.TempDir(), 0), withRegistry(tr))
	events := e.events()
	results := e.collect()

	m := mallorys("unused")
	m.ContextDigest, m.Source = digest, v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: mallorysKey}}
	m.BuildArgs, m.Labels = nil, nil
	a := request("unused")
	a.ContextDigest, a.Source = digest, v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: acmeKey}}
	a.BuildArgs, a.Labels = nil, nil
	if v1.BuildKey(m, localexec.Identity) != v1.BuildKey(a, localexec.Identity) {
		t.Fatal("test setup: the keys differ")
	}
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "mallory's build to open its context", func() bool {
		contexts.mu.Lock()
		defer contexts.mu.Unlock()
		return len(contexts.opened) > 0
	})
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "acme's request to join", func() bool { return events.has(a.RequestID, v1.PhaseWaiting) })
	close(contexts.release)

	got := byID(results.waitFor(t, 2, 15*time.Second))
	if mr := got[m.RequestID]; len(mr) != 1 || mr[0].Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory's result: %s", mustJSON(t, mr))
	}
	ar := got[a.RequestID]
	if len(ar) != 1 || ar[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's context exists, yet its request got mallory's missing context as its answer: %s", mustJSON(t, ar))
	}
}

// Attack: the local executor reads any object the worker's S3 credentials
// reach — the request's bucket and key are not confined to the tenant's
// prefix (contexts/<tenant>/) — and a digest mismatch quotes the digest the
// object actually holds. Mallory names an object of acme's (any name she
// can guess, e.g. one not named by its digest) with a wrong digest and
// reads the real one from her result's message; resubmitted with that
// digest, acme's context is built into mallory's repository (and the key
// tells her which of acme's builds she may now pull from the shared
// index). Breaks invariant 8 (her answer must hold nothing of acme's) and
// docs/design.md §2b (contexts per tenant).
func TestAttackContextMismatchQuotesAnotherTenantsDigest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's private app"})
	const acmeObject = "contexts/acme/release/latest.tar.gz"
	contexts := mapContexts{acmeObject: tgz}
	e.startLocalWorker("w1", NewLocalBackend(contexts, tr.client, t.TempDir(), 0), withRegistry(tr))
	results := e.collect()

	m := mallorys("probe")
	m.BuildArgs, m.Labels = nil, nil
	m.ContextDigest = "sha256:" + strings.Repeat("0", 64)
	m.Source = v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: acmeObject}}
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if strings.Contains(r.Data.Message+r.Data.LogTail, strings.TrimPrefix(digest, "sha256:")) {
		t.Errorf("mallory's result quotes the digest of acme's object %s: %s", acmeObject, r.Data.Message)
	}
	if r.Data.Status == v1.StatusFailed && r.Data.Reason == v1.ReasonInvalidRequest {
		return // refused before reading: fixed
	}
	// With the digest she read, mallory builds acme's context.
	m2 := mallorys("probe-2")
	m2.BuildArgs, m2.Labels = nil, nil
	m2.ContextDigest, m2.Source = digest, m.Source
	if _, err := e.pub.Publish(context.Background(), m2); err != nil {
		t.Fatal(err)
	}
	r2 := byID(results.waitFor(t, 2, 10*time.Second))[m2.RequestID]
	if len(r2) == 1 && r2[0].Data.Status == v1.StatusSucceeded {
		t.Errorf("mallory built acme's object %s into %s", acmeObject, r2[0].Data.ImageRef)
	}
}

// Attack: the status service hides another tenant's build (same error for
// a key acme built as for a key nobody built), but the cancel service
// answers a bare build key with the state of whatever build holds it:
// "no build is known", "the build already finished: failed", or "no
// request of tenant mallory waits" (building). Mallory learns, for any
// predictable key, whether acme built it, is building it, and whether it
// failed — which the status service refuses her. Breaks invariant 8
// ("status and cancel are its tenant's alone").
func TestAttackCancelRepliesRevealAnotherTenantsBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	a := request("cancel-oracle")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	e.kubelet(e.waitJob(kaniko.JobName(key)), 1, "error building image: secret step failed")
	results.waitFor(t, 1, 10*time.Second)

	unknown := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), hex64("nobody built this"))
	acmes := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), key)
	if acmes.Canceled || acmes.Stopped {
		t.Fatalf("mallory canceled acme's build: %+v", acmes)
	}
	if strings.ReplaceAll(acmes.Message, key, "K") != strings.ReplaceAll(unknown.Message, hex64("nobody built this"), "K") {
		t.Errorf("mallory's cancel tells acme's key from an unknown one:\n  acme's:  %q\n  unknown: %q", acmes.Message, unknown.Message)
	}
}

// A run taken over builds its claimer's inputs (runRequest). When it fails
// for a reason of those inputs — here mallory's context object is gone —
// the request that took it over, whose own context is another object, is
// not answered with that failure: it builds with its own inputs, as a
// joiner of the run would (sharedFailure). Found by an adversarial review.
func TestTakerIsNotAnsweredWithTheClaimersOwnFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.Lease = time.Second })
	events := e.events()
	results := e.collect()
	m := mallorys("takeover-missing")
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(m, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	a := request("takeover-missing")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "acme to join", func() bool { return events.has(a.RequestID, v1.PhaseWaiting) })
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), key); !rep.Canceled || rep.Stopped {
		t.Fatalf("cancel: %+v", rep)
	}
	results.waitFor(t, 1, 10*time.Second)
	eventually(t, 10*time.Second, "the take-over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Owner != "" && r.Tenant == "mallory"
	})
	e.kubelet(job, 1, "error retrieving context: NoSuchKey: contexts/mallory/... does not exist")
	// acme builds with its own context: a second Job, which succeeds.
	eventually(t, 15*time.Second, "acme's own build", func() bool { return e.creates.total() == 2 })
	e.kubelet(e.waitJob(kaniko.JobName(key)), 0, digestOf("takeover-missing"))
	ar := byID(results.waitFor(t, 2, 15*time.Second))[a.RequestID]
	if len(ar) != 1 || ar[0].Data.Status != v1.StatusSucceeded || strings.Contains(ar[0].Data.LogTail, "mallory") {
		t.Fatalf("acme, whose own context exists: %s", mustJSON(t, ar))
	}
}
