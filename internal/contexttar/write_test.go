package contexttar

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// sample is a small context with every kind of entry Write keeps.
var sample = tree{
	"Dockerfile":              file("FROM scratch\nCOPY . /\n"),
	"README.md":               file("# sample\n"),
	"a.txt":                   file("a dot txt sorts before the a/ directory\n"),
	"a/b.txt":                 file("nested\n"),
	"a/deep/er/file.go":       file("package er\n"),
	"bin/run.sh":              exe("#!/bin/sh\necho hi\n"),
	"empty":                   dirNode(),
	"links/to-readme":         link("../README.md"),
	"links/dangling":          link("does/not/exist"),
	"links/absolute":          link("/usr/bin/env"),
	"unicode/héllo wörld.txt": file("non-ASCII names need PAX records\n"),
	strings.Repeat("long-directory-name/", 6) + "file.txt": file("a name over 100 bytes\n"),
}

func TestWriteIsReproducible(t *testing.T) {
	t.Parallel()
	base := buildOpts{mtime: time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)}
	tests := []struct {
		name  string
		other buildOpts
	}{
		{"different creation order and mtimes", buildOpts{reverse: true, mtime: time.Date(2024, 7, 8, 9, 10, 11, 123456789, time.UTC)}},
		{"different permission bits that normalize alike", buildOpts{dirMode: 0o700, fileMode: 0o600, exeMode: 0o700}},
		{"different owner", buildOpts{owner: 4242, mtime: time.Unix(1, 0)}},
	}
	wantRes, wantBytes := pack(t, newTree(t, sample, base), Options{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if tt.other.owner != 0 && os.Geteuid() != 0 {
				t.Skip("changing owners needs root")
			}
			res, got := pack(t, newTree(t, sample, tt.other), Options{})
			if res != wantRes {
				t.Errorf("Result = %+v, want %+v", res, wantRes)
			}
			if !bytes.Equal(got, wantBytes) {
				t.Errorf("tar.gz bytes differ (%d vs %d bytes)", len(got), len(wantBytes))
			}
		})
	}
}

func TestWriteResultDescribesTheStream(t *testing.T) {
	t.Parallel()
	res, tgz := pack(t, newTree(t, sample, buildOpts{}), Options{})
	raw := gunzip(t, tgz)
	sum := sha256.Sum256(raw)
	if want := "sha256:" + hex.EncodeToString(sum[:]); res.Digest != want {
		t.Errorf("Digest = %s, want sha256 of the uncompressed tar %s", res.Digest, want)
	}
	if res.Size != int64(len(raw)) {
		t.Errorf("Size = %d, want uncompressed length %d", res.Size, len(raw))
	}
	if n := len(readArchive(t, tgz)); res.Files != n {
		t.Errorf("Files = %d, archive has %d entries", res.Files, n)
	}
}

