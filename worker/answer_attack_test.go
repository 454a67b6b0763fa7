package worker

// Attacks on cache hits answered at intake (answer.go, docs/design.md
// §2d): a hostile tenant and odd inputs (ids, TTLs, tags, indexes,
// SBOMs, attestations, a panicking or hung registry). The attacks at the
// worst moments are in answer_faults_test.go. Every test says what it
// attacks and what must hold.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
)

// ---- helpers of this file ----

// atkPutRecord stores rec as its key's build record.
func (e *env) atkPutRecord(t *testing.T, rec v1.BuildRecord) {
	t.Helper()
	ctx := context.Background()
	var kv jetstream.KeyValue
	eventually(t, 5*time.Second, "the builds bucket", func() bool {
		var err error
		kv, err = e.js.KeyValue(ctx, v1.BuildsBucket)
		return err == nil
	})
	b, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, rec.Key, b); err != nil {
		t.Fatal(err)
	}
}

// atkSucceeded is a succeeded record of key whose image repo:<default
// tag> (digest) needs no copy for a request of the key in repo.
func atkSucceeded(key, repo, digest, tenant string) v1.BuildRecord {
	img := repo + ":" + v1.DefaultTag(key)
	now := time.Now().UTC()
	return v1.BuildRecord{Key: key, State: v1.StateSucceeded, Run: "r0", RequestID: "earlier", Seq: 1,
		Tenant: tenant, Name: "web", Repository: repo, Digest: digest, Image: img, Pushed: []string{img},
		Destinations: []string{img}, StartedAt: now, FinishedAt: now}
}

// atkSettled waits until no request message is left anywhere.
func (e *env) atkSettled(t *testing.T, within time.Duration) {
	t.Helper()
	eventually(t, within, "every request message settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
}

// atkEntryDecision is the decision recorded in acme's entry of id ("" when
// there is none).
func (e *env) atkEntryDecision(id string) string {
	le := e.ledgerEntry("acme", id)
	if le == nil || le.Result == nil {
		return ""
	}
	return decision(*le.Result)
}

// atkAttestor attaches nothing and names a referrer of its own per image.
type atkAttestor struct{ attests atomic.Int32 }

func (a *atkAttestor) Attest(_ context.Context, _ Registry, ref string, _ attest.Build) (string, error) {
	a.attests.Add(1)
	return "sha256:" + hex64("atk-attestation "+ref), nil
}

func (a *atkAttestor) Copy(context.Context, Registry, string, string) error { return nil }

// atkHeldHeads is a registry whose HEADs of indexed images (repo@digest)
// wait until released; every other HEAD is not found (no tag is there, so
// a build's preflight goes on). A released HEAD finds the image.
type atkHeldHeads struct {
	release chan struct{}
	entered chan struct{}
	once    sync.Once
	heads   atomic.Int32
}

func newAtkHeldHeads(t *testing.T) *atkHeldHeads {
	h := &atkHeldHeads{release: make(chan struct{}), entered: make(chan struct{})}
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(h.release) }) })
	return h
}

