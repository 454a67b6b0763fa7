//go:build integration || e2e

package realnode

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	gcr "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	bqimage "github.com/buildq/buildq/internal/image"
)

// Images are the real node's images, referenced by digest at the
// registry address the Pods use.
type Images struct {
	Kaniko string // the kaniko executor in upstream's image layout
	Pause  string // the Pod sandbox: busybox sleeping
	Base   string // FROM image of the node tests: Debian's busybox-static
	Buildq string // buildq itself, static, for the fetch-context init container
	NATS   string // nats-server from its Go module, static: deploy/nats's image (Env.NATSImage)
}

// tarEntry is one file of a layer built in memory.
type tarEntry struct {
	name     string
	mode     int64
	body     []byte
	dir      bool
	linkname string // a symlink when set
}

func layer(entries []tarEntry) (gcr.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: e.mode, ModTime: epoch, Uname: "root", Gname: "root"}
		switch {
		case e.dir:
			h.Typeflag = tar.TypeDir
		case e.linkname != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, e.linkname
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(e.body))
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
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
}

func image(layers []gcr.Layer, cfg gcr.Config) (gcr.Image, error) {
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = cfg
	return mutate.ConfigFile(img, cf)
}

// busyboxLayer is Debian's busybox-static with a link per applet, a root
// and an app user (busybox-static has no adduser applet), /tmp and /root.
func busyboxLayer() (gcr.Layer, error) {
	bin, err := os.ReadFile("/bin/busybox")
	if err != nil {
		return nil, fmt.Errorf("busybox-static (tools/node-packages.sh installs it): %w", err)
	}
	out, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		return nil, fmt.Errorf("busybox --list: %w", err)
	}
	entries := []tarEntry{
		{name: "bin/", mode: 0o755, dir: true},
		{name: "bin/busybox", mode: 0o755, body: bin},
		{name: "etc/", mode: 0o755, dir: true},
		{name: "etc/passwd", mode: 0o644, body: []byte("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")},
		{name: "etc/group", mode: 0o644, body: []byte("root:x:0:\napp:x:1000:\n")},
		{name: "root/", mode: 0o700, dir: true},
		{name: "tmp/", mode: 0o1777, dir: true},
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet != "busybox" {
			entries = append(entries, tarEntry{name: "bin/" + applet, mode: 0o777, linkname: "busybox"})
		}
	}
	return layer(entries)
}

// kanikoLayer is the executor in upstream's layout (/kaniko/executor, the
// CA bundle under /kaniko/ssl/certs, /kaniko/.docker, /etc/nsswitch.conf),
// from the directory of the built binaries.
func kanikoLayer(tools string) (gcr.Layer, error) {
	exe, err := os.ReadFile(filepath.Join(tools, "kaniko-executor"))
	if err != nil {
		return nil, err
	}
	// Nothing a node test does leaves the machine; the bundle is there
	// because upstream's image has one.
	certs, err := os.ReadFile("/etc/ssl/certs/ca-certificates.crt")
	if err != nil {
		certs = nil
	}
	return layer([]tarEntry{
		{name: "kaniko/", mode: 0o755, dir: true},
		{name: "kaniko/executor", mode: 0o755, body: exe},
		{name: "kaniko/ssl/", mode: 0o755, dir: true},
		{name: "kaniko/ssl/certs/", mode: 0o755, dir: true},
		{name: "kaniko/ssl/certs/ca-certificates.crt", mode: 0o644, body: certs},
		{name: "kaniko/.docker/", mode: 0o755, dir: true},
		{name: "etc/", mode: 0o755, dir: true},
		{name: "etc/nsswitch.conf", mode: 0o644, body: []byte("hosts: files dns\n")},
		{name: "workspace/", mode: 0o755, dir: true},
	})
}