func TestWriteNormalizesHeaders(t *testing.T) {
	t.Parallel()
	dir := newTree(t, sample, buildOpts{mtime: time.Now(), owner: 1000, fileMode: 0o640, dirMode: 0o750})
	_, tgz := pack(t, dir, Options{})

	t.Run("gzip header has no name and no mtime", func(t *testing.T) {
		t.Parallel()
		zr, err := gzip.NewReader(bytes.NewReader(tgz))
		if err != nil {
			t.Fatal(err)
		}
		if zr.Name != "" || zr.Comment != "" || zr.Extra != nil || !zr.ModTime.IsZero() {
			t.Errorf("gzip header = %+v, want empty name/comment/extra and zero mtime", zr.Header)
		}
		if !bytes.Equal(tgz[4:8], []byte{0, 0, 0, 0}) {
			t.Errorf("gzip MTIME field = % x, want zeros", tgz[4:8])
		}
	})

	entries := readArchive(t, tgz)
	var got []string
	for _, e := range entries {
		got = append(got, e.hdr.Name)
	}
	t.Run("names sorted bytewise with parents first", func(t *testing.T) {
		t.Parallel()
		if !slices.IsSorted(got) {
			t.Errorf("names not sorted: %q", got)
		}
		seen := map[string]bool{}
		for _, name := range got {
			if parent := filepath.Dir(strings.TrimSuffix(name, "/")); parent != "." && !seen[parent+"/"] {
				t.Errorf("%q comes before its parent %q", name, parent+"/")
			}
			seen[name] = true
		}
		// "a.txt" < "a/": the trailing slash takes part in the order.
		if i, j := slices.Index(got, "a.txt"), slices.Index(got, "a/"); i < 0 || j < 0 || i > j {
			t.Errorf("want a.txt before a/, got %q", got)
		}
	})
	t.Run("names relative with directories slash-terminated", func(t *testing.T) {
		t.Parallel()
		keys := make([]string, 0, len(sample))
		for p, n := range sample {
			if n.dir {
				p += "/"
			}
			keys = append(keys, p)
		}
		if want := wantNames(keys...); !slices.Equal(got, want) {
			t.Errorf("names = %q\nwant    %q", got, want)
		}
	})
	t.Run("fixed metadata and normalized modes", func(t *testing.T) {
		t.Parallel()
		for _, e := range entries {
			h := e.hdr
			if h.Uid != 0 || h.Gid != 0 || h.Uname != "" || h.Gname != "" {
				t.Errorf("%s: owner %d:%d %q:%q, want 0:0 and no names", h.Name, h.Uid, h.Gid, h.Uname, h.Gname)
			}
			if h.ModTime.Unix() != 0 || !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() {
				t.Errorf("%s: times %v %v %v, want epoch mtime only", h.Name, h.ModTime, h.AccessTime, h.ChangeTime)
			}
			if h.Devmajor != 0 || h.Devminor != 0 {
				t.Errorf("%s: device numbers set", h.Name)
			}
			for k := range h.PAXRecords {
				if k != "path" && k != "linkpath" {
					t.Errorf("%s: unexpected PAX record %q", h.Name, k)
				}
			}
			var want int64
			switch h.Typeflag {
			case tar.TypeDir:
				want = 0o755
			case tar.TypeSymlink:
				want = 0o777
				if n := sample[h.Name]; h.Linkname != n.link {
					t.Errorf("%s: link target %q, want %q", h.Name, h.Linkname, n.link)
				}
			case tar.TypeReg:
				want = 0o644
				if sample[h.Name].mode&0o111 != 0 {
					want = 0o755
				}
				if e.body != sample[h.Name].content {
					t.Errorf("%s: content %q, want %q", h.Name, e.body, sample[h.Name].content)
				}
			default:
				t.Errorf("%s: unexpected type %q", h.Name, h.Typeflag)
			}
			if h.Mode != want {
				t.Errorf("%s: mode %o, want %o", h.Name, h.Mode, want)
			}
		}
	})
}

