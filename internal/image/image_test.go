package image

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"testing"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
)

func TestBuildIsNonRootAndReproducible(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	opts := Options{Platform: ggcrv1.Platform{OS: "linux", Architecture: "arm64"}, Created: at, Labels: map[string]string{"org.opencontainers.image.revision": "abc"}}
	img, err := Build([]byte("the binary"), opts)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != "65532:65532" || len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != Binary ||
		cf.OS != "linux" || cf.Architecture != "arm64" || !cf.Created.Equal(at) || cf.Config.Labels["org.opencontainers.image.revision"] != "abc" {
		t.Fatalf("config %+v", cf)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers %d %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got := map[string]*tar.Header{}
	var bin []byte
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
		if h.Name == Binary[1:] {
			bin, _ = io.ReadAll(tr)
		}
		if !h.ModTime.Equal(at) {
			t.Errorf("%s: time %s, want %s", h.Name, h.ModTime, at)
		}
	}
	if !bytes.Equal(bin, []byte("the binary")) || got[Binary[1:]].Mode != 0o755 {
		t.Fatalf("binary %q mode %o", bin, got[Binary[1:]].Mode)
	}
	if h := got["tmp/"]; h == nil || h.Mode != 0o1777 {
		t.Fatalf("/tmp %+v", h)
	}
	if h := got["etc/passwd"]; h == nil {
		t.Fatal("no /etc/passwd")
	}
	// The same inputs make the same image.
	again, _ := Build([]byte("the binary"), opts)
	d1, _ := img.Digest()
	d2, _ := again.Digest()
	if d1 != d2 {
		t.Fatalf("two builds of the same binary: %s and %s", d1, d2)
	}
	idx, err := Index([]ggcrv1.Image{img})
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil || len(m.Manifests) != 1 || m.Manifests[0].Platform.Architecture != "arm64" || m.Manifests[0].Digest != d1 {
		t.Fatalf("index %+v %v", m, err)
	}
	if _, err := Build(nil, opts); err == nil {
		t.Fatal("an empty binary made an image")
	}
}

func TestBuildAddsToolsAsLayersOfTheirOwn(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	opts := Options{Platform: ggcrv1.Platform{OS: "linux", Architecture: "amd64"}, Created: at}
	plain, err := Build([]byte("the binary"), opts)
	if err != nil {
		t.Fatal(err)
	}
	opts.Tools = map[string][]byte{"syft": []byte("the scanner")}
	img, err := Build([]byte("the binary"), opts)
	if err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 2 {
		t.Fatalf("layers %d %v", len(layers), err)
	}
	// buildq's layer is the same with or without tools.
	pl, _ := plain.Layers()
	d0, _ := pl[0].Digest()
	d1, _ := layers[0].Digest()
	if d0 != d1 {
		t.Fatalf("buildq's layer changed with a tool: %s vs %s", d0, d1)
	}
	rc, err := layers[1].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	h, err := tr.Next()
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(tr)
	if h.Name != "usr/local/bin/syft" || h.Mode != 0o755 || string(data) != "the scanner" {
		t.Fatalf("tool layer: %s mode %o %q", h.Name, h.Mode, data)
	}
	for _, bad := range []string{"", "buildq", "../syft", "bin/syft"} {
		if _, err := Build([]byte("b"), Options{Tools: map[string][]byte{bad: []byte("x")}}); err == nil {
			t.Errorf("tool %q accepted", bad)
		}
	}
}
