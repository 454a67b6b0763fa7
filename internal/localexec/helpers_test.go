package localexec

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

// file describes one entry of a test build context.
type file struct {
	content string
	mode    os.FileMode // 0 means 0644 for files
	symlink string      // when set, the entry is a symlink to this target
	dir     bool
}

// writeContext creates a build context in a fresh temp dir.
func writeContext(t *testing.T, dockerfile string, files map[string]file) string {
	t.Helper()
	dir := t.TempDir()
	if dockerfile != "" {
		files = withFile(files, "Dockerfile", file{content: dockerfile})
	}
	writeFiles(t, dir, files)
	return dir
}

func withFile(files map[string]file, name string, f file) map[string]file {
	out := map[string]file{}
	for k, v := range files {
		out[k] = v
	}
	out[name] = f
	return out
}

func writeFiles(t *testing.T, dir string, files map[string]file) {
	t.Helper()
	for name, f := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		switch {
		case f.symlink != "":
			if err := os.Symlink(f.symlink, p); err != nil {
				t.Fatal(err)
			}
		case f.dir:
			mode := f.mode
			if mode == 0 {
				mode = 0o755
			}
			if err := os.MkdirAll(p, mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, mode); err != nil {
				t.Fatal(err)
			}
		default:
			mode := f.mode
			if mode == 0 {
				mode = 0o644
			}
			if err := os.WriteFile(p, []byte(f.content), mode); err != nil {
				t.Fatal(err)
			}
			// WriteFile is subject to the umask; tests assert exact modes.
			if err := os.Chmod(p, mode); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// build runs Build with a test timeout and fails the test on error.
func build(t *testing.T, opts Options) v1.Image {
	t.Helper()
	img, err := tryBuild(t, opts)
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	return img
}

func tryBuild(t *testing.T, opts Options) (v1.Image, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return Build(ctx, opts)
}

// entry is a tar header plus content, as read back from a layer.
type entry struct {
	name     string
	typ      byte
	mode     int64
	uid, gid int
	linkname string
	mtime    time.Time
	content  string
}

func readTar(t *testing.T, r io.Reader) []entry {
	t.Helper()
	var out []entry
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, entry{
			name: hdr.Name, typ: hdr.Typeflag, mode: hdr.Mode, uid: hdr.Uid, gid: hdr.Gid,
			linkname: hdr.Linkname, mtime: hdr.ModTime, content: string(data),
		})
	}
}

func layerEntries(t *testing.T, l v1.Layer) []entry {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	return readTar(t, rc)
}

// imageLayers reads every layer of img, base first.
func imageLayers(t *testing.T, img v1.Image) [][]entry {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	out := make([][]entry, len(ls))
	for i, l := range ls {
		out[i] = layerEntries(t, l)
	}
	return out
}

// flatten is the image filesystem as a container would see it.
func flatten(t *testing.T, img v1.Image) map[string]entry {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	out := map[string]entry{}
	for _, e := range readTar(t, rc) {
		out[strings.TrimSuffix(e.name, "/")] = e
	}
	// Extract reports errors only past its end-of-archive marker.
	if _, err := io.Copy(io.Discard, rc); err != nil {
		t.Fatalf("extract: %v", err)
	}
	return out
}

func names(es []entry) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.name
	}
	return out
}

func configOf(t *testing.T, img v1.Image) *v1.ConfigFile {
	t.Helper()
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	return cf
}

func digestOf(t *testing.T, img v1.Image) v1.Hash {
	t.Helper()
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func equalStrings(a, b []string) bool { return slices.Equal(a, b) }

// makeTar builds an in-memory tar (gzip-compressed when gz is set).
func makeTar(t *testing.T, gz bool, entries []tar.Header, contents map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w io.Writer = &buf
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = zw
	}
	tw := tar.NewWriter(w)
	for _, h := range entries {
		data := contents[h.Name]
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(data))
		}
		if h.ModTime.IsZero() {
			h.ModTime = time.Date(2021, 5, 4, 3, 2, 1, 0, time.UTC)
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := io.WriteString(tw, data); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if zw != nil {
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
	}
	return buf.Bytes()
}

// configView wraps a config for compact assertions.
type configView struct{ cf *v1.ConfigFile }

func (c *configView) eq(t *testing.T, what string, got, want any) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s = %#v, want %#v", what, got, want)
	}
}

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

func itoa(i int) string { return strconv.Itoa(i) }

func contextWithCancel() (context.Context, context.CancelFunc) {
	return context.WithCancel(context.Background())
}
