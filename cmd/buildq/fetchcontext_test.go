package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
)

// fetch-context --absent: the build Pod's last look before kaniko runs.
// A tag holding an image stops the build (exit FetchExitTagTaken, the
// context removed again); a free tag lets it start; a registry that
// cannot answer is retried (exit 1), never taken for "free". The check
// uses the Pod's own docker config ($DOCKER_CONFIG).
func TestFetchContextChecksTheTagIsFree(t *testing.T) {
	// Not parallel: DOCKER_CONFIG is the process's environment.
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "Dockerfile"), []byte("FROM scratch\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var archive bytes.Buffer
	res, err := contexttar.Write(context.Background(), src, &archive, contexttar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s3 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(archive.Bytes()) }))
	t.Cleanup(s3.Close)

	// A registry that wants the Pod's credentials on every request.
	inner := ggcrregistry.New()
	reg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "builder" || p != "s3cret" {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(reg.Close)
	host := strings.TrimPrefix(reg.URL, "http://")
	taken, err := name.ParseReference(host+"/acme/web:taken", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := random.Image(64, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(taken, img, remote.WithAuth(&authn.Basic{Username: "builder", Password: "s3cret"})); err != nil {
		t.Fatal(err)
	}
	cfgDir := t.TempDir()
	auth := base64.StdEncoding.EncodeToString([]byte("builder:s3cret"))
	if err := os.WriteFile(filepath.Join(cfgDir, "config.json"), []byte(`{"auths":{"`+host+`":{"auth":"`+auth+`"}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", cfgDir)

	fetch := func(absent string) (int, string, string) {
		dest := t.TempDir()
		code, _, stderr := cli(t, "fetch-context", "--url", s3.URL+"/ctx.tar.gz", "--digest", res.Digest, "--dest", dest,
			"--absent", absent, "--insecure-registry", host)
		entries, err := os.ReadDir(dest)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		return code, strings.Join(names, ","), stderr
	}

	if code, files, stderr := fetch(host + "/acme/web:free"); code != 0 || files != "Dockerfile" {
		t.Errorf("a free tag: exit %d, context %q, stderr %s", code, files, stderr)
	}
	code, files, stderr := fetch(host + "/acme/web:taken")
	if code != kaniko.FetchExitTagTaken || files != "" || !strings.Contains(stderr, "tag taken") {
		t.Errorf("a taken tag: exit %d (want %d), context %q (want none), stderr %s", code, kaniko.FetchExitTagTaken, files, stderr)
	}

	t.Setenv("DOCKER_CONFIG", t.TempDir()) // no credentials: the registry refuses
	if code, files, stderr := fetch(host + "/acme/web:taken"); code != kaniko.FetchExitRegistry || files != "" {
		t.Errorf("a registry that refuses the check: exit %d (want %d, the Job failed at once), context %q, stderr %s", code, kaniko.FetchExitRegistry, files, stderr)
	}
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) }))
	t.Cleanup(down.Close)
	downHost := strings.TrimPrefix(down.URL, "http://")
	dest := t.TempDir()
	code, _, stderr = cli(t, "fetch-context", "--url", s3.URL+"/ctx.tar.gz", "--digest", res.Digest, "--dest", dest,
		"--absent", downHost+"/acme/web:x", "--insecure-registry", downHost)
	if code != kaniko.FetchExitRegistryDown {
		t.Errorf("a registry that cannot answer: exit %d (want %d, retried by the Job), stderr %s", code, kaniko.FetchExitRegistryDown, stderr)
	}
	if code, _, stderr := fetch("not a reference"); code != exitInvalid || !strings.Contains(stderr, "--absent") {
		t.Errorf("a malformed --absent: exit %d (want %d), stderr %s", code, exitInvalid, stderr)
	}
}
