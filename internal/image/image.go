// Package image assembles buildq's own container image without a Docker
// engine: one layer holding the static buildq binary, the files a
// non-root, distroless-like image needs, and a config that runs it as
// user 65532; optionally a layer per tool (syft, the SBOM scanner). go-containerregistry writes it to any OCI registry.
package image

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"maps"
	"path"
	"slices"
	"strings"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

const (
	// Binary is where the image holds buildq.
	Binary = "/usr/local/bin/buildq"
	// User is the image's user and group: not root.
	User = "65532:65532"
)

// Options describe one platform's image.
type Options struct {
	// Platform of the binary (os, architecture, variant).
	Platform ggcrv1.Platform
	// Created is the image's creation time and every file's time (a fixed
	// time makes the image reproducible: same binary, same digest).
	Created time.Time
	// Labels are OCI annotations of the config (org.opencontainers.image.*).
	Labels map[string]string
	// Tools are more executables for /usr/local/bin, by name (syft, the
	// SBOM scanner, for --sbom-scanner): a layer each, after buildq's.
	Tools map[string][]byte
}

// Build returns the image of binary for opts.Platform.
func Build(binary []byte, opts Options) (ggcrv1.Image, error) {
	if len(binary) == 0 {
		return nil, fmt.Errorf("image: empty binary")
	}
	layerTar, err := files(binary, opts.Created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(mutate.MediaType(empty.Image, types.OCIManifestSchema1), mutate.Addendum{
		Layer:     layer,
		MediaType: types.OCILayer,
		History:   ggcrv1.History{Created: ggcrv1.Time{Time: opts.Created}, CreatedBy: "buildq hack/image", Comment: "buildq binary"},
	})
	if err != nil {
		return nil, err
	}
	for _, n := range slices.Sorted(maps.Keys(opts.Tools)) {
		if n == "" || strings.ContainsAny(n, "/\\") || n == path.Base(Binary) || len(opts.Tools[n]) == 0 {
			return nil, fmt.Errorf("image: tool %q: want a file name other than buildq's, with content", n)
		}
		tt, err := toolLayer(n, opts.Tools[n], opts.Created)
		if err != nil {
			return nil, err
		}
		tl, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(tt)), nil
		}, tarball.WithMediaType(types.OCILayer))
		if err != nil {
			return nil, err
		}
		if img, err = mutate.Append(img, mutate.Addendum{
			Layer:     tl,
			MediaType: types.OCILayer,
			History:   ggcrv1.History{Created: ggcrv1.Time{Time: opts.Created}, CreatedBy: "buildq hack/image", Comment: n},
		}); err != nil {
			return nil, err
		}
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Variant = opts.Platform.OS, opts.Platform.Architecture, opts.Platform.Variant
	cf.Created = ggcrv1.Time{Time: opts.Created}
	cf.Config.User = User
	cf.Config.Entrypoint = []string{Binary}
	cf.Config.Cmd = []string{"worker"}
	cf.Config.WorkingDir = "/"
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/home/nonroot"}
	cf.Config.Labels = opts.Labels
	return mutate.ConfigFile(img, cf)
}

// files is the layer: the binary, /etc/passwd and /etc/group naming root
// and nonroot, nonroot's home, and /tmp (sticky, world-writable).
func files(binary []byte, at time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(name string, mode int64, uid int) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode, Uid: uid, Gid: uid, ModTime: at, Format: tar.FormatPAX})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: at, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	steps := []func() error{
		func() error { return dir("etc/", 0o755, 0) },
		func() error {
			return file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"))
		},
		func() error { return file("etc/group", 0o644, []byte("root:x:0:\nnonroot:x:65532:\n")) },
		func() error { return dir("home/", 0o755, 0) },
		func() error { return dir("home/nonroot/", 0o700, 65532) },
		func() error { return dir("tmp/", 0o1777, 0) },
		func() error { return dir("usr/", 0o755, 0) },
		func() error { return dir("usr/local/", 0o755, 0) },
		func() error { return dir("usr/local/bin/", 0o755, 0) },
		func() error { return file(Binary[1:], 0o755, binary) },
	}
	for _, s := range steps {
		if err := s(); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// toolLayer is a layer of one executable, /usr/local/bin/<name>.
func toolLayer(name string, data []byte, at time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: path.Join(path.Dir(Binary[1:]), name), Mode: 0o755,
		Size: int64(len(data)), ModTime: at, Format: tar.FormatPAX}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(data); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// Index gathers the platforms' images into one multi-platform index.
func Index(imgs []ggcrv1.Image) (ggcrv1.ImageIndex, error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	var adds []mutate.IndexAddendum
	for _, img := range imgs {
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, err
		}
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: ggcrv1.Descriptor{
			Platform: &ggcrv1.Platform{OS: cf.OS, Architecture: cf.Architecture, Variant: cf.Variant},
		}})
	}
	return mutate.AppendManifests(idx, adds...), nil
}
