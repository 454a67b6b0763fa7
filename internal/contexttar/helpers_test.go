package contexttar

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// node is one path of a test tree: a regular file (the default), a
// directory or a symlink.
type node struct {
	content string
	mode    fs.FileMode // permission bits; 0 means 0644 for files, 0755 for dirs
	dir     bool
	link    string // symlink target; makes the node a symlink
}

// file, exe, dir and link build nodes tersely.
func file(content string) node { return node{content: content} }
func exe(content string) node  { return node{content: content, mode: 0o755} }
func dirNode() node            { return node{dir: true} }
func link(target string) node  { return node{link: target} }

// tree maps slash paths (no trailing slash) to nodes. Missing parents are
// created as directories.
type tree map[string]node

// with returns a copy of t with the given paths set.
func (t tree) with(extra tree) tree {
	out := make(tree, len(t)+len(extra))
	for k, v := range t {
		out[k] = v
	}
	for k, v := range extra {
		out[k] = v
	}
	return out
}

// buildOpts varies how makeTree lays a tree out on disk, to prove the
// archive does not depend on it.
type buildOpts struct {
	reverse  bool        // create paths in reverse order
	mtime    time.Time   // set on every file and directory (zero: leave)
	dirMode  fs.FileMode // mode for directories without one (0: 0755)
	fileMode fs.FileMode // mode for non-executable files without one (0: 0644)
	exeMode  fs.FileMode // mode for executables (0: their own)
	owner    int         // uid and gid to chown to when running as root (0: leave)
}

// makeTree creates tr under dir.
func makeTree(t testing.TB, dir string, tr tree, o buildOpts) {
	t.Helper()
	names := make([]string, 0, len(tr))
	for name := range tr {
		names = append(names, name)
	}
	slices.Sort(names)
	if o.reverse {
		slices.Reverse(names)
	}
	dirMode := o.dirMode
	if dirMode == 0 {
		dirMode = 0o755
	}
	for _, name := range names {
		n := tr[name]
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), dirMode); err != nil {
			t.Fatal(err)
		}
		switch {
		case n.link != "":
			if err := os.Symlink(n.link, p); err != nil {
				t.Fatal(err)
			}
		case n.dir:
			mode := n.mode
			if mode == 0 {
				mode = dirMode
			}
			if err := os.MkdirAll(p, mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, mode); err != nil {
				t.Fatal(err)
			}
		default:
			mode := n.mode
			switch {
			case mode == 0 && o.fileMode != 0:
				mode = o.fileMode
			case mode == 0:
				mode = 0o644
			case mode&0o111 != 0 && o.exeMode != 0:
				mode = o.exeMode
			}
			if err := os.WriteFile(p, []byte(n.content), mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, mode); err != nil { // beat the umask
				t.Fatal(err)
			}
		}
	}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type()&fs.ModeSymlink == 0 && d.IsDir() {
			if err := os.Chmod(p, dirModeOf(tr, dir, p, dirMode)); err != nil {
				return err
			}
		}
		if o.owner != 0 && os.Geteuid() == 0 {
			if err := os.Lchown(p, o.owner, o.owner); err != nil {
				return err
			}
		}
		if !o.mtime.IsZero() && d.Type()&fs.ModeSymlink == 0 {
			if err := os.Chtimes(p, o.mtime, o.mtime); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// dirModeOf is the mode makeTree gives directory p: its node's, or the
// default (implicit parents, made before their mode was known).
func dirModeOf(tr tree, root, p string, def fs.FileMode) fs.FileMode {
	rel, err := filepath.Rel(root, p)
	if err == nil {
		if n, ok := tr[filepath.ToSlash(rel)]; ok && n.mode != 0 {
			return n.mode
		}
	}
	return def
}

// newTree creates tr in a fresh temporary directory and returns it.
func newTree(t testing.TB, tr tree, o buildOpts) string {
	t.Helper()
	dir := t.TempDir()
	makeTree(t, dir, tr, o)
	return dir
}

// pack runs Write on dir and returns its result and the tar.gz bytes.
func pack(t testing.TB, dir string, opts Options) (Result, []byte) {
	t.Helper()
	var buf bytes.Buffer
	res, err := Write(context.Background(), dir, &buf, opts)
	if err != nil {
		t.Fatalf("Write(%s): %v", dir, err)
	}
	return res, buf.Bytes()
}

// digestOf packs dir and returns only the digest.
func digestOf(t testing.TB, dir string, opts Options) string {
	t.Helper()
	res, _ := pack(t, dir, opts)
	return res.Digest
}

// entry is a header read back from an archive, with its content.
type entry struct {
	hdr  *tar.Header
	body string
}

// gunzip returns the uncompressed bytes of a tar.gz.
func gunzip(t testing.TB, tgz []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(tgz))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// readArchive reads every entry of a tar.gz with archive/tar.
func readArchive(t testing.TB, tgz []byte) []entry {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(gunzip(t, tgz)))
	var out []entry
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, entry{hdr: hdr, body: string(body)})
	}
}

