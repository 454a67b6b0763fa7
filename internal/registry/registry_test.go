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
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/validate"
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

func TestAuth(t *testing.T) {
	t.Parallel()
	rec := &recorder{h: basicAuth(memRegistry(), "builder", "s3cret")}
	host := serve(t, rec)
	img := randomImage(t)
	seed(t, host+"/team/app:v1", img, remote.WithAuth(&authn.Basic{Username: "builder", Password: "s3cret"}))
	want := digestOf(t, img)
	ctx := context.Background()

	t.Run("right config succeeds", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "builder", "s3cret"), Insecure: []string{host}})
		if got := mustHead(t, c, host+"/team/app:v1"); got != want {
			t.Fatalf("digest %s, want %s", got, want)
		}
		if _, err := c.Head(ctx, host+"/team/app:nope"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("missing tag: err = %v, want ErrNotFound", err)
		}
	})
	t.Run("no config fails and is not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{Insecure: []string{host}})
		_, err := c.Head(ctx, host+"/team/app:v1")
		if err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
		if !strings.Contains(err.Error(), "401") {
			t.Errorf("err = %v, want it to mention 401", err)
		}
	})
	t.Run("wrong password fails and is not ErrNotFound", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "builder", "wrong"), Insecure: []string{host}})
		_, err := c.Head(ctx, host+"/team/app:v1")
		if err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
	})
	t.Run("credentials for another registry are not sent", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, "other.example", "builder", "s3cret"), Insecure: []string{host}})
		if _, err := c.Head(ctx, host+"/team/app:v1"); err == nil || errors.Is(err, ErrNotFound) {
			t.Fatalf("err = %v, want a non-ErrNotFound error", err)
		}
	})
	t.Run("RemoteOptions pull with the config's credentials", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "builder", "s3cret"), Insecure: []string{host}})
		ref, err := c.ParseReference(host + "/team/app:v1")
		if err != nil {
			t.Fatal(err)
		}
		pulled, err := remote.Image(ref, c.RemoteOptions(ctx)...)
		if err != nil {
			t.Fatal(err)
		}
		if err := validate.Image(pulled); err != nil {
			t.Fatalf("pulled image invalid: %v", err)
		}
		anon := newClient(t, Options{Insecure: []string{host}})
		if _, err := remote.Image(ref, anon.RemoteOptions(ctx)...); err == nil {
			t.Fatal("anonymous pull succeeded against an auth-protected registry")
		}
	})
	t.Run("Push and Copy authenticate", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "builder", "s3cret"), Insecure: []string{host}})
		img := randomImage(t)
		d, err := c.Push(ctx, img, []string{host + "/team/pushed:v1"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Copy(ctx, host+"/team/pushed@"+d, host+"/other/copied:v1"); err != nil {
			t.Fatal(err)
		}
		if got := mustHead(t, c, host+"/other/copied:v1"); got != d {
			t.Fatalf("copied digest %s, want %s", got, d)
		}
	})
}

