package worker

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// Second adversarial pass on the account-per-tenant and possession commit
// (26b1795): a worker stopped or failing at the worst moment around the new
// code, and a hostile tenant ("mallory") against the fixes of the first
// pass (attack_accounts_test.go). Tests whose name says "Attack"
// demonstrate a break and fail on 26b1795; the others are attacks that are
// handled and stay as regression tests.

// ---- helpers ----

// acct2Store is an objectStore whose Open can be gated (blocks until
// released or its caller gives up, as an S3 GET does), made to panic once,
// and whose bytes read are counted.
type acct2Store struct {
	*objectStore
	mu        sync.Mutex
	gate      chan struct{} // nil: open
	entered   chan struct{} // closed at the first Open while gated
	enterOnce sync.Once
	panicOnce atomic.Bool
	bytesRead atomic.Int64
}

func newAcct2Store() *acct2Store {
	return &acct2Store{objectStore: newObjectStore(), entered: make(chan struct{})}
}

func (s *acct2Store) hold() {
	s.mu.Lock()
	s.gate = make(chan struct{})
	s.mu.Unlock()
}

func (s *acct2Store) release() {
	s.mu.Lock()
	if s.gate != nil {
		close(s.gate)
		s.gate = nil
	}
	s.mu.Unlock()
}

func (s *acct2Store) Open(ctx context.Context, bucket, key string) (io.ReadCloser, error) {
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

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	return n, err
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

// acct2Answer waits up to timeout for id's result, playing a successful
// kubelet for the Job of key if one is created meanwhile; nil when neither
// came.
func (e *env) acct2Answer(results *resultCollector, key, id string, timeout time.Duration) *v1.Result {
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

// gzipBomb is a gzip stream of n zero bytes: about n/1000 bytes.
func gzipBomb(t *testing.T, n int64) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(zw, zeroReader{}, n); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// ---- breaks ----

// Attack (a panic in the shared possession check wedges a tenant's
// content on the worker): checkPossession registers its read in
// possessions.inFlight (possession.go:121-126), runs provePossession
// (:128), and only then removes the entry and closes its done channel
// (:129-138). A panic in
// between — the S3 client, the archive verifier — skips both: the panic
// itself is recovered by safeProcess (that request gets one failed
// result), but the entry stays, and every later request of that tenant
// and digest on this worker waits on a done channel nobody will close
// (possession.go:112-119): no result, its slot held, its message
// heartbeaten (never redelivered elsewhere), until the worker stops. The
// registry HEAD, shared the same way, carries a panic to its callers
// (checkIndexed): the shared possession read must not do worse. Breaks
// invariant 1 (every accepted request gets its result).
func TestAttackPossessionPanicWedgesTheTenantsLaterRequests(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	rw := e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a /a\n", "a": "acme"})
	a1 := tenantRequestFor("acme", digest)
	store.put(a1.Source.S3.Key, archive)
	key := v1.BuildKey(a1, kanikoID)

	store.panicOnce.Store(true)
	if _, err := e.pub.Publish(ctx, a1); err != nil {
		t.Fatal(err)
	}
	if r := acctResult(t, results, a1.RequestID); r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInfrastructureError {
		t.Fatalf("the request whose check panicked: %s", mustJSON(t, r))
	}
	// The store works again. A later request of the same tenant and
	// content must be handled.
	a2 := tenantRequestFor("acme", digest)
	if _, err := e.pub.Publish(ctx, a2); err != nil {
		t.Fatal(err)
	}
	if r := e.acct2Answer(results, key, a2.RequestID, 10*time.Second); r == nil || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("a later request of acme for the same content got %s within 10s: "+
			"%d handler(s) wait on a possession read (its slot held, its message heartbeaten)",
			mustJSON(t, r), goroutinesIn(rw.w, "checkPossession", "provePossession"))
	}
}

// Attack (one request's cancel fails its tenant's other requests): the
// possession read of a tenant and digest is shared by the requests that
// ask at once, and runs on the first one's context (possession.go:128,
// provePossession(ctx, …)). When that request is canceled (its tenant's
// cancel, or its handler otherwise ends), the S3 read fails with the
// context's error, which provePossession wraps as Transient (:158-159 or
// :169-170), and every request waiting on the read gets that error
// (:115-116, c.err): they are Nak'd
// with a retry delay and the failure is counted against their
// --max-deliver budget, although nothing failed for them. The registry
// HEAD shared the same way runs apart from any one caller's context so
// that "a caller that gives up does not fail the others" (checkIndexed);
// the possession read does not.
func TestAttackCanceledRequestFailsItsTenantsSharedPossessionRead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	rw := e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY b /b\n", "b": "acme's big context"})
	a1 := tenantRequestFor("acme", digest)
	store.put(a1.Source.S3.Key, archive)
	key := v1.BuildKey(a1, kanikoID)

	store.hold() // a slow S3 GET
	if _, err := e.pub.Publish(ctx, a1); err != nil {
		t.Fatal(err)
	}
	select {
	case <-store.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("a1's possession read never started")
	}
	a2 := tenantRequestFor("acme", digest)
	if _, err := e.pub.Publish(ctx, a2); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "a2 waiting on a1's possession read", func() bool {
		return goroutinesIn(rw.w, "checkPossession", "provePossession") >= 1
	})

	// acme cancels a1 (it changed its mind); a2 is not canceled.
	m, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), a1.RequestID, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var cr v1.CancelReply
	if err := json.Unmarshal(m.Data, &cr); err != nil || !cr.Canceled {
		t.Fatalf("cancel a1: %s", m.Data)
	}
	if r := acctResult(t, results, a1.RequestID); r.Data.Status != v1.StatusCanceled {
		t.Fatalf("a1: %s", mustJSON(t, r))
	}
	store.release()
	r := e.acct2Answer(results, key, a2.RequestID, 15*time.Second)
	if r == nil || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("a2: %s", mustJSON(t, r))
	}
	if le := e.acctLedger("acme", a2.RequestID); le == nil || le.TransientFailures != 0 {
		t.Fatalf("a2, never canceled and never failing, was failed transiently by a1's cancel: its ledger entry counts %d transient failure(s) "+
			"(retried after a delay, against its --max-deliver budget)", le.TransientFailures)
	}
}

