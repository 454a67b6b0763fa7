//go:build integration

package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	bqimage "github.com/buildq/buildq/internal/image"
)

// make image builds buildq's image without Docker and pushes it by digest
// to the suite's registry (htpasswd auth, from a docker config like any
// registry client's); the pushed index names both platforms, its images run
// as a non-root user, and the amd64 image's binary runs: it is static.
func TestImageBuildsAndPushesWithoutDocker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	dc := t.TempDir()
	if err := os.WriteFile(filepath.Join(dc, "config.json"), shared.dockerConfig, 0o600); err != nil {
		t.Fatal(err)
	}
	repo := shared.registryHost + "/buildq/buildq"
	cmd := exec.CommandContext(ctx, "make", "-s", "-C", "..", "image", "IMAGE="+repo, "INSECURE=1", "TAG=suite")
	cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+dc)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("make image: %v\n%s", err, errOut.String())
	}
	pushed := strings.TrimSpace(out.String())
	if !strings.HasPrefix(pushed, repo+"@sha256:") {
		t.Fatalf("make image printed %q, want %s@sha256:…", pushed, repo)
	}
	ref, err := name.NewDigest(pushed, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	auth := remote.WithAuth(&authn.Basic{Username: shared.registryUser, Password: shared.registryPass})
	idx, err := remote.Index(ref, auth, remote.WithContext(ctx))
	if err != nil {
		t.Fatalf("read back %s: %v", pushed, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	var archs []string
	var amd64 ggcrv1.Hash
	for _, d := range m.Manifests {
		archs = append(archs, d.Platform.Architecture)
		if d.Platform.Architecture == "amd64" {
			amd64 = d.Digest
		}
	}
	if strings.Join(archs, ",") != "amd64,arm64" {
		t.Fatalf("platforms %v, want amd64 and arm64", archs)
	}
	img, err := idx.Image(amd64)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != bqimage.User || cf.Config.Entrypoint[0] != bqimage.Binary || cf.Config.Labels["org.opencontainers.image.revision"] == "" {
		t.Fatalf("image config %+v", cf.Config)
	}
	// The binary, taken out of the pushed layer, runs here.
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("%d layers: %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	bin := filepath.Join(t.TempDir(), "buildq")
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			t.Fatal("the layer has no " + bqimage.Binary)
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name == strings.TrimPrefix(bqimage.Binary, "/") {
			f, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.Copy(f, tr); err != nil {
				t.Fatal(err)
			}
			_ = f.Close()
			break
		}
	}
	help, err := exec.CommandContext(ctx, bin, "worker", "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(help), "--tenant-concurrency") {
		t.Fatalf("the image's buildq worker --help: %v\n%s", err, help)
	}
	if out, err := exec.CommandContext(ctx, "file", bin).Output(); err == nil && !strings.Contains(string(out), "statically linked") {
		t.Errorf("the image's binary is not static: %s", out)
	}
}