// names returns the entry names of a tar.gz, in archive order.
func names(t testing.TB, tgz []byte) []string {
	t.Helper()
	var out []string
	for _, e := range readArchive(t, tgz) {
		out = append(out, e.hdr.Name)
	}
	return out
}

// wantNames is the sorted list of tar names for the given paths plus all
// their parent directories; paths ending in "/" are directories.
func wantNames(paths ...string) []string {
	set := map[string]bool{}
	for _, p := range paths {
		set[p] = true
		for d := path.Dir(strings.TrimSuffix(p, "/")); d != "."; d = path.Dir(d) {
			set[d+"/"] = true
		}
	}
	out := make([]string, 0, len(set))
	for p := range set {
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// tarEntry describes one entry of a hand-made archive.
type tarEntry struct {
	name     string
	typ      byte
	body     string
	linkname string
	mode     int64
}

// makeTar builds an uncompressed tar from entries, the way an attacker
// would: no validation beyond what archive/tar insists on.
func makeTar(t testing.TB, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		hdr := &tar.Header{Name: e.name, Typeflag: typ, Mode: mode, Linkname: e.linkname}
		if typ == tar.TypeReg {
			hdr.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatalf("header %q: %v", e.name, err)
		}
		if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// gz compresses raw.
func gz(t testing.TB, raw []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(raw); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// sandbox is a temporary directory holding the extraction directory dst
// and, beside it, outside/sentinel: anything Extract creates other than
// under dst shows up as a change to the sandbox.
type sandbox struct {
	parent, dst, outside string
}

// sentinelContent is what outside/sentinel holds.
const sentinelContent = "do not touch"

// newSandbox lays out a sandbox.
func newSandbox(t testing.TB) sandbox {
	t.Helper()
	parent := t.TempDir()
	s := sandbox{parent: parent, dst: filepath.Join(parent, "dst"), outside: filepath.Join(parent, "outside")}
	for _, d := range []string{s.dst, s.outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(s.outside, "sentinel"), []byte(sentinelContent), 0o644); err != nil {
		t.Fatal(err)
	}
	return s
}

// assertUntouched fails unless the sandbox outside dst is exactly as laid
// out: parent holds only dst and outside, outside holds only the unchanged
// sentinel.
func (s sandbox) assertUntouched(t testing.TB) {
	t.Helper()
	if got := listDir(t, s.parent); !slices.Equal(got, []string{"dst", "outside"}) {
		t.Errorf("parent of dst holds %q, want only [dst outside]", got)
	}
	if got := listDir(t, s.outside); !slices.Equal(got, []string{"sentinel"}) {
		t.Errorf("outside holds %q, want only [sentinel]", got)
	}
	if b, err := os.ReadFile(filepath.Join(s.outside, "sentinel")); err != nil || string(b) != sentinelContent {
		t.Errorf("sentinel changed: %q, %v", b, err)
	}
}

// listDir returns the sorted names in dir.
func listDir(t testing.TB, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// snapshot describes a directory tree as a map of slash path to a string
// holding kind, permission bits and content or target: two trees with equal
// snapshots have the same normalized content.
func snapshot(t testing.TB, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		rel = filepath.ToSlash(rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			out[rel] = "symlink -> " + target
		case fi.IsDir():
			out[rel] = "dir " + fi.Mode().Perm().String()
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[rel] = "file " + fi.Mode().Perm().String() + " " + string(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