// Attack (work per refused request): a tenant names its own context object
// and a digest it does not hold. The object is a gzip stream of zeros:
// about a thousandth of what it inflates to. possession.go reads it and
// inflates and hashes up to MaxContextBytes + 64 MiB of it
// (possession.go:162, contexttar.VerifyArchive) before refusing — and
// remembers only successes (possessions.known, :131-136), so every further request for the same
// tenant, digest and unchanged object does it all again. design.md §2b:
// "the object is read once per tenant and digest". With the worker's
// default MaxContextBytes (1 GiB; `buildq worker` has no flag for it) one
// 1.1 MB object costs ≈1.07 GiB of inflate and SHA-256 on the worker per
// request (≈1.3 s of one core on the review machine), in the worker's
// own process, shared by every tenant, where before possession the same
// bytes were checked by the tenant's own build Pod. Here MaxContextBytes
// is 1 MiB to keep the test fast; the ratio is the same.
func TestAttackRefusedContextIsInflatedAgainAtEveryRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	const maxBytes = 1 << 20
	e.startWorker("w1", func(c *Config) { c.Contexts = store; c.MaxContextBytes = maxBytes })
	results := e.collect()
	ctx := context.Background()

	bomb := gzipBomb(t, maxBytes+64<<20+1)
	digest := digestOf("a digest mallory does not hold")
	object := s3store.TenantContextKey("mallory", digest)
	store.put(object, bomb)

	const n = 4
	start := time.Now()
	for i := range n {
		m := tenantRequestFor("mallory", digest)
		if _, err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		if r := acctResult(t, results, m.RequestID); r.Data.Reason != v1.ReasonContextMismatch {
			t.Fatalf("request %d: %s", i, mustJSON(t, r))
		}
	}
	elapsed := time.Since(start)
	reads, compressed := store.reads(object), store.bytesRead.Load()
	t.Logf("%d refused requests: %d reads of a %d-byte object, %d compressed bytes read, ≈%d MiB inflated and hashed, in %s",
		n, reads, len(bomb), compressed, int64(reads)*(maxBytes+64<<20)>>20, elapsed)
	// At most one full read (and inflation) of the object in all: a
	// refusal remembered for the object as it is, or an inflation that
	// stops early, would both do.
	if compressed > int64(len(bomb)) {
		t.Errorf("the same unchanged %d-byte object was read, inflated (≈%d MiB each time) and hashed %d times for %d requests of one tenant and digest; "+
			"a refusal is not remembered, so each request a tenant sends costs the worker a full verification",
			len(bomb), (maxBytes+64<<20)>>20, reads, n)
	}
}

