package worker

// Builder (possession.go): the proof of possession. A tenant's object is
// read once per tenant and content, the read shared by the requests that
// ask at once and cut short by none of them, the proof recorded in the
// ledger; a refusal costs one read and tells nothing (docs/design.md §2b).

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
)

// Possession is of content, not of an object: once mallory's own object
// was shown to hold a digest's bytes, replacing or deleting it does not
// take the proof back (for the ledger's TTL). That is acceptable — she
// held the bytes and may have kept them; a proof that lapsed with the
// object would protect nothing — and what she is answered with is still
// a build of those bytes (the run's own source, checked by its build).
//
// Origin: hostile-tenant review of 98418f0 (issue 23); refused there, kept as a regression test.
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
	if r := oneResult(t, results, m.RequestID); r.Data.Digest != built.Data.Digest {
		t.Fatalf("mallory, holding the bytes: %s", mustJSON(t, r))
	}
	store.put(m.Source.S3.Key, []byte("not any more"))
	m2 := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m2); err != nil {
		t.Fatal(err)
	}
	if r := oneResult(t, results, m2.RequestID); r.Data.Digest != built.Data.Digest {
		t.Fatalf("mallory after replacing her object: %s", mustJSON(t, r))
	}
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
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestPossessionLostBeforeItsRecordIsReadAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newFaultyStore()
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
	if r := oneResult(t, results, g.RequestID); r.Data.Status != v1.StatusSucceeded {
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
		if r := oneResult(t, results, g2.RequestID); r.Data.Status != v1.StatusSucceeded {
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
//
// Origin: second hostile-tenant review, of 26b1795; failed there, fixed by 626123b.
func TestCanceledRequestDoesNotFailItsTenantsSharedPossessionRead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
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
	if r := oneResult(t, results, a1.RequestID); r.Data.Status != v1.StatusCanceled {
		t.Fatalf("a1: %s", mustJSON(t, r))
	}
	store.release()
	r := e.resultPlayingKubelet(results, key, a2.RequestID, 15*time.Second)
	if r == nil || r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("a2: %s", mustJSON(t, r))
	}
	if le := e.ledgerEntry("acme", a2.RequestID); le == nil || le.TransientFailures != 0 {
		t.Fatalf("a2, never canceled and never failing, was failed transiently by a1's cancel: its ledger entry counts %d transient failure(s) "+
			"(retried after a delay, against its --max-deliver budget)", le.TransientFailures)
	}
}

// A worker stopped while many requests of one tenant and content wait on
// one possession read hands them all back; the next worker answers each
// once, with one read and one Job.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestStopDuringASharedPossessionReadLosesNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
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
//
// Origin: second hostile-tenant review, of 26b1795; failed there, fixed by 626123b.
func TestRefusedContextIsNotInflatedAgainAtEveryRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
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
		if r := oneResult(t, results, m.RequestID); r.Data.Reason != v1.ReasonContextMismatch {
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

// A tenant that names a missing object again and again costs the worker
// one S3 GET (a 404) per request, never more, and every refusal is the
// same: same reason and message, the events "queued" and "finished" only
// (no "claimed", "waiting" or "job-created"), no Job — whether or not
// another tenant built the key.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestMissingContextCostsOneReadPerRequestAndRefusesUniformly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newFaultyStore()
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
