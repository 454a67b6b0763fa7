package registry

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

func TestHead(t *testing.T) {
	t.Parallel()
	host := serve(t, memRegistry())
	img := randomImage(t)
	seed(t, host+"/team/app:v1", img)
	want := digestOf(t, img)
	c := newClient(t, Options{Insecure: []string{host}})
	ctx := context.Background()

	t.Run("pushed tag returns its digest", func(t *testing.T) {
		t.Parallel()
		if got := mustHead(t, c, host+"/team/app:v1"); got != want {
			t.Fatalf("digest %s, want %s", got, want)
		}
	})
	t.Run("pushed digest returns itself", func(t *testing.T) {
		t.Parallel()
		if got := mustHead(t, c, host+"/team/app@"+want); got != want {
			t.Fatalf("digest %s, want %s", got, want)
		}
	})
	t.Run("missing tag is ErrNotFound", func(t *testing.T) {
		t.Parallel()
		_, err := c.Head(ctx, host+"/team/app:nope")
		if !errors.Is(err, ErrNotFound) || !IsNotFound(err) {
			t.Fatalf("err = %v, want ErrNotFound", err)
		}
	})
	t.Run("missing repository is ErrNotFound", func(t *testing.T) {
		t.Parallel()
		_, err := c.Head(ctx, host+"/team/never-pushed:v1")
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want ErrNotFound", err)
		}
	})
	t.Run("missing digest is ErrNotFound", func(t *testing.T) {
		t.Parallel()
		_, err := c.Head(ctx, host+"/team/app@sha256:"+strings.Repeat("0", 64))
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want ErrNotFound", err)
		}
	})
	t.Run("error names the reference", func(t *testing.T) {
		t.Parallel()
		_, err := c.Head(ctx, host+"/team/app:nope")
		if err == nil || !strings.Contains(err.Error(), host+"/team/app:nope") {
			t.Fatalf("err = %v, want it to name the reference", err)
		}
	})
	t.Run("cancelled context is not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err := c.Head(cctx, host+"/team/app:v1")
		if err == nil || errors.Is(err, ErrNotFound) || !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled and not ErrNotFound", err)
		}
	})
	t.Run("references must be fully qualified", func(t *testing.T) {
		t.Parallel()
		for _, ref := range []string{"alpine:3", host + "/team/app", "https://" + host + "/team/app:v1", ""} {
			if _, err := c.Head(ctx, ref); err == nil || errors.Is(err, ErrNotFound) {
				t.Errorf("Head(%q) = %v, want a parse error", ref, err)
			}
		}
	})
}

// failManifests answers every manifest HEAD/GET with status and body and
// counts them; everything else goes to the in-memory registry.
type failManifests struct {
	status int
	body   string
	hits   atomic.Int32
	next   http.Handler
}

func (f *failManifests) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.Contains(r.URL.Path, "/manifests/") && (r.Method == http.MethodHead || r.Method == http.MethodGet) {
		f.hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(f.status)
		_, _ = io.WriteString(w, f.body)
		return
	}
	f.next.ServeHTTP(w, r)
}