func TestWriteAppliesDockerignore(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		ignore   string
		files    tree
		kept     []string // paths of files that must survive; dirs with a trailing slash
		excluded []string // paths that must be absent
	}{
		{
			name:     "excluded file",
			ignore:   "secret.env\n",
			files:    tree{"a.txt": file("a"), "secret.env": file("TOKEN=1"), "src/main.go": file("package main")},
			kept:     []string{"a.txt", "src/main.go"},
			excluded: []string{"secret.env"},
		},
		{
			name:     "excluded directory",
			ignore:   "node_modules/\n",
			files:    tree{"app.js": file("x"), "node_modules/z.js": file("z"), "node_modules/x/y.js": file("y")},
			kept:     []string{"app.js"},
			excluded: []string{"node_modules/", "node_modules/z.js", "node_modules/x/y.js"},
		},
		{
			name:     "exception re-includes a file",
			ignore:   "*.log\n!keep.log\n",
			files:    tree{"a.log": file("a"), "b.log": file("b"), "keep.log": file("k"), "main.go": file("m")},
			kept:     []string{"keep.log", "main.go"},
			excluded: []string{"a.log", "b.log"},
		},
		{
			name:     "exception inside an excluded directory",
			ignore:   "build\n!build/keep.txt\n",
			files:    tree{"build/out.bin": file("o"), "build/keep.txt": file("k"), "build/sub/x": file("x"), "main.go": file("m")},
			kept:     []string{"build/keep.txt", "main.go"},
			excluded: []string{"build/out.bin", "build/sub/", "build/sub/x"},
		},
		{
			name:     "exception re-includes a subdirectory",
			ignore:   "assets\n!assets/img\n",
			files:    tree{"assets/css/a.css": file("c"), "assets/img/logo.png": file("l"), "assets/img/sub/x.png": file("x")},
			kept:     []string{"assets/img/logo.png", "assets/img/sub/x.png"},
			excluded: []string{"assets/css/", "assets/css/a.css"},
		},
		{
			name:     "wildcard exception walks into an excluded directory",
			ignore:   "cache\n!cache/**/*.keep\n",
			files:    tree{"cache/a/b.keep": file("b"), "cache/a/c.tmp": file("c"), "cache/d.tmp": file("d"), "x.txt": file("x")},
			kept:     []string{"cache/a/b.keep", "x.txt"},
			excluded: []string{"cache/a/c.tmp", "cache/d.tmp"},
		},
		{
			name:     "exception matching nothing leaves no empty directory",
			ignore:   "vendor\n!vendor/missing.go\n",
			files:    tree{"vendor/a.go": file("a"), "main.go": file("m")},
			kept:     []string{"main.go"},
			excluded: []string{"vendor/", "vendor/a.go"},
		},
		{
			name:     "double star excludes at any depth",
			ignore:   "**/*.tmp\n",
			files:    tree{"a.tmp": file("a"), "d/b.tmp": file("b"), "d/e/c.tmp": file("c"), "d/keep.txt": file("k")},
			kept:     []string{"d/e/", "d/keep.txt"},
			excluded: []string{"a.tmp", "d/b.tmp", "d/e/c.tmp"},
		},
		{
			name:     "single star stays in one directory",
			ignore:   "*.md\n",
			files:    tree{"README.md": file("r"), "docs/guide.md": file("g")},
			kept:     []string{"docs/guide.md"},
			excluded: []string{"README.md"},
		},
		{
			name:     "comments blank lines and leading slash",
			ignore:   "# a comment\n\n   /secret   \n",
			files:    tree{"secret": file("s"), "public": file("p"), "sub/secret": file("nested, not matched")},
			kept:     []string{"public", "sub/secret"},
			excluded: []string{"secret"},
		},
		{
			name:     "later pattern overrides an exception",
			ignore:   "*.txt\n!important.txt\nimportant.txt\n",
			files:    tree{"important.txt": file("i"), "notes.txt": file("n"), "main.go": file("m")},
			kept:     []string{"main.go"},
			excluded: []string{"important.txt", "notes.txt"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ignore := tree{".dockerignore": file(tt.ignore)}
			full := newTree(t, tt.files.with(ignore), buildOpts{})

			// The copy holds only what must survive, with the same
			// .dockerignore (which is itself part of the context).
			only := ignore.with(nil)
			for _, p := range tt.kept {
				if strings.HasSuffix(p, "/") {
					only[strings.TrimSuffix(p, "/")] = dirNode()
				} else {
					only[p] = tt.files[p]
				}
			}
			without := newTree(t, only, buildOpts{reverse: true})

			res, tgz := pack(t, full, Options{})
			if want := digestOf(t, without, Options{}); res.Digest != want {
				t.Errorf("digest with excluded files %s != digest of a copy without them %s", res.Digest, want)
			}
			got := names(t, tgz)
			if want := wantNames(append([]string{".dockerignore"}, tt.kept...)...); !slices.Equal(got, want) {
				t.Errorf("archive names = %q\nwant             %q", got, want)
			}
			for _, p := range tt.excluded {
				if slices.Contains(got, p) {
					t.Errorf("excluded %q is in the archive", p)
				}
			}
		})
	}
}