// Attack (--context-prefix "" on a multi-tenant worker): with an empty
// ContextPrefix a request may name any object, so the possession check
// read whatever object mallory named — acme's own, whose key is
// contexts/acme/sha256/<digest>.tar.gz, known from the digest — and took
// acme's bytes as mallory's proof: she was answered from acme's build,
// and a build of her own built acme's object. A worker that checks
// possession now refuses to be made without a prefix of the tenant's
// (Config.Validate), and `buildq worker` refuses --context-prefix ""
// without --single-tenant (TestAttackWorkerAcceptsAnyContextObjectWithoutSingleTenant).
func TestAttackEmptyContextPrefixProvesPossessionWithAnotherTenantsObject(t *testing.T) {
	t.Parallel()
	cfg := testConfig("w1")
	cfg.Contexts, cfg.ContextPrefix = newAcct2Store(), ""
	if _, err := New(nil, nil, cfg); err == nil || !strings.Contains(err.Error(), "context prefix") {
		t.Fatalf("a worker that checks possession with an empty context prefix: New() = %v; want it refused", err)
	}
}

// ---- handled: regression tests ----

// A tenant that names a missing object again and again costs the worker
// one S3 GET (a 404) per request, never more, and every refusal is the
// same: same reason and message, the events "queued" and "finished" only
// (no "claimed", "waiting" or "job-created"), no Job — whether or not
// another tenant built the key.
func TestMissingContextCostsOneReadPerRequestAndRefusesUniformly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newAcct2Store()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	events := e.events()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY m /m\n", "m": "built by acme"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	e.buildThrough(t, tr, results, a, 1)
	jobs := e.creates.total()

	never := digestOf("nobody built this")
	const n = 40
	var ids []string
	for i := range n {
		d := digest
		if i%2 == 1 {
			d = never
		}
		m := tenantRequestFor("mallory", d)
		if _, err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, m.RequestID)
	}
	results.waitFor(t, 1+n, 30*time.Second)
	time.Sleep(100 * time.Millisecond) // the last events
	reads := store.reads(s3store.TenantContextKey("mallory", digest)) + store.reads(s3store.TenantContextKey("mallory", never))
	t.Logf("%d requests naming a missing object: %d S3 GETs", n, reads)
	if reads > n {
		t.Errorf("%d S3 GETs for %d requests", reads, n)
	}
	got := byID(results.snapshot())
	want := ""
	for i, id := range ids {
		rs := got[id]
		if len(rs) != 1 || rs[0].Data.Reason != v1.ReasonContextMissing || rs[0].Data.Digest != "" || rs[0].Data.Job != "" {
			t.Fatalf("request %d: %s", i, mustJSON(t, rs))
		}
		d := digest
		if i%2 == 1 {
			d = never
		}
		var phases []string
		events.mu.Lock()
		for _, ev := range events.events {
			if ev.RequestID == id {
				phases = append(phases, string(ev.Phase))
			}
		}
		events.mu.Unlock()
		f := rs[0].Data.Reason + " | " + strings.ReplaceAll(rs[0].Data.Message, strings.TrimPrefix(d, "sha256:"), "<d>") + " | " + strings.Join(phases, ",")
		if want == "" {
			want = f
		}
		if f != want {
			t.Fatalf("refusals differ:\n  %s\n  %s", want, f)
		}
	}
	if !strings.HasSuffix(want, "| queued,finished") {
		t.Errorf("a refused request's events: %s", want)
	}
	if c := e.creates.total(); c != jobs {
		t.Errorf("%d Jobs created for refused requests", c-jobs)
	}
}