func (h *atkHeldHeads) Head(ctx context.Context, ref string) (string, error) {
	_, digest, ok := strings.Cut(ref, "@")
	if !ok {
		return "", fmt.Errorf("head %s: %w", ref, registry.ErrNotFound)
	}
	h.heads.Add(1)
	h.once.Do(func() { close(h.entered) })
	select {
	case <-h.release:
		return digest, nil
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

func (h *atkHeldHeads) Copy(context.Context, string, string) (string, error) {
	return "", errors.New("copy: not used here")
}
func (h *atkHeldHeads) EnsureHarborProject(context.Context, string, string) error { return nil }
func (h *atkHeldHeads) PushIndex(context.Context, []registry.IndexChild, []string) (string, error) {
	return "", errors.New("push index: not used here")
}

// atkBody is req's body as the SDK encodes it.
func atkBody(t *testing.T, req *v1.Request) []byte {
	t.Helper()
	req.APIVersion = v1.APIVersion
	if req.SubmittedAt.IsZero() {
		req.SubmittedAt = time.Now().UTC()
	}
	if err := req.Validate(); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ---- a panic at intake ----

// Attack (a panic in the registry HEAD of a hit answered at intake kills
// the worker): the handler recovers every panic (safeProcess), and
// checkIndexed carries a panic of the shared HEAD back to its caller so
// that the handler can (TestPanicInTheSharedHeadFailsTheRequestOnce). At
// intake nothing recovers it: answerAtIntake → cacheVerdict → cached →
// checkIndexed re-raises it in intake's goroutine (fairq admit), and the
// whole worker process dies — every request it held with it. The request
// must get one failed/InfrastructureError result, as it does in the
// queue, and the worker must live on. The worker runs in a child process.
func TestAttack_IntakePanicInTheSharedHeadDoesNotKillTheWorker(t *testing.T) {
	if os.Getenv("BUILDQ_ATK_INTAKE_PANIC_CHILD") == "" {
		t.Parallel()
		cmd := exec.Command(os.Args[0], "-test.run=^TestAttack_IntakePanicInTheSharedHeadDoesNotKillTheWorker$", "-test.count=1")
		cmd.Env = append(os.Environ(), "BUILDQ_ATK_INTAKE_PANIC_CHILD=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			s := string(out)
			if i := strings.Index(s, "\npanic: "); i >= 0 {
				s = s[i+1 : min(len(s), i+2500)]
			} else if len(s) > 2500 {
				s = s[len(s)-2500:]
			}
			t.Fatalf("the worker process died on a panic in the registry HEAD of a cache hit answered at intake (%v); "+
				"a handler's panic gives one failed result:\n%s", err, s)
		}
		return
	}
	e := setup(t)
	req := request("atk-intake-panic-head")
	key := v1.BuildKey(req, kanikoID)
	const reg = "registry.test:5000"
	e.startWorker("w1", func(c *Config) {
		c.Registry = panicHead{}
		c.Naming = naming.Policy{Registry: reg}
	})
	results := e.collect()
	// Every destination of the request holds the image: a plain hit,
	// answered at intake.
	e.atkPutRecord(t, atkSucceeded(key, reg+"/acme/web", digestOf("atk-panic-image"), "acme"))
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 1, 20*time.Second)
	if d := got[0].Data; d.Status != v1.StatusFailed || d.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("result %s, want failed/InfrastructureError", decision(d))
	}
}

// ---- the queue TTL ----

// A hit that waited in BUILDQ_REQUESTS past the queue TTL (no worker was
// running) is not answered from the cache at intake: its handler expires
// it, by the server's clock.
func TestAttack_IntakeStaleHitIsExpiredByTheQueue(t *testing.T) {
	t.Parallel()
	atkStaleHit(t, time.Now)
}

// Attack (the queue TTL decided by the worker's clock): intake answers a
// hit unless the worker's clock says the request waited more than half
// its queue TTL (answer.go, cacheVerdict: `w.cfg.Now().Sub(meta.Timestamp)
// > ttl/2`). A worker whose clock runs behind — by any amount over the
// TTL — answers a request that waited past its TTL as a success, where
// the handler, which measures the wait with the server's clock only
// (ttl.go), fails it Expired: "a worker whose clock is off, by any
// amount, neither expires a fresh request nor builds a stale one"
// (ttl.go, docs/design.md §6). The answer depends on which path took it.
func TestAttack_IntakeStaleHitOnAWorkerWithASlowClockIsExpired(t *testing.T) {
	t.Parallel()
	atkStaleHit(t, func() time.Time { return time.Now().Add(-time.Hour) })
}

func atkStaleHit(t *testing.T, now func() time.Time) {
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	first := e.buildThrough(t, tr, results, request("atk-stale"), 1)
	eventually(t, 5*time.Second, "the build's request settled", func() bool {
		le := e.ledgerEntry("acme", first.ID)
		return le != nil && le.Published
	})
	e.atkSettled(t, 5*time.Second)
	w1.stop(t)

	// Stored while no worker runs; taken after its TTL.
	hit := request("atk-stale")
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	e.startWorker("w2", func(c *Config) {
		withRegistry(tr)(c)
		c.QueueTTL = time.Second
		c.Now = now
		// Intake's lookups must not give up on a loaded machine: what
		// intake would answer is the point.
		c.lookupWait = time.Minute
	})
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusFailed || got.Data.Reason != v1.ReasonExpired {
		t.Fatalf("a hit taken %s after it was stored, past its queue TTL of 1s: %s, want failed/Expired (the server's clock decides)",
			"1.5s", decision(got.Data))
	}
}

// ---- the same request id twice ----

// A tenant publishes one request id in two messages at once, with two
// forms of Nats-Msg-Id (so JetStream stores both), both plain hits, and
// a third one later in the bare form: one answer, one published result;
// the others are settled without a result.
func TestAttack_IntakeSameRequestIDInThreeMessagesGetsOneResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ingested := e.ingestCounter(t)
	first := e.buildThrough(t, tr, results, request("atk-same-id"), 1)

	hit := request("atk-same-id")
	hit.RequestID = "atk-same-id-x"
	body := atkBody(t, hit)
	var wg sync.WaitGroup
	for _, id := range []string{v1.RequestMsgID("acme", hit.RequestID, "n1"), v1.MsgID("acme", hit.RequestID)} {
		wg.Go(func() {
			if _, err := publishRaw(e.js, v1.RequestSubject("acme"), map[string]string{v1.MsgIDHeader: id}, body); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Origin != v1.OriginCache || got.Data.Digest != first.Data.Digest {
		t.Fatalf("the id's result %s", decision(got.Data))
	}
	e.atkSettled(t, 10*time.Second)
	if _, err := publishRaw(e.js, v1.RequestSubject("acme"), map[string]string{v1.MsgIDHeader: hit.RequestID}, body); err != nil {
		t.Fatal(err)
	}
	e.atkSettled(t, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	if n := ingested(hit.RequestID); n != 1 {
		t.Errorf("the id's result was published %d times, want once", n)
	}
	if d := e.atkEntryDecision(hit.RequestID); d != decision(got.Data) {
		t.Errorf("the entry holds %q, the result is %q", d, decision(got.Data))
	}
}

// ---- a cancel's mark ----

// A parked request whose entry its tenant canceled is requeued (its
// message carries the entry's requeue token) and is now a plain hit: the
// entry exists, so intake writes nothing and the handler answers it
// canceled — not succeeded from the cache.
func TestAttack_IntakeCanceledRequeuedHitIsAnsweredCanceled(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	e.buildThrough(t, tr, results, request("atk-cancel"), 1)

	hit := request("atk-cancel")
	hit.RequestID = "atk-canceled-parked"
	key := v1.BuildKey(hit, kanikoID)
	const token = "0123456789abcdef0123456789abcdef"
	ctx := context.Background()
	kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	le := v1.RequestEntry{RequestID: hit.RequestID, Tenant: "acme", Name: "web", Key: key, State: v1.RequestStateBuilding,
		Seq: 999999, MsgTime: time.Now().Add(-time.Minute).UTC(), Worker: "w0", UpdatedAt: time.Now().UTC(),
		Canceled: true, RequeueToken: token}
	b, _ := json.Marshal(le)
	if _, err := kv.Create(ctx, RequestIndexKey("acme", hit.RequestID), b); err != nil {
		t.Fatal(err)
	}
	body := atkBody(t, hit)
	if _, err := publishRaw(e.js, v1.RequestSubject("acme"), map[string]string{
		v1.MsgIDHeader:         v1.RequestMsgID("acme", hit.RequestID, "requeue-1"),
		"Buildq-Requeue-Token": token,
	}, body); err != nil {
		t.Fatal(err)
	}
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusCanceled {
		t.Fatalf("a canceled request requeued as a hit: %s, want canceled", decision(got.Data))
	}
}

// ---- NATS failures between the steps ----

// Attack (intake's slots held by hits: one tenant's hits stall every
// tenant's admission): a hit is answered in an intake slot (16 admitting,
// 32 fetched per worker),
// and the answer waits for the registry HEAD of the indexed image —
// unbounded by anything but the shared HEAD's one-minute timeout
// (checkIndexed runs in workCtx; answerAtIntake sets no deadline and no
// per-tenant bound). Mallory, limited to one build slot
// (--tenant-concurrency), sends 40 hits of one image while the registry is
// slow to answer for it: every intake slot waits on that HEAD, and acme's
// request, which needs a build, is not even admitted — before the
// feature, mallory's hits waited in her own queue behind her one slot and
// acme's build started at once. The fair queue's isolation of tenants is
// bypassed by requests that need no build.
func TestAttack_IntakeHitsOnASlowRegistryDoNotStallOtherTenants(t *testing.T) {
	t.Parallel()
	e := setup(t)
	heads := newAtkHeldHeads(t)
	const reg = "registry.test:5000"
	e.startWorker("w1", func(c *Config) {
		c.Registry = heads
		c.Naming = naming.Policy{Registry: reg}
		c.Fair = FairConfig{Concurrency: map[string]int{"mallory": 1}}
	})
	results := e.collect()
	m := mallorys("atk-stall")
	key := v1.BuildKey(m, kanikoID)
	e.atkPutRecord(t, atkSucceeded(key, reg+"/mallory/web", digestOf("atk-stall-image"), "mallory"))
	ctx := context.Background()
	for range 40 {
		if _, err := e.pub.Publish(ctx, mallorys("atk-stall")); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-heads.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no HEAD of mallory's image")
	}
	time.Sleep(300 * time.Millisecond)
	acme := request("atk-stall-acme-build")
	if _, err := e.pub.Publish(ctx, acme); err != nil {
		t.Fatal(err)
	}
	job := kaniko.JobName(v1.BuildKey(acme, kanikoID))
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, job, metav1.GetOptions{}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			msgs, held, _ := e.streamState()
			t.Fatalf("acme's build was not started within 5s while mallory's hits wait on a slow registry HEAD "+
				"(%d HEADs in flight, %d request messages stored, %d held, %d results): intake's slots are all mallory's",
				heads.heads.Load(), msgs, held, len(results.snapshot()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ---- odd inputs ----

// A hit asking for an SBOM is never answered at intake: in a deployment
// that makes none, the queue's handler refuses it — not a success.
func TestAttack_IntakeHitWithSBOMGoesToTheQueue(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	e.buildThrough(t, tr, results, request("atk-sbom"), 1)
	mark := e.markIntake(t, w1)
	hit := request("atk-sbom")
	hit.SBOM = true
	if _, err := e.pub.Publish(context.Background(), hit); err != nil {
		t.Fatal(err)
	}
	got := oneResult(t, results, hit.RequestID)
	if got.Data.Status != v1.StatusFailed || got.Data.Reason != v1.ReasonInvalidRequest || got.Data.Digest != "" {
		t.Fatalf("an SBOM hit in a deployment without SBOMs: %s, want the handler's refusal", decision(got.Data))
	}
	if mark.handedOn(t) != 1 {
		t.Error("the SBOM hit was not handed on to a handler (queued, or taken straight from intake)")
	}
}

// Tags: a hit whose tags the build pushed is answered at intake; one with
// a tag not pushed needs a copy and goes to the queue, which tags it.
func TestAttack_IntakeHitWithANewTagIsCopiedByTheQueue(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	b := request("atk-tags")
	b.Tags = []string{"v1"}
	first := e.buildThrough(t, tr, results, b, 1)

	mark := e.markIntake(t, w1)
	same := request("atk-tags")
	same.Tags = []string{"v1"}
	if _, err := e.pub.Publish(context.Background(), same); err != nil {
		t.Fatal(err)
	}
	if got := oneResult(t, results, same.RequestID); got.Data.Origin != v1.OriginCache || got.Data.Digest != first.Data.Digest {
		t.Fatalf("the hit with the built tags: %s", decision(got.Data))
	}
	if mark.handedOn(t) != 0 {
		t.Error("a hit whose tags the build pushed was handed on to a handler, not answered at intake")
	}
	other := request("atk-tags")
	other.Tags = []string{"v2"}
	if _, err := e.pub.Publish(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	got := oneResult(t, results, other.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Digest != first.Data.Digest {
		t.Fatalf("the hit with a new tag: %s", decision(got.Data))
	}
	if mark.handedOn(t) != 1 {
		t.Error("a hit with a tag to copy was answered at intake")
	}
	repo := strings.SplitN(first.Data.ImageRef, "@", 2)[0]
	if d, err := tr.client.Head(context.Background(), repo+":v2"); err != nil || d != first.Data.Digest {
		t.Errorf("tag v2: %s %v, want %s", d, err, first.Data.Digest)
	}
}

// An index (multi-platform) record is answered at intake with its
// platforms, as the handler answers it.
func TestAttack_IntakeIndexHitCarriesItsPlatforms(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	req := request("atk-index")
	req.Platforms = []string{"linux/amd64", "linux/arm64"}
	key := v1.BuildKey(req, kanikoID)
	repo := tr.host + "/acme/web"
	digest := tr.push(t, repo+":"+v1.DefaultTag(key))
	rec := atkSucceeded(key, repo, digest, "acme")
	rec.Platforms = map[string]string{"linux/amd64": digestOf("atk-amd64"), "linux/arm64": digestOf("atk-arm64")}
	e.atkPutRecord(t, rec)
	mark := e.markIntake(t, w1)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	got := oneResult(t, results, req.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Digest != digest || len(got.Data.Platforms) != 2 ||
		got.Data.Platforms["linux/arm64"] != rec.Platforms["linux/arm64"] {
		t.Fatalf("the index hit: %s", mustJSON(t, got.Data))
	}
	if mark.handedOn(t) != 0 {
		t.Error("a plain index hit was handed on to a handler, not answered at intake")
	}
}

// With an attestor: a hit on another tenant's attested build (a shared
// repository) needs provenance of its own and goes to the queue, which
// attests it for its tenant — never the other tenant's attestation; a
// hit on the tenant's own attested build is answered at intake with it.
func TestAttack_IntakeHitOfAnotherTenantsBuildIsAttestedByTheQueue(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	att := &atkAttestor{}
	w1 := e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.Naming.Allowed = []string{"{registry}/shared/**"}
		c.Attestor = att
	})
	results := e.collect()
	repo := tr.host + "/shared/app"

	theirs := request("atk-attest-foreign")
	theirs.Image = repo
	fkey := v1.BuildKey(theirs, kanikoID)
	frec := atkSucceeded(fkey, repo, tr.push(t, repo+":"+v1.DefaultTag(fkey)), "globex")
	frec.Attestation = "sha256:" + hex64("globex's attestation")
	e.atkPutRecord(t, frec)

	own := request("atk-attest-own")
	own.Image = repo
	okey := v1.BuildKey(own, kanikoID)
	orec := atkSucceeded(okey, repo, tr.push(t, repo+":"+v1.DefaultTag(okey)), "acme")
	orec.Attestation = "sha256:" + hex64("acme's attestation")
	e.atkPutRecord(t, orec)

	mark := e.markIntake(t, w1)
	if _, err := e.pub.Publish(context.Background(), theirs); err != nil {
		t.Fatal(err)
	}
	got := oneResult(t, results, theirs.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Attestation == "" || got.Data.Attestation == frec.Attestation || att.attests.Load() == 0 {
		t.Fatalf("acme's hit on globex's build: %s (attestation %s, %d attested), want an attestation of its own",
			decision(got.Data), got.Data.Attestation, att.attests.Load())
	}
	if mark.handedOn(t) != 1 {
		t.Error("a hit that needs provenance was answered at intake")
	}
	if _, err := e.pub.Publish(context.Background(), own); err != nil {
		t.Fatal(err)
	}
	got = oneResult(t, results, own.RequestID)
	if got.Data.Status != v1.StatusSucceeded || got.Data.Attestation != orec.Attestation {
		t.Fatalf("acme's hit on its own attested build: %s (attestation %s)", decision(got.Data), got.Data.Attestation)
	}
	if mark.handedOn(t) != 1 {
		t.Error("a plain hit on the tenant's own attested build was handed on to a handler, not answered at intake")
	}
}

// ---- a worker stopped mid-answer ----

// atkGatedRegistry is a registry whose next HEAD of an indexed image
// (repo@digest), once armed, waits until released or its caller gives up.