func TestWriteKeepsDockerfileAndDockerignore(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		ignore     string
		dockerfile string
		files      tree
		want       []string
	}{
		{
			name:   "everything excluded",
			ignore: "*\n",
			files:  tree{"Dockerfile": file("FROM scratch"), "main.go": file("m")},
			want:   []string{".dockerignore", "Dockerfile"},
		},
		{
			name:   "both listed by name",
			ignore: "Dockerfile\n.dockerignore\n",
			files:  tree{"Dockerfile": file("FROM scratch"), "main.go": file("m")},
			want:   []string{".dockerignore", "Dockerfile", "main.go"},
		},
		{
			name:       "custom Dockerfile in an excluded directory",
			ignore:     "build\n",
			dockerfile: "build/prod.Dockerfile",
			files:      tree{"build/prod.Dockerfile": file("FROM scratch"), "build/other": file("o"), "main.go": file("m")},
			want:       []string{".dockerignore", "build/prod.Dockerfile", "main.go"},
		},
		{
			name:       "custom Dockerfile given with ./",
			ignore:     "*.Dockerfile\n",
			dockerfile: "./ci.Dockerfile",
			files:      tree{"ci.Dockerfile": file("FROM scratch"), "old.Dockerfile": file("o")},
			want:       []string{".dockerignore", "ci.Dockerfile"},
		},
		{
			name:       "Dockerfile name with pattern characters",
			ignore:     "*\n",
			dockerfile: "Dockerfile.[prod]",
			files:      tree{"Dockerfile.[prod]": file("FROM scratch"), "Dockerfile.p": file("decoy")},
			want:       []string{".dockerignore", "Dockerfile.[prod]"},
		},
		{
			name:   "missing Dockerfile is not an error",
			ignore: "*\n",
			files:  tree{"main.go": file("m")},
			want:   []string{".dockerignore"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := newTree(t, tt.files.with(tree{".dockerignore": file(tt.ignore)}), buildOpts{})
			_, tgz := pack(t, dir, Options{Dockerfile: tt.dockerfile})
			if got, want := names(t, tgz), wantNames(tt.want...); !slices.Equal(got, want) {
				t.Errorf("archive names = %q, want %q", got, want)
			}
		})
	}
}

func TestWriteDigestTracksContent(t *testing.T) {
	t.Parallel()
	base := tree{
		"Dockerfile":  file("FROM scratch\n"),
		"src/main.go": file("package main\n"),
		"run.sh":      file("#!/bin/sh\n"),
		"tool":        exe("#!/bin/sh\n"),
		"latest":      link("src/main.go"),
	}
	tests := []struct {
		name     string
		change   tree
		remove   string
		wantSame bool
	}{
		{name: "one byte of a file changed", change: tree{"src/main.go": file("package maim\n")}},
		{name: "exec bit set", change: tree{"run.sh": exe("#!/bin/sh\n")}},
		{name: "exec bit cleared", change: tree{"tool": file("#!/bin/sh\n")}},
		{name: "other-exec bit alone set", change: tree{"run.sh": node{content: "#!/bin/sh\n", mode: 0o645}}},
		{name: "symlink target changed", change: tree{"latest": link("src/other.go")}},
		{name: "file added", change: tree{"src/new.go": file("")}},
		{name: "empty directory added", change: tree{"empty": dirNode()}},
		{name: "file removed", remove: "run.sh"},
		{name: "file renamed", remove: "run.sh", change: tree{"run2.sh": file("#!/bin/sh\n")}},
		{name: "symlink replaced by a copy", change: tree{"latest": file("package main\n")}},
		{name: "write bits do not count", change: tree{"run.sh": node{content: "#!/bin/sh\n", mode: 0o666}}, wantSame: true},
		{name: "which exec bit does not count", change: tree{"tool": node{content: "#!/bin/sh\n", mode: 0o711}}, wantSame: true},
	}
	want := digestOf(t, newTree(t, base, buildOpts{}), Options{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			changed := base.with(tt.change)
			delete(changed, tt.remove)
			got := digestOf(t, newTree(t, changed, buildOpts{}), Options{})
			if same := got == want; same != tt.wantSame {
				t.Errorf("digest same = %v, want %v (%s vs %s)", same, tt.wantSame, got, want)
			}
		})
	}
}

