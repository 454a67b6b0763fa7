package worker

import (
	"bytes"
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/s3store"
)

// objectStore is a ContextSource whose objects a test sets and whose reads
// it counts.
type objectStore struct {
	mu      sync.Mutex
	objects map[string][]byte
	opens   map[string]int
}

func newObjectStore() *objectStore {
	return &objectStore{objects: map[string][]byte{}, opens: map[string]int{}}
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

// tenantRequestFor is a request of tenant for the context digest, its
// object under the tenant's own prefix.
func tenantRequestFor(tenant, digest string) *v1.Request {
	r := request("possession")
	r.Tenant, r.ContextDigest = tenant, digest
	r.Source.S3.Key = s3store.TenantContextKey(tenant, digest)
	return r
}

// TestForeignBuildNeedsPossession: a tenant is answered from a build
// another tenant's request claimed — a cache hit or a join — only when its
// own context object holds the bytes its contextDigest names; the proof is
// read once and recorded. Issue 23: knowing a digest (results, logs and
// provenance carry them) was enough to have another tenant's image copied
// into one's own repository.
func TestForeignBuildNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	withStore := func(c *Config) { withRegistry(tr)(c); c.Contexts = store }
	w1 := e.startWorker("w1", withStore)
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's"})
	_, other := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "mallory's"})
	store.put(s3store.TenantContextKey("acme", digest), archive)

	acme := tenantRequestFor("acme", digest)
	built := e.buildThrough(t, tr, results, acme, 1)
	if built.Data.Status != v1.StatusSucceeded || built.Data.Origin != v1.OriginBuild {
		t.Fatalf("acme's build: %s", mustJSON(t, built))
	}
	if n := store.reads(acme.Source.S3.Key); n != 1 {
		t.Fatalf("the worker read the claimer's own context %d times, want 1 (every request's tenant shows it holds the content, once)", n)
	}

	refused := func(t *testing.T, r *v1.Request, n int, reason string) {
		t.Helper()
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		got := byID(results.waitFor(t, n, 10*time.Second))[r.RequestID]
		if len(got) != 1 || got[0].Data.Status != v1.StatusFailed || got[0].Data.Reason != reason ||
			got[0].Data.Digest != "" || got[0].Data.Image != "" || got[0].Data.LogTail != "" {
			t.Fatalf("%s's request: %s, want one %s result with nothing of acme's build", r.Tenant, mustJSON(t, got), reason)
		}
		repo, err := name.NewRepository(tr.host+"/"+r.Tenant+"/web", name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if tags, err := remote.List(repo); err == nil && len(tags) > 0 {
			t.Fatalf("acme's image was copied into %s: %v", repo, tags)
		}
	}

	// Mallory knows the digest and holds no such object.
	t.Run("no object", func(t *testing.T) {
		refused(t, tenantRequestFor("mallory", digest), 2, v1.ReasonContextMissing)
	})
	// Mallory puts other bytes under the digest's name.
	t.Run("other bytes", func(t *testing.T) {
		m := tenantRequestFor("mallory", digest)
		store.put(m.Source.S3.Key, other)
		refused(t, m, 3, v1.ReasonContextMismatch)
	})

	// Globex holds the same bytes: answered from the index, its own copy.
	g := tenantRequestFor("globex", digest)
	store.put(g.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, g); err != nil {
		t.Fatal(err)
	}
	gr := byID(results.waitFor(t, 4, 10*time.Second))[g.RequestID]
	if len(gr) != 1 || gr[0].Data.Status != v1.StatusSucceeded || gr[0].Data.Origin != v1.OriginCache ||
		gr[0].Data.Digest != built.Data.Digest || !strings.HasPrefix(gr[0].Data.Image, tr.host+"/globex/") {
		t.Fatalf("globex's request: %s", mustJSON(t, gr))
	}
	if n := store.reads(g.Source.S3.Key); n != 1 {
		t.Fatalf("globex's object read %d times, want 1", n)
	}
	// Shown once: neither this worker nor another one reads it again.
	w1.stop(t)
	e.startWorker("w2", withStore)
	g2 := tenantRequestFor("globex", digest)
	if _, err := e.pub.Publish(ctx, g2); err != nil {
		t.Fatal(err)
	}
	if r := byID(results.waitFor(t, 5, 10*time.Second))[g2.RequestID]; len(r) != 1 || r[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("globex's second request: %s", mustJSON(t, r))
	}
	if n := store.reads(g.Source.S3.Key); n != 1 {
		t.Fatalf("globex's object read %d times after its proof was recorded, want 1", n)
	}
	if c := e.creates.total(); c != 1 {
		t.Fatalf("%d Jobs created, want 1", c)
	}
}

// A request that would join another tenant's build in flight is refused
// at once without the content: it does not park on the run, and gets
// neither the image nor the failure and log tail of the build.
func TestJoiningAForeignBuildNeedsPossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "in flight"})
	acme := tenantRequestFor("acme", digest)
	store.put(acme.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, acme); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(acme, kanikoID)))

	m := tenantRequestFor("mallory", digest)
	if _, err := e.pub.Publish(ctx, m); err != nil {
		t.Fatal(err)
	}
	mr := results.waitFor(t, 1, 10*time.Second)[0]
	if mr.ID != m.RequestID || mr.Data.Reason != v1.ReasonContextMissing {
		t.Fatalf("mallory's join: %s", mustJSON(t, mr))
	}
	e.kubelet(job, 1, "kaniko: acme's secret build output")
	ar := byID(results.waitFor(t, 2, 10*time.Second))
	if len(ar[acme.RequestID]) != 1 || len(ar[m.RequestID]) != 1 {
		t.Fatalf("results %s", mustJSON(t, ar))
	}
}
