package contexttar

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
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

func TestWriteFollowsRootSymlinkOnly(t *testing.T) {
	t.Parallel()
	root := newTree(t, tree{"f": file("x"), "l": link("f")}, buildOpts{})
	alias := filepath.Join(t.TempDir(), "alias")
	if err := os.Symlink(root, alias); err != nil {
		t.Fatal(err)
	}
	_, tgz := pack(t, alias, Options{})
	got := readArchive(t, tgz)
	if len(got) != 2 || got[0].hdr.Name != "f" || got[1].hdr.Typeflag != tar.TypeSymlink || got[1].hdr.Linkname != "f" {
		t.Errorf("archive of a symlinked root = %+v, want file f and symlink l -> f", got)
	}
}
