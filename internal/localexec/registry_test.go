package localexec

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// testRegistry is an in-memory registry with a few hand-made images:
//
//	base:v1        index for linux/amd64 and linux/arm64 with /etc/passwd,
//	               /etc/group, /tmp (1777), /home and an ONBUILD COPY trigger
//	base:onbuild   single image whose ONBUILD trigger is a RUN
//	tools:1        single image with /usr/bin/tool owned by 5:6
type testRegistry struct {
	host      string
	baseLayer map[string]v1.Hash // digest of the base layer by architecture
}

func startRegistry(t *testing.T) *testRegistry {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	u, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	r := &testRegistry{host: u.Host, baseLayer: map[string]v1.Hash{}}

	idx := mutate.IndexMediaType(empty.Index, types.DockerManifestList)
	for _, arch := range []string{"amd64", "arm64"} {
		img := hostImage(t, arch, []string{"COPY onbuild.txt /from-trigger.txt"})
		ls, err := img.Layers()
		if err != nil {
			t.Fatal(err)
		}
		if r.baseLayer[arch], err = ls[0].Digest(); err != nil {
			t.Fatal(err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: arch}},
		})
	}
	if err := remote.WriteIndex(r.ref(t, "base:v1"), idx); err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r.ref(t, "base:onbuild"), hostImage(t, "amd64", []string{"RUN make"})); err != nil {
		t.Fatal(err)
	}
	tools := imageWithLayer(t, []tar.Header{
		{Name: "usr/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "usr/bin/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "usr/bin/tool", Typeflag: tar.TypeReg, Mode: 0o755, Uid: 5, Gid: 6},
	}, map[string]string{"usr/bin/tool": "tool-binary"}, v1.Config{})
	if err := remote.Write(r.ref(t, "tools:1"), tools); err != nil {
		t.Fatal(err)
	}

	// broken:v1 has a manifest and config, but its layer blob is gone.
	broken := imageWithLayer(t, []tar.Header{{Name: "gone", Typeflag: tar.TypeReg, Mode: 0o644}},
		map[string]string{"gone": "this blob is deleted"}, v1.Config{})
	if broken, err = mutate.ConfigFile(broken, &v1.ConfigFile{
		OS: "linux", Architecture: "amd64", RootFS: configOf(t, broken).RootFS,
	}); err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r.ref(t, "broken:v1"), broken); err != nil {
		t.Fatal(err)
	}
	bl, err := broken.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, err := bl[0].Digest()
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequest(http.MethodDelete, srv.URL+"/v2/broken/blobs/"+d.String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("deleting the broken blob: %s", resp.Status)
	}
	return r
}

