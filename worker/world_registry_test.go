package worker

// The test world's registry: go-containerregistry's in-memory registry,
// over plain HTTP on loopback (the harness, the simulation) or over TLS
// under a name of its own (the scale benchmark, whose workers reach it as
// a production registry: world_registry_tls_test.go), with the worker's
// client for it.

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"

	"github.com/buildq/buildq/internal/registry"
)

// testRegistry is the in-memory registry behind a switch that makes
// manifest requests fail, and the worker's client for it.
type testRegistry struct {
	host   string // in image references
	addr   string // where it listens
	client *registry.Client
	fail   atomic.Bool
	srv    *httptest.Server // closed with the test, or sooner
	// heads, when set, holds every manifest HEAD (a tag's check) until
	// it is closed; held counts the HEADs that waited on it.
	// A push by the test itself (push) is never held.
	heads   atomic.Pointer[chan struct{}]
	held    atomic.Int32
	pushing atomic.Int32
}

// holdHeads makes manifest HEADs wait until the returned release is
// called.
func (tr *testRegistry) holdHeads() (release func()) {
	ch := make(chan struct{})
	tr.heads.Store(&ch)
	var once sync.Once
	return func() {
		once.Do(func() {
			tr.heads.Store(nil)
			close(ch)
		})
	}
}

func (tr *testRegistry) handler() http.Handler {
	inner := ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tr.fail.Load() && strings.Contains(r.URL.Path, "/manifests/") {
			http.Error(w, "registry down", http.StatusInternalServerError)
			return
		}
		if ch := tr.heads.Load(); ch != nil && tr.pushing.Load() == 0 && r.Method == http.MethodHead && strings.Contains(r.URL.Path, "/manifests/") {
			tr.held.Add(1)
			select {
			case <-*ch:
			case <-r.Context().Done():
				return
			}
		}
		inner.ServeHTTP(w, r)
	})
}

// newTestRegistry serves a registry over HTTP on loopback.
func newTestRegistry(t *testing.T) *testRegistry {
	t.Helper()
	tr := &testRegistry{}
	srv := httptest.NewServer(tr.handler())
	t.Cleanup(srv.Close)
	tr.srv = srv
	tr.host = strings.TrimPrefix(srv.URL, "http://")
	tr.addr = tr.host
	c, err := registry.New(registry.Options{Insecure: []string{tr.host}})
	if err != nil {
		t.Fatal(err)
	}
	tr.client = c
	return tr
}

// push stores a random image under ref and returns its digest, as kaniko
// would have.
func (tr *testRegistry) push(t *testing.T, ref string) string {
	t.Helper()
	img, err := random.Image(256, 1)
	if err != nil {
		t.Fatal(err)
	}
	tr.pushing.Add(1)
	defer tr.pushing.Add(-1)
	d, err := tr.client.Push(context.Background(), img, []string{ref})
	if err != nil {
		t.Fatal(err)
	}
	return d
}