func TestFailuresAreNotNotFound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("500 on manifests is an error but not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		mem := memRegistry()
		seed(t, serve(t, mem)+"/team/app:v1", randomImage(t)) // the same storage, working
		f := &failManifests{status: http.StatusInternalServerError, next: mem}
		host := serve(t, f)
		c := newClient(t, Options{Insecure: []string{host}})
		_, err := c.Head(ctx, host+"/team/app:v1")
		if err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
		if !strings.Contains(err.Error(), "500") {
			t.Errorf("err = %v, want it to mention the status", err)
		}
		if f.hits.Load() == 0 {
			t.Error("the registry saw no manifest request")
		}
	})
	t.Run("500 whose body says MANIFEST_UNKNOWN is not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		f := &failManifests{
			status: http.StatusInternalServerError,
			body:   `{"errors":[{"code":"MANIFEST_UNKNOWN","message":"backend hiccup"}]}`,
			next:   memRegistry(),
		}
		host := serve(t, f)
		c := newClient(t, Options{Insecure: []string{host}})
		// Copy reads the source with GET, which carries the body.
		_, err := c.Copy(ctx, host+"/team/app:v1", host+"/team/app:v2")
		if err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
	})
	t.Run("404 with MANIFEST_UNKNOWN body is ErrNotFound on GET", func(t *testing.T) {
		t.Parallel()
		host := serve(t, memRegistry())
		c := newClient(t, Options{Insecure: []string{host}})
		_, err := c.Copy(ctx, host+"/team/app:v1", host+"/team/app:v2")
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want ErrNotFound", err)
		}
	})
	t.Run("400 with NAME_UNKNOWN body is ErrNotFound", func(t *testing.T) {
		t.Parallel()
		f := &failManifests{
			status: http.StatusBadRequest,
			body:   `{"errors":[{"code":"NAME_UNKNOWN","message":"repository name not known to registry"}]}`,
			next:   memRegistry(),
		}
		host := serve(t, f)
		c := newClient(t, Options{Insecure: []string{host}})
		_, err := c.Copy(ctx, host+"/team/app:v1", host+"/team/app:v2")
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want ErrNotFound", err)
		}
	})
	t.Run("a host that is not a registry is not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		host := serve(t, http.NotFoundHandler()) // 404 for /v2/ too
		c := newClient(t, Options{Insecure: []string{host}})
		_, err := c.Head(ctx, host+"/team/app:v1")
		if err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
	})
	t.Run("connection refused is not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		srv := httptest.NewServer(memRegistry())
		host := strings.TrimPrefix(srv.URL, "http://")
		srv.Close()
		c := newClient(t, Options{Insecure: []string{host}})
		_, err := c.Head(ctx, host+"/team/app:v1")
		if err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
	})
}

// headQuirk makes manifest HEADs misbehave; GETs work.
func headQuirk(next http.Handler, quirk string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodHead || !strings.Contains(r.URL.Path, "/manifests/") {
			next.ServeHTTP(w, r)
			return
		}
		switch quirk {
		case "405":
			w.WriteHeader(http.StatusMethodNotAllowed)
		case "no-digest":
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			for k, v := range rec.Header() {
				if k != "Docker-Content-Digest" {
					w.Header()[k] = v
				}
			}
			w.WriteHeader(rec.Code)
		}
	})
}

func TestHeadFallsBackToGet(t *testing.T) {
	t.Parallel()
	for _, quirk := range []string{"405", "no-digest"} {
		t.Run("HEAD "+quirk, func(t *testing.T) {
			t.Parallel()
			mem := memRegistry()
			img := randomImage(t)
			seed(t, serve(t, mem)+"/team/app:v1", img) // the same storage, without the quirk
			host := serve(t, headQuirk(mem, quirk))
			c := newClient(t, Options{Insecure: []string{host}})
			if got, want := mustHead(t, c, host+"/team/app:v1"), digestOf(t, img); got != want {
				t.Fatalf("digest %s, want %s", got, want)
			}
			if _, err := c.Head(context.Background(), host+"/team/app:nope"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("missing tag: err = %v, want ErrNotFound", err)
			}
		})
	}
}

// TestHeadReusesAuthentication: repeated Heads of one repository ping and
// authenticate once, then send one request each (a cache hit's check must
// not cost three round trips).
func TestHeadReusesAuthentication(t *testing.T) {
	t.Parallel()
	rec := &recorder{h: basicAuth(memRegistry(), "builder", "s3cret")}
	host := serve(t, rec)
	img := randomImage(t)
	seed(t, host+"/team/app:v1", img, remote.WithAuth(&authn.Basic{Username: "builder", Password: "s3cret"}))
	c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "builder", "s3cret"), Insecure: []string{host}})
	want := digestOf(t, img)
	mustHead(t, c, host+"/team/app:v1")
	n := rec.count()
	for range 5 {
		if got := mustHead(t, c, host+"/team/app:v1"); got != want {
			t.Fatalf("digest %s, want %s", got, want)
		}
	}
	if _, err := c.Head(context.Background(), host+"/team/app:nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing tag: err = %v, want ErrNotFound", err)
	}
	if got := rec.since(n); len(got) != 6 {
		t.Fatalf("6 Heads after the first sent %d requests, want 6 (no ping, no re-authentication): %v", len(got), got)
	}
	// Another client (other credentials) is not served from this cache.
	wrong := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "builder", "wrong"), Insecure: []string{host}})
	if _, err := wrong.Head(context.Background(), host+"/team/app:v1"); err == nil || errors.Is(err, ErrNotFound) {
		t.Fatalf("wrong password: err = %v, want a non-ErrNotFound error", err)
	}
}
