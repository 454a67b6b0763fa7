package registry

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

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
