package worker

// Parking (park.go) and the builder (build.go): a failure is shared only
// when it is the key's. A request that joined or took over another
// request's run is never answered with a failure of that request's own
// inputs — its timeout, its context object, its credentials — but builds
// with its own (docs/design.md §2c, sharedFailure).

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/localexec"
	"github.com/buildq/buildq/internal/s3store"
)

// Attack: the request timeout is not in the build key, and the Job of a
// shared build gets the claiming request's timeout. Mallory submits acme's
// (predictable) content first with timeout 10s; acme's request, which
// allows 2h, joins her build and is answered DeadlineExceeded when her
// Job hits its 10s deadline. Mallory decides acme's outcome with an input
// that is not part of the key. Breaks invariant 7 ("a result always
// describes the build of that key") and the brief's "make acme's request
// fail": repeatable for every resubmission, since mallory only has to be
// first.
//
// Origin: issue 10, second round of the hostile-tenant review; failed on f94e5fe, fixed by 1630b78.
func TestClaimersShortTimeoutDoesNotFailTheJoiner(t *testing.T) {
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
//
// Origin: issue 10, second round of the hostile-tenant review; failed on f94e5fe, fixed by 1630b78.
func TestClaimersMissingContextDoesNotFailTheJoiner(t *testing.T) {
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
// family of TestClaimersMissingContextDoesNotFailTheJoiner.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); failed there, fixed by 26b1795.
func TestClaimersCredentialFailureDoesNotFailTheJoiner(t *testing.T) {
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
	eventually(t, 10*time.Second, "acme's request parked on mallory's run", func() bool { return e.parkedAs(key, "acme", a.RequestID) })
	e.kubelet(j1, 1, "error building image: unable to complete operation after 0 attempts, last error: GET https://index.docker.io/v2/library/alpine/manifests/3.20: TOOMANYREQUESTS: You have reached your pull rate limit as 'mallory-ci': dckr_jti_x. You may increase the limit by upgrading.")
	if r := oneResult(t, results, m.RequestID); r.Data.Status != v1.StatusFailed {
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
	if ar := oneResult(t, results, a.RequestID); ar.Data.Status != v1.StatusSucceeded {
		t.Errorf("acme's request was answered with the failure of mallory's credentials: %s", mustJSON(t, ar.Data))
	}
}

// A run taken over builds its claimer's inputs (runRequest). When it fails
// for a reason of those inputs — here mallory's context object is gone —
// the request that took it over, whose own context is another object, is
// not answered with that failure: it builds with its own inputs, as a
// joiner of the run would (sharedFailure). Found by an adversarial review.
//
// Origin: second adversarial review of take-over and context faults (a177267).
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
