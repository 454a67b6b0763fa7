// Command images builds the images of the Docker-host path without pulling
// anything — buildq (the worker, internal/image as make image builds it),
// nats-server (built from this module's nats-server requirement), MinIO
// and the CNCF distribution registry (built by integration/tools/build.sh
// from their pinned modules) — and loads them into the Docker engine at
// DOCKER_HOST, each pinned by digest.
//
// Loading goes through a registry, not `docker load`: a loaded image has
// no repository digest, so `image: repo@sha256:…` would not find it. The
// tool serves the images from an in-memory go-containerregistry registry
// on 127.0.0.1 (--port, fixed, because it is part of the references) for
// the moment of a `docker pull repo@sha256:…`, which records the digest.
// The images are reproducible (fixed file times, -trimpath, no build id),
// so the same sources and Go give the same digests, and a digest already
// in the engine is not pulled again.
//
// It writes KEY=repo@sha256:… lines (--env, for docker compose --env-file
// and for make e2e) and prints them.
//
//	go run ./hack/docker/images --tools "$(bash integration/tools/build.sh)" --env ~/.cache/buildq/docker/images.env
package main

import (
	"archive/tar"
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	bqimage "github.com/buildq/buildq/internal/image"
)

// epoch is every file's and every image's time: reproducible digests.
var epoch = time.Unix(0, 0).UTC()

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

type built struct {
	key  string // the env variable
	repo string // buildq/<name>
	img  ggcrv1.Image
}

func run() error {
	tools := flag.String("tools", "", "directory with the minio and registry binaries (the output of integration/tools/build.sh; required)")
	envOut := flag.String("env", "", "write the KEY=repo@sha256:… lines to this file")
	port := flag.Int("port", 5001, "port of the in-memory registry on 127.0.0.1 the engine pulls from; part of every reference")
	flag.Parse()
	if *tools == "" {
		return fmt.Errorf("--tools is required (bash integration/tools/build.sh prints it)")
	}
	if os.Getenv("DOCKER_HOST") == "" {
		return fmt.Errorf("DOCKER_HOST is not set (hack/docker/start.sh prints it)")
	}
	dir, err := os.MkdirTemp("", "buildq-docker-images-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	var imgs []built
	// buildq: the worker, and the build Pods' fetch-context init container.
	bq, err := goBuild(dir, "buildq", "github.com/buildq/buildq/cmd/buildq")
	if err != nil {
		return err
	}
	img, err := bqimage.Build(bq, bqimage.Options{Platform: ggcrv1.Platform{OS: "linux", Architecture: runtime.GOARCH}, Created: epoch,
		Labels: map[string]string{"org.opencontainers.image.source": "https://github.com/buildq/buildq", "org.opencontainers.image.title": "buildq"}})
	if err != nil {
		return err
	}
	imgs = append(imgs, built{"BUILDQ_WORKER_IMAGE", "buildq/buildq", img})

	ns, err := goBuild(dir, "nats-server", "github.com/nats-io/nats-server/v2")
	if err != nil {
		return err
	}
	for _, s := range []struct {
		key, repo, bin string
		body           []byte
		cmd            []string
		config         string // /etc/distribution/config.yml
	}{
		{"BUILDQ_NATS_IMAGE", "buildq/nats-server", "nats-server", ns, []string{"-js", "-sd", "/data"}, ""},
		{"BUILDQ_MINIO_IMAGE", "buildq/minio", "minio", nil, []string{"server", "/data"}, ""},
		// The upstream image's default: :5000, no auth, /data.
		{"BUILDQ_REGISTRY_IMAGE", "buildq/registry", "registry", nil, []string{"serve", "/etc/distribution/config.yml"},
			"version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: /data\n  delete:\n    enabled: true\nhttp:\n  addr: :5000\n"},
	} {
		body := s.body
		if body == nil {
			if body, err = os.ReadFile(filepath.Join(*tools, s.bin)); err != nil {
				return fmt.Errorf("%s (integration/tools/build.sh builds it): %w", s.bin, err)
			}
		}
		img, err := binaryImage(s.bin, body, s.cmd, s.config)
		if err != nil {
			return err
		}
		imgs = append(imgs, built{s.key, s.repo, img})
	}

	// The in-memory registry the engine pulls from, for this run only.
	addr := fmt.Sprintf("127.0.0.1:%d", *port)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s for the engine's pulls (choose another with --port): %w", addr, err)
	}
	srv := &http.Server{Handler: registry.New(registry.Logger(log.New(io.Discard, "", 0))), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()

	ctx := context.Background()
	var env strings.Builder
	for _, b := range imgs {
		d, err := b.img.Digest()
		if err != nil {
			return err
		}
		ref := addr + "/" + b.repo + "@" + d.String()
		if exec.Command("docker", "image", "inspect", ref).Run() != nil {
			r, err := name.ParseReference(ref, name.Insecure)
			if err != nil {
				return err
			}
			if err := remote.Write(r, b.img, remote.WithContext(ctx)); err != nil {
				return fmt.Errorf("serve %s: %w", ref, err)
			}
			cmd := exec.Command("docker", "pull", "-q", ref)
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("docker pull %s: %w", ref, err)
			}
			fmt.Fprintf(os.Stderr, "loaded %s\n", ref)
		} else {
			fmt.Fprintf(os.Stderr, "already in the engine: %s\n", ref)
		}
		fmt.Fprintf(&env, "%s=%s\n", b.key, ref)
	}
	pruneOld(addr, env.String())
	fmt.Print(env.String())
	if *envOut != "" {
		if err := os.MkdirAll(filepath.Dir(*envOut), 0o755); err != nil {
			return err
		}
		return os.WriteFile(*envOut, []byte(env.String()), 0o644)
	}
	return nil
}

