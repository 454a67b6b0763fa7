package registry

import (
	"context"
	"encoding/base64"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// fastBackoff keeps go-containerregistry's retries of 5xx answers to
// milliseconds instead of 1s+3s.
var fastBackoff = remote.Backoff{Duration: time.Millisecond, Factor: 1, Steps: 2}

// memRegistry is ggcr's in-memory registry, without request logging.
func memRegistry() http.Handler {
	return ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)))
}

// serve starts h on 127.0.0.1 and returns its host:port.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// newClient is New plus fast retries; the registries it talks to are
// listed as insecure (they are plain HTTP on loopback).
func newClient(t *testing.T, opts Options) *Client {
	t.Helper()
	c, err := New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	c.backoff = &fastBackoff
	return c
}

// writeFile writes content to a fresh file and returns its path.
func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.json")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// writeDockerConfig writes a config.json with one entry for host.
func writeDockerConfig(t *testing.T, host, user, pass string) string {
	t.Helper()
	b, err := DockerConfigJSON(host, user, pass)
	if err != nil {
		t.Fatal(err)
	}
	return writeFile(t, string(b))
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func randomImage(t *testing.T) v1.Image {
	t.Helper()
	img, err := random.Image(256, 2)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func digestOf(t *testing.T, d interface{ Digest() (v1.Hash, error) }) string {
	t.Helper()
	h, err := d.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return h.String()
}

// seed writes img (an image or an index) to ref with ggcr directly, so that
// tests of reads do not depend on Push.
func seed(t *testing.T, ref string, t2 remote.Taggable, opts ...remote.Option) {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Push(r, t2, opts...); err != nil {
		t.Fatalf("seed %s: %v", ref, err)
	}
}

// mustHead is c.Head that fails the test on error.
func mustHead(t *testing.T, c *Client, ref string) string {
	t.Helper()
	d, err := c.Head(context.Background(), ref)
	if err != nil {
		t.Fatalf("Head(%s): %v", ref, err)
	}
	return d
}

// basicAuth requires HTTP basic auth user:pass on every request and
// answers 401 with a Basic challenge otherwise, like a plain
// registry:2 with htpasswd.
func basicAuth(h http.Handler, user, pass string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		if !ok || u != user || p != pass {
			w.Header().Set("WWW-Authenticate", `Basic realm="test registry"`)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// recorder wraps a handler and remembers every request ("METHOD path")
// and User-Agent.
type recorder struct {
	h   http.Handler
	mu  sync.Mutex
	log []string
	uas []string
}

func (rec *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rec.mu.Lock()
	rec.log = append(rec.log, r.Method+" "+r.URL.Path)
	rec.uas = append(rec.uas, r.UserAgent())
	rec.mu.Unlock()
	rec.h.ServeHTTP(w, r)
}

// since returns the requests after the first n.
func (rec *recorder) since(n int) []string {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]string(nil), rec.log[n:]...)
}

func (rec *recorder) count() int {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return len(rec.log)
}

func (rec *recorder) userAgents() []string {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]string(nil), rec.uas...)
}

// resolved returns the credentials c's keychain gives for a repository
// (nil: anonymous).
func resolved(t *testing.T, c *Client, repo string) *authn.AuthConfig {
	t.Helper()
	r, err := name.NewRepository(repo)
	if err != nil {
		t.Fatal(err)
	}
	a, err := c.keychain.Resolve(r)
	if err != nil {
		t.Fatalf("Resolve(%s): %v", repo, err)
	}
	if a == authn.Anonymous {
		return nil
	}
	cfg, err := a.Authorization()
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// countingTransport counts round trips through http.DefaultTransport.
type countingTransport struct {
	mu sync.Mutex
	n  int
}

func (ct *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	ct.mu.Lock()
	ct.n++
	ct.mu.Unlock()
	return http.DefaultTransport.RoundTrip(r)
}

func (ct *countingTransport) count() int {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	return ct.n
}

func withBasic(user, pass string) remote.Option {
	return remote.WithAuth(&authn.Basic{Username: user, Password: pass})
}