// Status and cancel of a build key answer mallory the same whether acme's
// build of it runs, or nobody ever built it; neither stops acme's build.
func TestForeignKeyStatusAndCancelTellNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY k /k\n", "k": "running"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	unknown := hex64("a key nobody built")
	ask := func(subject, target string) string {
		t.Helper()
		m, err := tenantAPIRequest(e.nc, "mallory", subject, target, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return strings.ReplaceAll(string(m.Data), target, "<key>")
	}
	for _, subject := range []string{v1.APIStatusSubject("mallory"), v1.APICancelSubject("mallory"), v1.CancelSubject("mallory", "web")} {
		running, none := ask(subject, key), ask(subject, unknown)
		if running != none {
			t.Errorf("%s: acme's running key %s, a key nobody built %s", subject, running, none)
		}
		// acme's request id is mallory's unknown id.
		if byAcmeID, unknownID := ask(subject, a.RequestID), ask(subject, "no-such-id-0"); strings.ReplaceAll(byAcmeID, "<key>", "x") != strings.ReplaceAll(unknownID, "<key>", "x") {
			t.Errorf("%s: acme's request id %s, an unknown id %s", subject, byAcmeID, unknownID)
		}
	}
	if rec := e.claim(key); rec == nil || rec.State != v1.StateBuilding {
		t.Fatalf("acme's build after mallory's cancels: %+v", rec)
	}
	e.kubelet(job, 0, digestOf("acme built"))
	if r := acctResult(t, results, a.RequestID); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme: %s", mustJSON(t, r))
	}
}

// A source with both s3 and git, or an s3 source without a contextDigest,
// is InvalidRequest before any possession read, claim or Job.
func TestMalformedSourcesNeverReachPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()

	both := tenantRequestFor("mallory", digestOf("both"))
	both.APIVersion, both.RequestID = v1.APIVersion, "both-sources"
	both.Source.Git = &v1.GitSource{URL: "https://git.example.com/acme/private.git", Commit: strings.Repeat("cd", 20)}
	noDigest := tenantRequestFor("mallory", digestOf("no digest"))
	noDigest.APIVersion, noDigest.RequestID, noDigest.ContextDigest = v1.APIVersion, "no-digest", ""
	for _, r := range []*v1.Request{both, noDigest} {
		body, _ := json.Marshal(r)
		if _, err := acctPublishRaw(e.js, v1.RequestSubject("mallory"), map[string]string{v1.MsgIDHeader: v1.MsgID("mallory", r.RequestID)}, body); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"both-sources", "no-digest"} {
		if r := acctResult(t, results, id); r.Data.Reason != v1.ReasonInvalidRequest {
			t.Errorf("%s: %s", id, mustJSON(t, r))
		}
	}
	store.mu.Lock()
	opened := len(store.opens)
	store.mu.Unlock()
	if opened != 0 || e.creates.total() != 0 {
		t.Fatalf("%d objects opened, %d Jobs", opened, e.creates.total())
	}
}

// Keys that name a tenant (KeyIdentity) never equal another tenant's, nor
// a key without a tenant, for the same inputs or for the other source
// kind: per-tenant scoping cannot make one tenant's request share, or
// answer, another's build.
func TestTenantScopedKeysNeverMeet(t *testing.T) {
	t.Parallel()
	s3req := func(tenant string) *v1.Request { return tenantRequestFor(tenant, digestOf("same")) }
	gitReq := func(tenant string) *v1.Request {
		r := tenantRequestFor(tenant, "")
		r.Source = v1.Source{Git: &v1.GitSource{URL: "https://git.example.com/x.git", Commit: strings.Repeat("ab", 20)}}
		return r
	}
	seen := map[string]string{}
	for _, tenant := range []string{"acme", "mallory", "acme-mallory", "a"} {
		for _, c := range []struct {
			name string
			r    *v1.Request
		}{{"s3", s3req(tenant)}, {"git", gitReq(tenant)}} {
			for _, pt := range []bool{false, true} {
				for _, checked := range []bool{false, true} {
					id := KeyIdentity(kanikoID, c.r, pt, checked)
					k := v1.BuildKey(c.r, id)
					what := fmt.Sprintf("%s %s perTenantCache=%v checked=%v", tenant, c.name, pt, checked)
					scoped := strings.Contains(id, "+tenant=")
					if want := pt || (checked && c.name == "git"); scoped != want {
						t.Errorf("%s: identity %q", what, id)
					}
					if prev, ok := seen[k]; ok && scoped && !strings.HasPrefix(prev, tenant+" "+c.name) {
						t.Errorf("%s and %s share key %s", prev, what, k)
					}
					if _, ok := seen[k]; !ok {
						seen[k] = what
					}
				}
			}
		}
	}
}