func (r *testRegistry) ref(t *testing.T, repoTag string) name.Reference {
	t.Helper()
	ref, err := name.ParseReference(r.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	return ref
}

// hostImage is a tiny distro-like base image for one architecture.
func hostImage(t *testing.T, arch string, onbuild []string) v1.Image {
	t.Helper()
	img := imageWithLayer(t, []tar.Header{
		{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "bin/sh", Typeflag: tar.TypeReg, Mode: 0o755},
		{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "etc/arch", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "etc/group", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "etc/passwd", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "home/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "tmp/", Typeflag: tar.TypeDir, Mode: 0o1777},
	}, map[string]string{
		"bin/sh":     "#!shell",
		"etc/arch":   arch,
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001:App:/home/app:/bin/sh\n",
		"etc/group":  "root:x:0:\nstaff:x:50:app\napp:x:1001:\n",
	}, v1.Config{Env: []string{"PATH=/bin", "BASE=1"}, Cmd: []string{"/bin/sh"}, OnBuild: onbuild})
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.History = []v1.History{{CreatedBy: "base layer " + arch}}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// imageWithLayer is a Docker-media-type image with one layer.
func imageWithLayer(t *testing.T, headers []tar.Header, contents map[string]string, cfg v1.Config) v1.Image {
	t.Helper()
	data := makeTar(t, true, headers, contents)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.Config(img, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// countingTransport proves Options.Remote reaches the registry client.
type countingTransport struct{ n atomic.Int64 }

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return http.DefaultTransport.RoundTrip(r)
}

func TestRegistryBase(t *testing.T) {
	t.Parallel()
	reg := startRegistry(t)
	dockerfile := `FROM ` + reg.host + `/base:v1
COPY --chown=app:staff app.txt /home/app/app.txt
WORKDIR /tmp
COPY --from=` + reg.host + `/tools:1 /usr/bin/tool /usr/local/bin/tool
ENV EXTRA=1
`
	files := map[string]file{"app.txt": {content: "app"}, "onbuild.txt": {content: "trigger"}}
	ctxDir := writeContext(t, dockerfile, files)
	transport := &countingTransport{}
	img := build(t, Options{ContextDir: ctxDir, Remote: []remote.Option{remote.WithTransport(transport)}})
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	cf := configOf(t, img)

	t.Run("base layers come first", func(t *testing.T) {
		t.Parallel()
		if len(layers) != 4 {
			t.Fatalf("%d layers, want base + ONBUILD COPY + COPY + COPY --from (WORKDIR /tmp exists)", len(layers))
		}
		if d, _ := layers[0].Digest(); d != reg.baseLayer["amd64"] {
			t.Errorf("first layer %s, want the base layer %s", d, reg.baseLayer["amd64"])
		}
		if cf.Architecture != "amd64" || cf.OS != "linux" {
			t.Errorf("platform %s/%s, want linux/amd64", cf.OS, cf.Architecture)
		}
		if h := cf.History[0].CreatedBy; h != "base layer amd64" {
			t.Errorf("first history entry %q, want the base's", h)
		}
	})

	t.Run("ONBUILD trigger of the base runs first and is not inherited", func(t *testing.T) {
		t.Parallel()
		got := names(layerEntries(t, layers[1]))
		if !equalStrings(got, []string{"from-trigger.txt"}) {
			t.Errorf("trigger layer %q", got)
		}
		if len(cf.Config.OnBuild) != 0 {
			t.Errorf("OnBuild %q inherited", cf.Config.OnBuild)
		}
	})

	t.Run("chown names resolve from the base's passwd and group", func(t *testing.T) {
		t.Parallel()
		got := layerEntries(t, layers[2])
		want := []entry{
			{name: "home/app/", typ: tar.TypeDir, mode: 0o755, uid: 1001, gid: 50},
			{name: "home/app/app.txt", typ: tar.TypeReg, mode: 0o644, uid: 1001, gid: 50, content: "app"},
		}
		if len(got) != len(want) {
			t.Fatalf("layer %+v, want %+v (existing /home must not be re-emitted)", got, want)
		}
		for i := range want {
			got[i].mtime = want[i].mtime
			if got[i] != want[i] {
				t.Errorf("entry %d = %+v, want %+v", i, got[i], want[i])
			}
		}
	})

	t.Run("COPY --from an image keeps its owner", func(t *testing.T) {
		t.Parallel()
		fs := flatten(t, img)
		tool := fs["usr/local/bin/tool"]
		if tool.content != "tool-binary" || tool.uid != 5 || tool.gid != 6 || tool.mode != 0o755 {
			t.Errorf("tool = %+v", tool)
		}
		if tmp := fs["tmp"]; tmp.mode != 0o1777 {
			t.Errorf("/tmp mode %o, want 1777 kept from the base", tmp.mode)
		}
		if sh := fs["bin/sh"]; sh.content != "#!shell" {
			t.Errorf("base file /bin/sh = %+v", sh)
		}
	})

	t.Run("config extends the base config", func(t *testing.T) {
		t.Parallel()
		if !equalStrings(cf.Config.Env, []string{"PATH=/bin", "BASE=1", "EXTRA=1"}) {
			t.Errorf("env %q", cf.Config.Env)
		}
		if !equalStrings(cf.Config.Cmd, []string{"/bin/sh"}) {
			t.Errorf("cmd %q", cf.Config.Cmd)
		}
		if cf.Config.WorkingDir != "/tmp" {
			t.Errorf("workdir %q", cf.Config.WorkingDir)
		}
	})

	t.Run("media types follow the Docker base", func(t *testing.T) {
		t.Parallel()
		m, err := img.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		if m.MediaType != types.DockerManifestSchema2 {
			t.Errorf("manifest %s", m.MediaType)
		}
		for i, l := range m.Layers {
			if l.MediaType != types.DockerLayer {
				t.Errorf("layer %d media type %s, want %s", i, l.MediaType, types.DockerLayer)
			}
		}
	})

	t.Run("Remote options are used for pulls", func(t *testing.T) {
		t.Parallel()
		if transport.n.Load() == 0 {
			t.Error("the transport from Options.Remote was not used")
		}
	})

	t.Run("rebuilding gives the same digest", func(t *testing.T) {
		t.Parallel()
		again := build(t, Options{ContextDir: ctxDir})
		if digestOf(t, again) != digestOf(t, img) {
			t.Error("digest changed between identical builds")
		}
	})

	t.Run("the image can be pushed", func(t *testing.T) {
		t.Parallel()
		ref := reg.ref(t, "out:latest")
		if err := remote.Write(ref, img); err != nil {
			t.Fatal(err)
		}
		pulled, err := remote.Image(ref)
		if err != nil {
			t.Fatal(err)
		}
		if digestOf(t, pulled) != digestOf(t, img) {
			t.Error("pushed digest differs")
		}
	})
}

func TestRegistryPlatformAndErrors(t *testing.T) {
	t.Parallel()
	reg := startRegistry(t)
	files := map[string]file{"onbuild.txt": {content: "x"}}
	tests := []struct {
		name       string
		dockerfile string
		platform   string
		check      func(t *testing.T, img v1.Image, err error)
	}{
		{
			name:       "Platform picks the matching image from an index",
			dockerfile: "FROM " + reg.host + "/base:v1\n",
			platform:   "linux/arm64",
			check: func(t *testing.T, img v1.Image, err error) {
				if err != nil {
					t.Fatal(err)
				}
				if a := configOf(t, img).Architecture; a != "arm64" {
					t.Errorf("architecture %s", a)
				}
				if got := flatten(t, img)["etc/arch"].content; got != "arm64" {
					t.Errorf("/etc/arch = %q", got)
				}
			},
		},
		{
			name:       "FROM --platform overrides the option",
			dockerfile: "FROM --platform=linux/arm64 " + reg.host + "/base:v1\n",
			platform:   "linux/amd64",
			check: func(t *testing.T, img v1.Image, err error) {
				if err != nil {
					t.Fatal(err)
				}
				if a := configOf(t, img).Architecture; a != "arm64" {
					t.Errorf("architecture %s", a)
				}
			},
		},
		{
			name:       "a single-platform base for another platform is refused",
			dockerfile: "FROM " + reg.host + "/base:onbuild\n",
			platform:   "linux/arm64",
			check: func(t *testing.T, _ v1.Image, err error) {
				var be *BuildError
				if !errors.As(err, &be) || be.Line != 1 || !strings.Contains(err.Error(), "is for linux/amd64, not linux/arm64") {
					t.Fatalf("err = %v", err)
				}
			},
		},
		{
			name:       "a missing image is a pull error, not a BuildError",
			dockerfile: "FROM " + reg.host + "/missing:v1\n",
			check: func(t *testing.T, _ v1.Image, err error) {
				var be *BuildError
				if err == nil || errors.As(err, &be) {
					t.Fatalf("err = %v, want a non-BuildError", err)
				}
				if !strings.Contains(err.Error(), "pull base image "+reg.host+"/missing:v1") {
					t.Errorf("error %q lacks pull context", err)
				}
			},
		},
		{
			name:       "an unreachable registry is a pull error",
			dockerfile: "FROM 127.0.0.1:1/nothing:v1\n",
			check: func(t *testing.T, _ v1.Image, err error) {
				var be *BuildError
				if err == nil || errors.As(err, &be) || !strings.Contains(err.Error(), "pull base image") {
					t.Fatalf("err = %v, want a pull error", err)
				}
			},
		},
		{
			name:       "a base layer that cannot be fetched is a pull error",
			dockerfile: "FROM " + reg.host + "/broken:v1\nCOPY onbuild.txt /x\n",
			check: func(t *testing.T, _ v1.Image, err error) {
				var be *BuildError
				if err == nil || errors.As(err, &be) || !strings.Contains(err.Error(), "pull base image "+reg.host+"/broken:v1") {
					t.Fatalf("err = %v, want a pull error", err)
				}
			},
		},
		{
			name:       "COPY --from a stage built on a registry image",
			dockerfile: "FROM " + reg.host + "/base:v1 AS distro\nFROM scratch\nCOPY --from=distro /etc/passwd /etc/group /etc/\nCOPY --from=distro /bin /bin\n",
			check: func(t *testing.T, img v1.Image, err error) {
				if err != nil {
					t.Fatal(err)
				}
				fs := flatten(t, img)
				if !strings.Contains(fs["etc/passwd"].content, "app:x:1001") || fs["bin/sh"].content != "#!shell" {
					t.Errorf("copied files: passwd %q, sh %q", fs["etc/passwd"].content, fs["bin/sh"].content)
				}
				if _, ok := fs["from-trigger.txt"]; ok {
					t.Error("the scratch stage ran the other stage's trigger")
				}
			},
		},
		{
			name:       "an ONBUILD RUN trigger is reported at the FROM line",
			dockerfile: "# base with triggers\nFROM " + reg.host + "/base:onbuild\n",
			check: func(t *testing.T, _ v1.Image, err error) {
				var be *BuildError
				if !errors.Is(err, ErrRunNotSupported) || !errors.As(err, &be) || be.Line != 2 {
					t.Fatalf("err = %v, want ErrRunNotSupported at line 2", err)
				}
			},
		},
		{
			name:       "chown by an unknown name in a real base",
			dockerfile: "FROM " + reg.host + "/base:v1\nCOPY --chown=ghost onbuild.txt /x\n",
			check: func(t *testing.T, _ v1.Image, err error) {
				var be *BuildError
				if !errors.As(err, &be) || be.Line != 2 || !strings.Contains(err.Error(), `user "ghost" not found`) {
					t.Fatalf("err = %v", err)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			img, err := tryBuild(t, Options{ContextDir: writeContext(t, tc.dockerfile, files), Platform: tc.platform})
			tc.check(t, img, err)
		})
	}
}

// TestAllowedRegistries: a FROM or COPY --from of a registry that is not
// allowed is a build error naming it, and nothing is sent anywhere.
func TestAllowedRegistries(t *testing.T) {
	t.Parallel()
	reg := startRegistry(t)
	for name, c := range map[string]struct{ dockerfile, refused string }{
		"FROM":        {"FROM 169.254.169.254/latest/meta-data:v1\n", "169.254.169.254"},
		"COPY --from": {"FROM scratch\nCOPY --from=10.0.0.5:5000/x/y:1 /a /a\n", "10.0.0.5:5000"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			transport := &countingTransport{}
			_, err := tryBuild(t, Options{ContextDir: writeContext(t, c.dockerfile, nil), AllowedRegistries: []string{"registry.example.com", reg.host},
				Remote: []remote.Option{remote.WithTransport(transport)}})
			var be *BuildError
			if !errors.As(err, &be) || !strings.Contains(err.Error(), "registry "+c.refused+" is not one this builder may pull from (allowed: registry.example.com, "+reg.host+")") {
				t.Fatalf("Build: %v, want a build error naming the refused registry", err)
			}
			if n := transport.n.Load(); n != 0 {
				t.Errorf("%d requests went out", n)
			}
		})
	}
	// docker.io names Docker Hub as FROM alpine does (index.docker.io): the
	// refusal is of the other registry, not of a spelling.
	_, err := tryBuild(t, Options{ContextDir: writeContext(t, "FROM alpine:3\n", nil), AllowedRegistries: []string{"docker.io"},
		Remote: []remote.Option{remote.WithTransport(roundTripFunc(func(*http.Request) (*http.Response, error) {
			return nil, errors.New("offline")
		}))}})
	if err == nil || strings.Contains(err.Error(), "is not one this builder may pull from") {
		t.Fatalf("FROM alpine with docker.io allowed: %v, want a pull attempt", err)
	}
	// The allowed one is used as before.
	build(t, Options{ContextDir: writeContext(t, "FROM "+reg.host+"/tools:1\n", nil), AllowedRegistries: []string{reg.host}})
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestLimits: each limit of the local executor trips with a build error
// that names it, long before the input is worked through.
func TestLimits(t *testing.T) {
	t.Parallel()
	reg := startRegistry(t)
	var many []tar.Header
	for i := range 200 {
		many = append(many, tar.Header{Name: fmt.Sprintf("f%03d", i), Typeflag: tar.TypeReg, Mode: 0o644})
	}
	deep := strings.Repeat("d/", 20) + "file"
	cases := []struct {
		name       string
		dockerfile string
		files      map[string]file
		limits     Limits
		want       string
	}{
		{"spooled bytes", "FROM scratch\nADD big.tar /x/\n",
			map[string]file{"big.tar": {content: string(makeTar(t, false, []tar.Header{{Name: "big", Typeflag: tar.TypeReg, Mode: 0o644, Size: 4096}}, map[string]string{"big": strings.Repeat("x", 4096)}))}},
			Limits{SpoolBytes: 1024}, "more than 1024 bytes of file content held on disk"},
		{"entries", "FROM scratch\nADD many.tar /x/\n",
			map[string]file{"many.tar": {content: string(makeTar(t, true, many, nil))}},
			Limits{Entries: 100}, "more than 100 filesystem entries"},
		{"depth", "FROM scratch\nADD deep.tar /x/\n",
			map[string]file{"deep.tar": {content: string(makeTar(t, false, []tar.Header{{Name: deep, Typeflag: tar.TypeReg, Mode: 0o644}}, nil))}},
			Limits{Depth: 10}, "directories deep, more than 10"},
		{"base image size", "FROM " + reg.host + "/tools:1\n", nil,
			Limits{BaseImageBytes: 10}, "base images of more than 10 bytes"},
		{"new layers count too", "FROM scratch\nCOPY f /f\n",
			map[string]file{"f": {content: strings.Repeat("incompressible? no, but over 64 bytes anyway ", 10)}},
			Limits{SpoolBytes: 64}, "more than 64 bytes of file content held on disk"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := tryBuild(t, Options{ContextDir: writeContext(t, c.dockerfile, c.files), Limits: c.limits})
			var be *BuildError
			if !errors.As(err, &be) || !strings.Contains(err.Error(), "local executor limit") || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Build: %v, want a build error with %q", err, c.want)
			}
		})
	}
}

// TestLayerDir: with LayerDir the new layers are files there, and the image
// is the same as the one built in memory.
func TestLayerDir(t *testing.T) {
	t.Parallel()
	ctxDir := writeContext(t, "FROM scratch\nCOPY a /a\nCOPY b /b\n", map[string]file{"a": {content: "a"}, "b": {content: "b"}})
	dir := t.TempDir()
	onDisk := build(t, Options{ContextDir: ctxDir, LayerDir: dir})
	inMemory := build(t, Options{ContextDir: ctxDir})
	d1, err := onDisk.Digest()
	if err != nil {
		t.Fatal(err)
	}
	d2, _ := inMemory.Digest()
	if d1 != d2 {
		t.Fatalf("digest on disk %s, in memory %s", d1, d2)
	}
	files, _ := os.ReadDir(dir)
	if len(files) != 2 {
		t.Fatalf("%d files in LayerDir, want 2 layers", len(files))
	}
}

// TestLongNamesAreRefused: an entry whose name or PAX records exceed the
// per-entry bounds stops the build instead of being held in memory.
func TestLongNamesAreRefused(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("n", 5000)
	for name, hdr := range map[string]tar.Header{
		"name":        {Name: long, Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX},
		"link target": {Name: "l", Typeflag: tar.TypeSymlink, Linkname: long, Mode: 0o777, Format: tar.FormatPAX},
		"PAX records": {Name: "x", Typeflag: tar.TypeReg, Mode: 0o644, PAXRecords: map[string]string{"SCHILY.xattr.user.big": strings.Repeat("v", 70<<10)}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			files := map[string]file{"a.tar": {content: string(makeTar(t, false, []tar.Header{hdr}, nil))}}
			_, err := tryBuild(t, Options{ContextDir: writeContext(t, "FROM scratch\nADD a.tar /x/\n", files)})
			if err == nil || !strings.Contains(err.Error(), "local executor limit") {
				t.Fatalf("Build: %v, want a limit error", err)
			}
		})
	}
}