// goBuild builds a static binary of pkg (resolved in this module) and
// returns it.
func goBuild(dir, bin, pkg string) ([]byte, error) {
	out := filepath.Join(dir, bin)
	fmt.Fprintf(os.Stderr, "building %s (%s)\n", bin, pkg)
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w -buildid=", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("go build %s: %w", pkg, err)
	}
	return os.ReadFile(out)
}

// binaryImage is one static binary at /usr/local/bin/<bin> as the
// entrypoint, with /tmp, /data and /etc/distribution (config, when not
// empty, as /etc/distribution/config.yml), running as root (the servers
// write their data directory).
func binaryImage(bin string, body []byte, cmd []string, config string) (ggcrv1.Image, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	type entry struct {
		name string
		mode int64
		body []byte
		dir  bool
	}
	entries := []entry{
		{"etc/", 0o755, nil, true},
		{"etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\n"), false},
		{"etc/group", 0o644, []byte("root:x:0:\n"), false},
		{"etc/distribution/", 0o755, nil, true},
		{"data/", 0o755, nil, true},
		{"root/", 0o700, nil, true},
		{"tmp/", 0o1777, nil, true},
		{"usr/", 0o755, nil, true},
		{"usr/local/", 0o755, nil, true},
		{"usr/local/bin/", 0o755, nil, true},
		{"usr/local/bin/" + bin, 0o755, body, false},
	}
	if config != "" {
		entries = append(entries, entry{"etc/distribution/config.yml", 0o644, []byte(config), false})
	}
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: e.mode, ModTime: epoch, Typeflag: tar.TypeReg, Size: int64(len(e.body)), Format: tar.FormatPAX}
		if e.dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.body); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layer, History: ggcrv1.History{Created: ggcrv1.Time{Time: epoch}, CreatedBy: "buildq hack/docker/images"}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Created = "linux", runtime.GOARCH, ggcrv1.Time{Time: epoch}
	cf.Config.Entrypoint = []string{"/usr/local/bin/" + bin}
	cf.Config.Cmd = cmd
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root"}
	cf.Config.WorkingDir = "/"
	cf.Config.Labels = map[string]string{"org.opencontainers.image.source": "https://github.com/buildq/buildq", "org.opencontainers.image.title": bin}
	return mutate.ConfigFile(img, cf)
}

// pruneOld removes the images an earlier run loaded (addr/buildq/…) that
// this run's references no longer name, so the engine's data root does
// not grow with every change of buildq.
func pruneOld(addr, current string) {
	out, err := exec.Command("docker", "images", "--digests", "--format", "{{.Repository}}@{{.Digest}} {{.ID}}").Output()
	if err != nil {
		return
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		ref, id, ok := strings.Cut(line, " ")
		if !ok || !strings.HasPrefix(ref, addr+"/buildq/") || strings.Contains(current, "="+ref+"\n") {
			continue
		}
		if exec.Command("docker", "rmi", id).Run() == nil {
			fmt.Fprintf(os.Stderr, "removed %s\n", ref)
		}
	}
}