// A parked request whose park re-check finds a new run — another
// tenant's, whose content its own tenant holds (shown before) — parks on
// that run and is answered from it once, also when the worker running it
// stops at that moment and another takes over.
func TestParkRecheckOnANewForeignRunAcrossAWorkerStop(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newAcct2Store()
	pause := newAcctPause(t, ".(*parking).park")
	w1 := e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store; c.Now = pause.now })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY p /p\n", "p": "shared"})
	a1, a2, g := tenantRequestFor("acme", digest), tenantRequestFor("acme", digest), tenantRequestFor("globex", digest)
	store.put(a1.Source.S3.Key, archive)
	store.put(g.Source.S3.Key, archive)
	key := v1.BuildKey(a1, kanikoID)

	if _, err := e.pub.Publish(ctx, a1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(kaniko.JobName(key))
	r1 := e.claim(key)
	// a2 reads a1's run r1 and stops just before parking on it.
	pause.armed.Store(true)
	if _, err := e.pub.Publish(ctx, a2); err != nil {
		t.Fatal(err)
	}
	pause.waitEntered(t)
	// acme cancels a1: nobody else waits, so r1 is stopped.
	if _, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), a1.RequestID, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if r := acctResult(t, results, a1.RequestID); r.Data.Status != v1.StatusCanceled {
		t.Fatalf("a1: %s", mustJSON(t, r))
	}
	// globex claims the key: run r2, globex's.
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	var r2 *v1.BuildRecord
	eventually(t, 10*time.Second, "globex's run", func() bool {
		r2 = e.claim(key)
		return r2 != nil && r2.State == v1.StateBuilding && r2.Tenant == "globex" && r2.Run != r1.Run
	})
	j2 := e.acctRunJob(key, r2.Run)
	pause.open()
	eventually(t, 10*time.Second, "a2 parked on globex's run", func() bool {
		kv, err := e.js.KeyValue(ctx, v1.RequestsBucket)
		if err != nil {
			return false
		}
		ent, err := kv.Get(ctx, ledger.WaiterKey(key, "acme", a2.RequestID))
		if err != nil {
			return false
		}
		v, ok := ledger.ParseWaiter(ent.Value())
		return ok && v.Parked && v.Run == r2.Run
	})
	// w1 stops now; w2 goes on.
	w1.stop(t)
	e.startWorker("w2", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	e.kubelet(j2, 0, tr.push(t, destination(j2)))
	gr := acctResult(t, results, g.RequestID)
	ar := acctResult(t, results, a2.RequestID)
	if gr.Data.Status != v1.StatusSucceeded || ar.Data.Status != v1.StatusSucceeded || ar.Data.Digest != gr.Data.Digest {
		t.Fatalf("globex %s\nacme %s", mustJSON(t, gr.Data), mustJSON(t, ar.Data))
	}
	if tags := acctTags(t, tr, "acme"); len(tags) == 0 {
		t.Fatal("nothing copied into acme's repository")
	}
	time.Sleep(200 * time.Millisecond)
	for _, id := range []string{a1.RequestID, a2.RequestID} {
		if n := results.publishes(id); n != 1 {
			t.Errorf("%s published %d times", id, n)
		}
	}
}

// A requeue published twice for one waiter revision (two requeuers, or a
// retry after a lost PubAck) is one message: the second publish is a
// duplicate, the request is handled once and answered once.
func TestDuplicateRequeueIsOneRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	rw := e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY q /q\n", "q": "requeued"})
	owner, parked := tenantRequestFor("acme", digest), tenantRequestFor("acme", digest)
	store.put(owner.Source.S3.Key, archive)
	key := v1.BuildKey(owner, kanikoID)
	if _, err := e.pub.Publish(ctx, owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	if _, err := e.pub.Publish(ctx, parked); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "parked", func() bool { return e.acctParked(key, "acme", parked.RequestID) })
	items, err := rw.w.ledger.ListWaiters(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var it *ledger.WaiterItem
	for i := range items[key] {
		if items[key][i].V.RequestID == parked.RequestID {
			it = &items[key][i]
		}
	}
	if it == nil {
		t.Fatal("no waiter entry")
	}
	// Two requeuers of the same revision: one message id.
	id := requeueMsgID(it.V, it.Rev)
	var dups atomic.Int32
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			m := newRequeueMsg(it.V, id)
			ack, err := e.js.PublishMsg(ctx, m)
			if err != nil {
				t.Error(err)
				return
			}
			if ack.Duplicate {
				dups.Add(1)
			}
		})
	}
	wg.Wait()
	if dups.Load() != 1 {
		t.Fatalf("%d of 2 publishes of one requeue id were duplicates, want 1", dups.Load())
	}
	e.kubelet(job, 0, digestOf("requeue"))
	if r := acctResult(t, results, parked.RequestID); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("parked: %s", mustJSON(t, r))
	}
	time.Sleep(300 * time.Millisecond)
	if n := results.publishes(parked.RequestID); n != 1 {
		t.Fatalf("the requeued request was published %d times", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Fatalf("%d Jobs", c)
	}
}