func TestWriteMaxBytes(t *testing.T) {
	t.Parallel()
	files := tree{
		"a":             file(strings.Repeat("a", 100)),
		"b":             file(strings.Repeat("b", 200)),
		"big.iso":       file(strings.Repeat("x", 5000)),
		".dockerignore": file("*.iso\n"),
	}
	total := int64(100 + 200 + len("*.iso\n"))
	dir := newTree(t, files, buildOpts{})
	tests := []struct {
		name     string
		maxBytes int64
		wantErr  error // nil: success
	}{
		{"one byte under the total", total - 1, ErrTooLarge},
		{"far under the total", 1, ErrTooLarge},
		{"exactly the total (excluded files do not count)", total, nil},
		{"zero means the 1 GiB default", 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Write(context.Background(), dir, io.Discard, Options{MaxBytes: tt.maxBytes})
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Write(MaxBytes=%d) error = %v, want %v", tt.maxBytes, err, tt.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), fmt.Sprint(tt.maxBytes)) {
				t.Errorf("error %q does not name the limit %d", err, tt.maxBytes)
			}
		})
	}
	t.Run("negative is refused", func(t *testing.T) {
		t.Parallel()
		_, err := Write(context.Background(), dir, io.Discard, Options{MaxBytes: -1})
		if err == nil || errors.Is(err, ErrTooLarge) {
			t.Fatalf("Write(MaxBytes=-1) error = %v, want a non-ErrTooLarge error", err)
		}
	})
}