// buildqImage is buildq from this tree as make image builds it
// (internal/image): the worker's image, whose entrypoint the build Pods'
// fetch-context init container runs too.
func buildqImage(ctx context.Context) (gcr.Image, error) {
	dir, err := os.MkdirTemp("", "buildq-static-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", filepath.Join(dir, "buildq"), "github.com/buildq/buildq/cmd/buildq")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build static buildq: %w\n%s", err, out)
	}
	bin, err := os.ReadFile(filepath.Join(dir, "buildq"))
	if err != nil {
		return nil, err
	}
	return bqimage.Build(bin, bqimage.Options{Platform: gcr.Platform{OS: "linux", Architecture: runtime.GOARCH}, Created: time.Unix(0, 0).UTC()})
}

// natsServerLayer is nats-server built from its Go module (the version
// go.mod requires), static, at /nats-server as in the official image.
func natsServerLayer(ctx context.Context) (gcr.Layer, error) {
	dir, err := os.MkdirTemp("", "buildq-nats-server-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", filepath.Join(dir, "nats-server"), "github.com/nats-io/nats-server/v2")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build static nats-server: %w\n%s", err, out)
	}
	bin, err := os.ReadFile(filepath.Join(dir, "nats-server"))
	if err != nil {
		return nil, err
	}
	return layer([]tarEntry{{name: "nats-server", mode: 0o755, body: bin}})
}

// pushImages builds the node's images and pushes them through
// env.RegistryHost (the registry's loopback address); the references it
// returns name them by digest at podHost, the same registry as the Pods
// reach it.
func pushImages(ctx context.Context, env Env, podHost string) (Images, error) {
	var imgs Images
	bb, err := busyboxLayer()
	if err != nil {
		return imgs, err
	}
	kl, err := kanikoLayer(env.Tools)
	if err != nil {
		return imgs, err
	}
	bq, err := buildqImage(ctx)
	if err != nil {
		return imgs, err
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	type nodeImage struct {
		repo   string
		layers []gcr.Layer
		cfg    gcr.Config
		out    *string
	}
	all := []nodeImage{
		{"node/busybox", []gcr.Layer{bb}, gcr.Config{Env: []string{"PATH=" + path}, Cmd: []string{"sh"}}, &imgs.Base},
		{"node/pause", []gcr.Layer{bb}, gcr.Config{Env: []string{"PATH=" + path}, Entrypoint: []string{"/bin/busybox", "sleep", "2147483647"}}, &imgs.Pause},
		{"node/kaniko", []gcr.Layer{kl}, gcr.Config{
			Env: []string{
				"HOME=/root", "USER=root",
				"PATH=/usr/local/bin:/kaniko",
				"SSL_CERT_DIR=/kaniko/ssl/certs",
				"DOCKER_CONFIG=/kaniko/.docker/",
			},
			WorkingDir: "/workspace",
			Entrypoint: []string{"/kaniko/executor"},
		}, &imgs.Kaniko},
		{"node/buildq", nil, gcr.Config{}, &imgs.Buildq},
	}
	if env.NATSImage {
		nl, err := natsServerLayer(ctx)
		if err != nil {
			return imgs, err
		}
		all = append(all, nodeImage{"node/nats", []gcr.Layer{nl}, gcr.Config{Entrypoint: []string{"/nats-server"}}, &imgs.NATS})
	}
	for _, im := range all {
		img := bq
		if im.layers != nil {
			if img, err = image(im.layers, im.cfg); err != nil {
				return imgs, err
			}
		}
		ref, err := name.ParseReference(env.RegistryHost+"/"+im.repo+":latest", name.Insecure)
		if err != nil {
			return imgs, err
		}
		auth := remote.WithAuth(&authn.Basic{Username: env.RegistryUser, Password: env.RegistryPass})
		if err := remote.Write(ref, img, auth, remote.WithContext(ctx)); err != nil {
			return imgs, fmt.Errorf("push %s: %w", ref, err)
		}
		d, err := img.Digest()
		if err != nil {
			return imgs, err
		}
		*im.out = podHost + "/" + im.repo + "@" + d.String()
	}
	return imgs, nil
}