func TestCopy(t *testing.T) {
	t.Parallel()
	rec := &recorder{h: memRegistry()}
	host := serve(t, rec)
	host2 := serve(t, memRegistry())
	img := randomImage(t)
	seed(t, host+"/team/app:v1", img)
	want := digestOf(t, img)
	idx, err := random.Index(128, 1, 3)
	if err != nil {
		t.Fatal(err)
	}
	seed(t, host+"/team/multi:v1", idx)
	wantIdx := digestOf(t, idx)
	c := newClient(t, Options{Insecure: []string{host, host2}})
	ctx := context.Background()

	// Subtests that read rec.since run in sequence; the rest in parallel
	// afterwards.
	t.Run("same repository only tags", func(t *testing.T) {
		n := rec.count()
		got, err := c.Copy(ctx, host+"/team/app@"+want, host+"/team/app:release")
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("Copy returned %s, want %s", got, want)
		}
		if d := mustHead(t, c, host+"/team/app:release"); d != want {
			t.Fatalf("dst digest %s, want %s", d, want)
		}
		for _, r := range rec.since(n) {
			if strings.Contains(r, "/blobs/") {
				t.Errorf("a tag-only copy touched blobs: %s", r)
			}
		}
	})
	t.Run("copies", func(t *testing.T) {
		t.Run("image to another repository keeps the digest", func(t *testing.T) {
			t.Parallel()
			got, err := c.Copy(ctx, host+"/team/app:v1", host+"/mirror/app:v1")
			if err != nil {
				t.Fatal(err)
			}
			if got != want || mustHead(t, c, host+"/mirror/app:v1") != want {
				t.Fatalf("digest changed: Copy %s, want %s", got, want)
			}
			checkImage(t, c, host+"/mirror/app:v1")
		})
		t.Run("image to another registry keeps the digest", func(t *testing.T) {
			t.Parallel()
			got, err := c.Copy(ctx, host+"/team/app@"+want, host2+"/team/app:v1")
			if err != nil {
				t.Fatal(err)
			}
			if got != want || mustHead(t, c, host2+"/team/app:v1") != want {
				t.Fatalf("digest changed: Copy %s, want %s", got, want)
			}
			checkImage(t, c, host2+"/team/app:v1")
		})
		t.Run("index to another repository keeps the digest and children", func(t *testing.T) {
			t.Parallel()
			got, err := c.Copy(ctx, host+"/team/multi:v1", host+"/mirror/multi:v1")
			if err != nil {
				t.Fatal(err)
			}
			if got != wantIdx || mustHead(t, c, host+"/mirror/multi:v1") != wantIdx {
				t.Fatalf("digest changed: Copy %s, want %s", got, wantIdx)
			}
			checkIndex(t, c, host+"/mirror/multi", wantIdx)
		})
		t.Run("index to another registry keeps the digest and children", func(t *testing.T) {
			t.Parallel()
			got, err := c.Copy(ctx, host+"/team/multi@"+wantIdx, host2+"/mirror/multi:v1")
			if err != nil {
				t.Fatal(err)
			}
			if got != wantIdx || mustHead(t, c, host2+"/mirror/multi:v1") != wantIdx {
				t.Fatalf("digest changed: Copy %s, want %s", got, wantIdx)
			}
			checkIndex(t, c, host2+"/mirror/multi", wantIdx)
		})
		t.Run("index within its repository", func(t *testing.T) {
			t.Parallel()
			got, err := c.Copy(ctx, host+"/team/multi:v1", host+"/team/multi:stable")
			if err != nil {
				t.Fatal(err)
			}
			if got != wantIdx || mustHead(t, c, host+"/team/multi:stable") != wantIdx {
				t.Fatalf("digest changed: Copy %s, want %s", got, wantIdx)
			}
		})
		t.Run("missing source is ErrNotFound", func(t *testing.T) {
			t.Parallel()
			_, err := c.Copy(ctx, host+"/team/app:nope", host+"/team/app:x")
			if !errors.Is(err, ErrNotFound) {
				t.Fatalf("err = %v, want ErrNotFound", err)
			}
		})
		t.Run("destination must be a tag", func(t *testing.T) {
			t.Parallel()
			_, err := c.Copy(ctx, host+"/team/app:v1", host+"/mirror/app@"+want)
			if err == nil {
				t.Fatal("Copy to a digest reference succeeded")
			}
		})
	})
}

// checkImage pulls ref through c and verifies every blob.
func checkImage(t *testing.T, c *Client, ref string) {
	t.Helper()
	r, err := c.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r, c.RemoteOptions(context.Background())...)
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Image(img); err != nil {
		t.Fatalf("%s is incomplete: %v", ref, err)
	}
}