// newRequeueMsg is the message requeue publishes for p under id.
func newRequeueMsg(p ledger.Waiter, id string) *nats.Msg {
	m := nats.NewMsg(p.Subject)
	m.Data = p.Body
	m.Header.Set(v1.MsgIDHeader, id)
	m.Header.Set(ledger.RequeueTokenHeader, p.Token)
	return m
}

// noProofKV loses every write of a possession proof (the worker stopped,
// or NATS went away, between the verification and its record).
type noProofKV struct {
	jetstream.KeyValue
	lost atomic.Int32
}

func (k *noProofKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	if strings.HasPrefix(key, "p.") {
		k.lost.Add(1)
		return 0, nats.ErrTimeout
	}
	return k.KeyValue.Create(ctx, key, value, opts...)
}

// A possession shown but never recorded (lost between the verification
// and its record) is shown again by the next worker, never assumed; once
// recorded, it is not read again.
func TestPossessionLostBeforeItsRecordIsReadAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newAcct2Store()
	lossy := &noProofKV{}
	w1 := e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store }, nil, func(w *Worker) {
		lossy.KeyValue = w.ledger.Bucket()
		w.ledger.UseBucket(lossy)
	})
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY r /r\n", "r": "recorded?"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	e.buildThrough(t, tr, results, a, 1)
	g := tenantRequestFor("globex", digest)
	store.put(g.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	if r := acctResult(t, results, g.RequestID); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("globex: %s", mustJSON(t, r))
	}
	if lossy.lost.Load() != 2 {
		t.Fatalf("%d proofs lost", lossy.lost.Load())
	}
	w1.stop(t)
	// w2: no proof in the ledger, none in its memory: globex's object is
	// read again, and the proof recorded.
	w2 := e.startWorker("w2", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	for i, want := range []int{2, 2} {
		g2 := tenantRequestFor("globex", digest)
		if _, err := e.pub.Publish(ctx, g2); err != nil {
			t.Fatal(err)
		}
		if r := acctResult(t, results, g2.RequestID); r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("globex again: %s", mustJSON(t, r))
		}
		if n := store.reads(g.Source.S3.Key); n != want {
			t.Fatalf("request %d: globex's object read %d times, want %d", i, n, want)
		}
		if i == 0 {
			w2.stop(t)
			e.startWorker("w3", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
		}
	}
}

// A worker stopped while many requests of one tenant and content wait on
// one possession read hands them all back; the next worker answers each
// once, with one read and one Job.
func TestStopDuringASharedPossessionReadLosesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newAcct2Store()
	w1 := e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY s /s\n", "s": "many"})
	var reqs []*v1.Request
	for range 5 {
		r := tenantRequestFor("acme", digest)
		reqs = append(reqs, r)
	}
	store.put(reqs[0].Source.S3.Key, archive)
	key := v1.BuildKey(reqs[0], kanikoID)
	store.hold()
	for _, r := range reqs {
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "five requests on one possession read", func() bool {
		return goroutinesIn(w1.w, "checkPossession", "") == 5 && goroutinesIn(w1.w, "provePossession", "") == 1
	})
	w1.stop(t)
	if got := results.snapshot(); len(got) != 0 {
		t.Fatalf("results at the stop: %s", mustJSON(t, got))
	}
	store.release()
	e.startWorker("w2", func(c *Config) { c.Contexts = store })
	job := e.waitJob(kaniko.JobName(key))
	e.kubelet(job, 0, digestOf("many"))
	got := byID(results.waitFor(t, 5, 15*time.Second))
	for _, r := range reqs {
		if rs := got[r.RequestID]; len(rs) != 1 || rs[0].Data.Status != v1.StatusSucceeded {
			t.Fatalf("%s: %s", r.RequestID, mustJSON(t, rs))
		}
	}
	// The read cut short by the stop never got the object; the next
	// worker reads it once for all five.
	if n := store.reads(reqs[0].Source.S3.Key); n != 1 {
		t.Errorf("acme's object read %d times, want 1", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d Jobs", c)
	}
}