func TestWriteReportsProgress(t *testing.T) {
	t.Parallel()
	dir := newTree(t, sample, buildOpts{})
	type call struct {
		bytes int64
		files int
	}
	var calls []call
	res, err := Write(context.Background(), dir, io.Discard, Options{Progress: func(b int64, n int) {
		calls = append(calls, call{b, n})
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != res.Files {
		t.Fatalf("%d progress calls for %d entries", len(calls), res.Files)
	}
	var total int64
	for _, n := range sample {
		if !n.dir && n.link == "" {
			total += int64(len(n.content))
		}
	}
	if last := calls[len(calls)-1]; last != (call{total, res.Files}) {
		t.Errorf("last progress call = %+v, want {%d %d}", last, total, res.Files)
	}
	for i := 1; i < len(calls); i++ {
		if calls[i].files != calls[i-1].files+1 || calls[i].bytes < calls[i-1].bytes {
			t.Fatalf("progress not monotonic at call %d: %+v then %+v", i, calls[i-1], calls[i])
		}
	}
}

func TestWriteRefusesBadInput(t *testing.T) {
	t.Parallel()
	dir := newTree(t, tree{"Dockerfile": file("FROM scratch"), "f": file("x")}, buildOpts{})
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		dir     string
		opts    Options
		wantErr error // nil: any error
	}{
		{name: "Dockerfile outside the context", dir: dir, opts: Options{Dockerfile: "../Dockerfile"}},
		{name: "absolute Dockerfile path", dir: dir, opts: Options{Dockerfile: filepath.Join(dir, "Dockerfile")}},
		{name: "missing directory", dir: filepath.Join(dir, "nope")},
		{name: "regular file instead of a directory", dir: filepath.Join(dir, "f")},
		{name: "cancelled context", ctx: cancelled, dir: dir, wantErr: context.Canceled},
		{name: "invalid pattern in .dockerignore", dir: newTree(t, tree{".dockerignore": file("[\n")}, buildOpts{})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := tt.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			_, err := Write(ctx, tt.dir, io.Discard, tt.opts)
			if err == nil || (tt.wantErr != nil && !errors.Is(err, tt.wantErr)) {
				t.Fatalf("Write error = %v, want %v", err, tt.wantErr)
			}
		})
	}
}

func TestWriteStoresHardLinksAsFiles(t *testing.T) {
	t.Parallel()
	dir := newTree(t, tree{"a": file("shared")}, buildOpts{})
	if err := os.Link(filepath.Join(dir, "a"), filepath.Join(dir, "b")); err != nil {
		t.Skipf("hard links unsupported here: %v", err)
	}
	res, tgz := pack(t, dir, Options{})
	for _, e := range readArchive(t, tgz) {
		if e.hdr.Typeflag != tar.TypeReg || e.body != "shared" {
			t.Errorf("%s: type %q content %q, want a regular file with the content", e.hdr.Name, e.hdr.Typeflag, e.body)
		}
	}
	if want := digestOf(t, newTree(t, tree{"a": file("shared"), "b": file("shared")}, buildOpts{}), Options{}); res.Digest != want {
		t.Errorf("digest with a hard link %s != digest with two copies %s", res.Digest, want)
	}
}

func TestWriteStopsWhenCancelledMidWalk(t *testing.T) {
	t.Parallel()
	dir := newTree(t, sample, buildOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	calls := 0
	_, err := Write(ctx, dir, io.Discard, Options{Progress: func(int64, int) {
		calls++
		cancel()
	}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Write error = %v, want context.Canceled", err)
	}
	if calls != 1 {
		t.Errorf("%d entries written after cancellation, want it to stop after the first", calls-1)
	}
}

// failingWriter fails every write, like an upload whose connection died.
type failingWriter struct{}

var errUpload = errors.New("upload failed")

func (failingWriter) Write([]byte) (int, error) { return 0, errUpload }

func TestWriteReturnsWriterErrors(t *testing.T) {
	t.Parallel()
	_, err := Write(context.Background(), newTree(t, sample, buildOpts{}), failingWriter{}, Options{})
	if !errors.Is(err, errUpload) {
		t.Fatalf("Write error = %v, want the writer's error", err)
	}
}

func TestWriteFollowsRootSymlinkOnly(t *testing.T) {
	t.Parallel()
	real := newTree(t, tree{"f": file("x"), "l": link("f")}, buildOpts{})
	alias := filepath.Join(t.TempDir(), "alias")
	if err := os.Symlink(real, alias); err != nil {
		t.Fatal(err)
	}
	_, tgz := pack(t, alias, Options{})
	got := readArchive(t, tgz)
	if len(got) != 2 || got[0].hdr.Name != "f" || got[1].hdr.Typeflag != tar.TypeSymlink || got[1].hdr.Linkname != "f" {
		t.Errorf("archive of a symlinked root = %+v, want file f and symlink l -> f", got)
	}
}

// TestWriteStreams checks that packing a file does not buffer it: the heap
// allocated while packing a 24 MiB file must stay far below its size. It is
// not parallel because runtime.MemStats counts every goroutine's
// allocations.
func TestWriteStreams(t *testing.T) {
	const size = 24 << 20
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	for range size / len(chunk) {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	res, err := Write(context.Background(), dir, io.Discard, Options{})
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	if res.Size < size {
		t.Fatalf("Size = %d, want at least %d", res.Size, size)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > size/4 {
		t.Errorf("Write allocated %d bytes for a %d-byte file; it should stream", alloc, size)
	}
}

// TestDigestMatchesWrite checks that Digest, which skips the compression,
// returns exactly Write's Result, makes the same progress calls and fails
// the same way, so a context hashed with Digest is named as before.
func TestDigestMatchesWrite(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 4))
	large := make([]byte, 5<<20+1) // several copy buffers, not block-aligned
	for i := range large {
		large[i] = byte(rng.Uint32())
	}
	tests := []struct {
		name string
		tree tree
		opts Options
	}{
		{name: "sample (symlinks, empty directory, PAX names)", tree: sample},
		{name: "empty context", tree: tree{"empty": dirNode()}},
		{
			name: "dockerignore with exceptions",
			tree: tree{
				".dockerignore":         file("node_modules\n*.log\n!keep.log\nbuild\n!build/out/keep\ncache\n!cache/**/*.keep\ndocker\n"),
				"node_modules/x/i.js":   file("x"),
				"a.log":                 file("a"),
				"keep.log":              file("k"),
				"build/tmp/o":           file("o"),
				"build/out/keep":        file("keep"),
				"cache/a/b.keep":        file("b"),
				"cache/a/c.tmp":         file("c"),
				"docker/Dockerfile.dev": file("FROM scratch\n"),
				"src/main.go":           file("package main\n"),
				"src/empty":             dirNode(),
				"src/link":              link("main.go"),
			},
			opts: Options{Dockerfile: "docker/Dockerfile.dev"},
		},
		{name: "large file", tree: tree{"Dockerfile": file("FROM scratch\n"), "big.bin": file(string(large)), "tool": exe("#!/bin/sh\n")}},
		{name: "over the byte cap", tree: sample, opts: Options{MaxBytes: 100}},
	}
	type call struct {
		bytes int64
		files int
	}
	run := func(dir string, opts Options, f func(Options) (Result, error)) (Result, []call, error) {
		var calls []call
		opts.Progress = func(b int64, n int) { calls = append(calls, call{b, n}) }
		res, err := f(opts)
		return res, calls, err
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := newTree(t, tt.tree, buildOpts{})
			want, wantCalls, wantErr := run(dir, tt.opts, func(o Options) (Result, error) {
				return Write(context.Background(), dir, io.Discard, o)
			})
			got, gotCalls, err := run(dir, tt.opts, func(o Options) (Result, error) {
				return Digest(context.Background(), dir, o)
			})
			if fmt.Sprint(err) != fmt.Sprint(wantErr) {
				t.Fatalf("Digest error = %v, Write error = %v", err, wantErr)
			}
			if got != want {
				t.Errorf("Digest = %+v, Write = %+v", got, want)
			}
			if !slices.Equal(gotCalls, wantCalls) {
				t.Errorf("Digest progress = %v, Write progress = %v", gotCalls, wantCalls)
			}
		})
	}
}

// writeBenchContext lays out 64 MiB in 256 files (16 directories of 16
// files of 256 KiB of text-like data, so gzip has real work) and returns
// its root and content size.
func writeBenchContext(b *testing.B) (string, int64) {
	const (
		dirs, filesPerDir = 16, 16
		fileSize          = 256 << 10
	)
	root := b.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte("etaoin shrdlu\n{}();=")
	buf := make([]byte, fileSize)
	for d := range dirs {
		sub := filepath.Join(root, fmt.Sprintf("pkg%02d", d))
		if err := os.Mkdir(sub, 0o755); err != nil {
			b.Fatal(err)
		}
		for f := range filesPerDir {
			for i := range buf {
				buf[i] = alphabet[rng.IntN(len(alphabet))]
			}
			if err := os.WriteFile(filepath.Join(sub, fmt.Sprintf("file%02d.txt", f)), buf, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	return root, dirs * filesPerDir * fileSize
}

// BenchmarkWrite packs writeBenchContext's 64 MiB to io.Discard.
func BenchmarkWrite(b *testing.B) {
	root, size := writeBenchContext(b)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Write(context.Background(), root, io.Discard, Options{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDigest hashes the same 64 MiB as BenchmarkWrite without
// compressing it: the difference between the two is what a hash-only pass
// (s3store.UploadContext's first, `buildq render`'s only) saves.
func BenchmarkDigest(b *testing.B) {
	root, size := writeBenchContext(b)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Digest(context.Background(), root, Options{}); err != nil {
			b.Fatal(err)
		}
	}
}

func TestZeroLimitMeansTheDefault(t *testing.T) {
	t.Parallel()
	if got, err := limit(0); err != nil || got != DefaultMaxBytes {
		t.Fatalf("limit(0) = %d, %v; want %d", got, err, DefaultMaxBytes)
	}
	if got, err := limit(42); err != nil || got != 42 {
		t.Fatalf("limit(42) = %d, %v", got, err)
	}
	if _, err := limit(-1); err == nil {
		t.Fatal("a negative limit was accepted")
	}
}