// checkIndex verifies the index at repo@digest and that every child
// manifest exists in repo.
func checkIndex(t *testing.T, c *Client, repo, digest string) {
	t.Helper()
	r, err := c.ParseReference(repo + "@" + digest)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := remote.Index(r, c.RemoteOptions(context.Background())...)
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Index(idx); err != nil {
		t.Fatalf("%s is incomplete: %v", repo, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, child := range m.Manifests {
		if got := mustHead(t, c, repo+"@"+child.Digest.String()); got != child.Digest.String() {
			t.Errorf("child %s resolves to %s", child.Digest, got)
		}
	}
}

func TestPush(t *testing.T) {
	t.Parallel()
	rec := &recorder{h: memRegistry()}
	host := serve(t, rec)
	host2 := serve(t, memRegistry())
	c := newClient(t, Options{Insecure: []string{host, host2}})
	ctx := context.Background()

	t.Run("two tags in one repository: a full write, then a tag", func(t *testing.T) {
		img := randomImage(t)
		n := rec.count()
		got, err := c.Push(ctx, img, []string{host + "/team/app:v1", host + "/team/app:latest"})
		if err != nil {
			t.Fatal(err)
		}
		reqs := rec.since(n)
		if want := digestOf(t, img); got != want {
			t.Fatalf("Push returned %s, want %s", got, want)
		}
		for _, ref := range []string{host + "/team/app:v1", host + "/team/app:latest"} {
			if d := mustHead(t, c, ref); d != got {
				t.Errorf("%s resolves to %s, want %s", ref, d, got)
			}
		}
		checkImage(t, c, host+"/team/app:latest")
		// After the first manifest PUT, only the second tag's manifest
		// traffic: no blob is checked or uploaded again.
		first := -1
		for i, r := range reqs {
			if strings.HasPrefix(r, "PUT ") && strings.Contains(r, "/manifests/") {
				first = i
				break
			}
		}
		if first < 0 {
			t.Fatalf("no manifest PUT in %v", reqs)
		}
		puts := 0
		for _, r := range reqs[first:] {
			if strings.Contains(r, "/blobs/") {
				t.Errorf("blob request after the first manifest PUT: %s", r)
			}
			if strings.HasPrefix(r, "PUT ") && strings.Contains(r, "/manifests/") {
				puts++
			}
		}
		if puts != 2 {
			t.Errorf("%d manifest PUTs, want 2", puts)
		}
	})
	t.Run("other repositories and registries", func(t *testing.T) {
		t.Parallel()
		img := randomImage(t)
		refs := []string{host + "/team/app:v2", host + "/mirror/app:v2", host2 + "/team/app:v2", host + "/team/app:also"}
		got, err := c.Push(ctx, img, refs)
		if err != nil {
			t.Fatal(err)
		}
		if want := digestOf(t, img); got != want {
			t.Fatalf("Push returned %s, want %s", got, want)
		}
		for _, ref := range refs {
			if d := mustHead(t, c, ref); d != got {
				t.Errorf("%s resolves to %s, want %s", ref, d, got)
			}
			checkImage(t, c, ref)
		}
	})
	t.Run("rejects bad references before writing", func(t *testing.T) {
		t.Parallel()
		img := randomImage(t)
		for _, refs := range [][]string{
			nil,
			{host + "/team/bad@" + digestOf(t, img)},
			{host + "/team/bad:v1", "bad:v1"},
		} {
			if _, err := c.Push(ctx, img, refs); err == nil {
				t.Errorf("Push(%v) succeeded", refs)
			}
		}
		if _, err := c.Head(ctx, host+"/team/bad:v1"); !errors.Is(err, ErrNotFound) {
			t.Errorf("a rejected push wrote something: %v", err)
		}
	})
}

func TestParseReference(t *testing.T) {
	t.Parallel()
	c := newClient(t, Options{Insecure: []string{"Registry.Internal:5000"}})

	t.Run("insecure registries use http", func(t *testing.T) {
		t.Parallel()
		r, err := c.ParseReference("registry.internal:5000/team/app:v1")
		if err != nil {
			t.Fatal(err)
		}
		if s := r.Context().Scheme(); s != "http" {
			t.Fatalf("scheme %s, want http", s)
		}
	})
	t.Run("other registries use https", func(t *testing.T) {
		t.Parallel()
		for _, ref := range []string{"registry.internal/team/app:v1", "registry.internal:5001/team/app:v1", "ghcr.io/team/app:v1"} {
			r, err := c.ParseReference(ref)
			if err != nil {
				t.Fatal(err)
			}
			if s := r.Context().Scheme(); s != "https" {
				t.Errorf("%s: scheme %s, want https", ref, s)
			}
		}
	})
	t.Run("digests parse as digests", func(t *testing.T) {
		t.Parallel()
		d := "sha256:" + strings.Repeat("a", 64)
		r, err := c.ParseReference("ghcr.io/team/app@" + d)
		if err != nil {
			t.Fatal(err)
		}
		if dg, ok := r.(name.Digest); !ok || dg.DigestStr() != d {
			t.Fatalf("got %#v, want digest %s", r, d)
		}
	})
	t.Run("strict", func(t *testing.T) {
		t.Parallel()
		for _, ref := range []string{"alpine", "alpine:3", "ghcr.io/team/app", "docker.io/alpine:3", "http://ghcr.io/team/app:v1", "ghcr.io/Team/app:v1"} {
			if r, err := c.ParseReference(ref); err == nil {
				t.Errorf("ParseReference(%q) = %v, want an error", ref, r)
			}
		}
	})
}

func TestOptions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("user agent defaults to buildq", func(t *testing.T) {
		t.Parallel()
		rec := &recorder{h: memRegistry()}
		host := serve(t, rec)
		c := newClient(t, Options{Insecure: []string{host}})
		_, _ = c.Head(ctx, host+"/team/app:v1")
		uas := rec.userAgents()
		if len(uas) == 0 {
			t.Fatal("no requests")
		}
		for _, ua := range uas {
			if !strings.HasPrefix(ua, "buildq") {
				t.Errorf("User-Agent %q, want buildq…", ua)
			}
		}
	})
	t.Run("custom user agent", func(t *testing.T) {
		t.Parallel()
		rec := &recorder{h: memRegistry()}
		host := serve(t, rec)
		c := newClient(t, Options{Insecure: []string{host}, UserAgent: "buildq-worker/1.2"})
		_, _ = c.Head(ctx, host+"/team/app:v1")
		for _, ua := range rec.userAgents() {
			if !strings.HasPrefix(ua, "buildq-worker/1.2") {
				t.Errorf("User-Agent %q, want buildq-worker/1.2…", ua)
			}
		}
	})
	t.Run("transport is used", func(t *testing.T) {
		t.Parallel()
		host := serve(t, memRegistry())
		ct := &countingTransport{}
		c := newClient(t, Options{Insecure: []string{host}, Transport: ct})
		img := randomImage(t)
		if _, err := c.Push(ctx, img, []string{host + "/team/app:v1"}); err != nil {
			t.Fatal(err)
		}
		if ct.count() == 0 {
			t.Fatal("Options.Transport saw no requests")
		}
	})
	t.Run("insecure entries must be host[:port]", func(t *testing.T) {
		t.Parallel()
		for _, h := range []string{"http://registry.internal", "registry.internal/path", ""} {
			if _, err := New(Options{Insecure: []string{h}}); err == nil {
				t.Errorf("New accepted insecure registry %q", h)
			}
		}
	})
}

// TestCopyToWritesWithTheTenantsCredentials: a registry where "worker"
// reads everything and "acme" may touch only acme/. CopyTo reads another
// tenant's image as the worker and writes it into acme/ as acme; acme's
// credentials alone cannot read the source, and cannot write elsewhere.
func TestCopyToWritesWithTheTenantsCredentials(t *testing.T) {
	t.Parallel()
	mem := memRegistry()
	host := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		switch {
		case r.URL.Path == "/v2/":
		case !ok:
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		case user == "worker" && pass == "w" && (r.Method == http.MethodGet || r.Method == http.MethodHead):
		case user == "acme" && pass == "a" && strings.HasPrefix(r.URL.Path, "/v2/acme/"):
		case user == "seed" && pass == "s":
		default:
			w.WriteHeader(http.StatusForbidden)
			return
		}
		mem.ServeHTTP(w, r)
	}))
	ctx := context.Background()
	img := randomImage(t)
	seeder := newClient(t, Options{Insecure: []string{host}, DockerConfig: writeDockerConfig(t, host, "seed", "s")})
	if _, err := seeder.Push(ctx, img, []string{host + "/other/app:v1"}); err != nil {
		t.Fatal(err)
	}
	want := digestOf(t, img)
	worker := newClient(t, Options{Insecure: []string{host}, DockerConfig: writeDockerConfig(t, host, "worker", "w")})
	acme := newClient(t, Options{Insecure: []string{host}, DockerConfig: writeDockerConfig(t, host, "acme", "a")})

	got, err := worker.CopyTo(ctx, host+"/other/app@"+want, host+"/acme/app:v1", acme)
	if err != nil || got != want {
		t.Fatalf("CopyTo = %s, %v; want %s", got, err, want)
	}
	if d := mustHead(t, seeder, host+"/acme/app:v1"); d != want {
		t.Fatalf("acme/app:v1 is %s, want %s", d, want)
	}
	if _, err := acme.Copy(ctx, host+"/other/app@"+want, host+"/acme/app:v2"); err == nil {
		t.Fatal("acme's own credentials read another tenant's image")
	}
	if _, err := worker.CopyTo(ctx, host+"/other/app@"+want, host+"/other/app:v2", acme); err == nil {
		t.Fatal("acme's credentials wrote into another tenant's repository")
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
