package registry

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

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
