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
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteExtractRoundTrip(t *testing.T) {
	t.Parallel()
	files := sample.with(tree{
		"links/inside-dir": link("../a/deep"),
		"a/deep/up":        link("../../bin/run.sh"),
		"private":          node{dir: true, mode: 0o700}, // normalized to 0755
		"private/key":      node{content: "k", mode: 0o600},
	})
	// Extract refuses absolute symlinks, which Write keeps as they are.
	delete(files, "links/absolute")
	src := newTree(t, files, buildOpts{})
	res, tgz := pack(t, src, Options{})

	dst := t.TempDir()
	if err := Extract(context.Background(), bytes.NewReader(tgz), dst, 0); err != nil {
		t.Fatalf("Extract: %v", err)
	}

	want := map[string]string{}
	for p := range files {
		for d := filepath.Dir(p); d != "."; d = filepath.Dir(d) {
			want[filepath.ToSlash(d)] = "dir " + fs.FileMode(0o755).String()
		}
	}
	for p, n := range files {
		switch {
		case n.link != "":
			want[p] = "symlink -> " + n.link
		case n.dir:
			want[p] = "dir " + fs.FileMode(0o755).String()
		case n.mode&0o111 != 0:
			want[p] = "file " + fs.FileMode(0o755).String() + " " + n.content
		default:
			want[p] = "file " + fs.FileMode(0o644).String() + " " + n.content
		}
	}
	got := snapshot(t, dst)
	if !maps.Equal(got, want) {
		for p := range maps.Keys(want) {
			if got[p] != want[p] {
				t.Errorf("%s: got %q, want %q", p, got[p], want[p])
			}
		}
		for p := range maps.Keys(got) {
			if _, ok := want[p]; !ok {
				t.Errorf("%s: unexpected %q", p, got[p])
			}
		}
	}

	// Extracted trees are normalized already: packing one again gives the
	// same archive.
	if again := digestOf(t, dst, Options{}); again != res.Digest {
		t.Errorf("repacked digest %s != original %s", again, res.Digest)
	}
}

func TestExtractRefusesUnsafeEntries(t *testing.T) {
	t.Parallel()
	// A file name no other test or process uses, so the /etc check below
	// cannot be fooled by someone else's file.
	etcProbe := fmt.Sprintf("buildq-contexttar-test-%d", os.Getpid())
	tests := []struct {
		name    string
		setup   func(t *testing.T, s sandbox) // prepare dst before extracting
		entries func(s sandbox) []tarEntry
		check   func(t *testing.T, s sandbox) // extra checks after extracting
	}{
		{
			name: "absolute path",
			entries: func(s sandbox) []tarEntry {
				return []tarEntry{{name: filepath.ToSlash(filepath.Join(s.outside, "abs.txt")), body: "x"}}
			},
		},
		{
			name:    "dot-dot path",
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "../x", body: "x"}} },
		},
		{
			name:    "dot-dot after a component",
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "a/../../x", body: "x"}} },
		},
		{
			name:    "dot-dot directory",
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "../", typ: tar.TypeDir, mode: 0o755}} },
		},
		{
			name: "symlink to /etc then a file through it",
			entries: func(sandbox) []tarEntry {
				return []tarEntry{
					{name: "etc", typ: tar.TypeSymlink, linkname: "/etc"},
					{name: "etc/" + etcProbe, body: "pwned"},
				}
			},
			check: func(t *testing.T, _ sandbox) {
				if _, err := os.Lstat(filepath.Join("/etc", etcProbe)); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("/etc/%s exists (or stat failed: %v)", etcProbe, err)
				}
			},
		},
		{
			name: "symlink to a sibling directory then a file through it",
			entries: func(sandbox) []tarEntry {
				return []tarEntry{
					{name: "out", typ: tar.TypeSymlink, linkname: "../outside"},
					{name: "out/pwned", body: "pwned"},
				}
			},
		},
		{
			name: "symlink whose target climbs out",
			entries: func(sandbox) []tarEntry {
				return []tarEntry{{name: "a/link", typ: tar.TypeSymlink, linkname: "../../outside"}}
			},
		},
		{
			name: "symlink with dot-dot behind another symlink",
			// a/b/s -> ../.. is dst itself. a/b/t -> s/.. cleans lexically
			// to a/b, well inside, but the kernel resolves s first and then
			// takes "..": dst's parent.
			entries: func(sandbox) []tarEntry {
				return []tarEntry{
					{name: "a/b/s", typ: tar.TypeSymlink, linkname: "../.."},
					{name: "a/b/t", typ: tar.TypeSymlink, linkname: "s/.."},
				}
			},
		},
		{
			name: "file through a symlink that points inside",
			entries: func(sandbox) []tarEntry {
				return []tarEntry{
					{name: "sub/", typ: tar.TypeDir, mode: 0o755},
					{name: "l", typ: tar.TypeSymlink, linkname: "sub"},
					{name: "l/f", body: "x"},
				}
			},
		},
		{
			name: "file through a symlink already in the directory",
			setup: func(t *testing.T, s sandbox) {
				if err := os.Symlink("../outside", filepath.Join(s.dst, "evil")); err != nil {
					t.Fatal(err)
				}
			},
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "evil/pwned", body: "pwned"}} },
		},
		{
			name: "hard link to a file outside",
			entries: func(sandbox) []tarEntry {
				return []tarEntry{{name: "hl", typ: tar.TypeLink, linkname: "../outside/sentinel"}}
			},
		},
		{
			name: "hard link to a file inside",
			entries: func(sandbox) []tarEntry {
				return []tarEntry{{name: "a", body: "a"}, {name: "b", typ: tar.TypeLink, linkname: "a"}}
			},
		},
		{
			name:    "character device",
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "null", typ: tar.TypeChar}} },
		},
		{
			name:    "block device",
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "sda", typ: tar.TypeBlock}} },
		},
		{
			name:    "fifo",
			entries: func(sandbox) []tarEntry { return []tarEntry{{name: "pipe", typ: tar.TypeFifo}} },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := newSandbox(t)
			if tt.setup != nil {
				tt.setup(t, s)
			}
			tgz := gz(t, makeTar(t, tt.entries(s)...))
			err := Extract(context.Background(), bytes.NewReader(tgz), s.dst, 0)
			if !errors.Is(err, ErrUnsafePath) {
				t.Errorf("Extract error = %v, want ErrUnsafePath", err)
			}
			s.assertUntouched(t)
			if tt.check != nil {
				tt.check(t, s)
			}
		})
	}
}

func TestExtractAcceptsOrdinaryArchives(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		entries []tarEntry
		want    map[string]string // snapshot of dst
	}{
		{
			name:    "names with ./ and implicit parents",
			entries: []tarEntry{{name: "./", typ: tar.TypeDir, mode: 0o700}, {name: "./a/b/c.txt", body: "c"}},
			want:    map[string]string{"a": "dir -rwxr-xr-x", "a/b": "dir -rwxr-xr-x", "a/b/c.txt": "file -rw-r--r-- c"},
		},
		{
			name:    "dot-dot that stays inside",
			entries: []tarEntry{{name: "a/../b", body: "b"}},
			want:    map[string]string{"b": "file -rw-r--r-- b"},
		},
		{
			name:    "symlink climbing exactly to the root",
			entries: []tarEntry{{name: "a/b/l", typ: tar.TypeSymlink, linkname: "../../x"}},
			want:    map[string]string{"a": "dir -rwxr-xr-x", "a/b": "dir -rwxr-xr-x", "a/b/l": "symlink -> ../../x"},
		},
		{
			name: "later entries replace earlier ones",
			entries: []tarEntry{
				{name: "f", body: "old"}, {name: "f", body: "new", mode: 0o755},
				{name: "d/x", body: "x"}, {name: "d", body: "now a file"},
				{name: "l", typ: tar.TypeSymlink, linkname: "f"}, {name: "l/", typ: tar.TypeDir, mode: 0o755},
			},
			want: map[string]string{"f": "file -rwxr-xr-x new", "d": "file -rw-r--r-- now a file", "l": "dir -rwxr-xr-x"},
		},
		{
			name: "read-only directory gets its mode after its children",
			entries: []tarEntry{
				{name: "ro/", typ: tar.TypeDir, mode: 0o555}, {name: "ro/f", body: "f", mode: 0o444},
			},
			want: map[string]string{"ro": "dir -r-xr-xr-x", "ro/f": "file -r--r--r-- f"},
		},
		{
			name:    "special mode bits dropped",
			entries: []tarEntry{{name: "suid", body: "s", mode: 0o4755}},
			want:    map[string]string{"suid": "file -rwxr-xr-x s"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := newSandbox(t)
			err := Extract(context.Background(), bytes.NewReader(gz(t, makeTar(t, tt.entries...))), s.dst, 0)
			if err != nil {
				t.Fatalf("Extract: %v", err)
			}
			if got := snapshot(t, s.dst); !maps.Equal(got, tt.want) {
				t.Errorf("extracted %q\nwant      %q", got, tt.want)
			}
			s.assertUntouched(t)
			// Let t.TempDir's cleanup remove read-only directories.
			_ = filepath.WalkDir(s.dst, func(p string, d fs.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					_ = os.Chmod(p, 0o755)
				}
				return nil
			})
		})
	}
}

func TestExtractPAXGlobalHeaderIsIgnored(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range []*tar.Header{
		{Typeflag: tar.TypeXGlobalHeader, Name: "pax_global_header", PAXRecords: map[string]string{"comment": "git archive"}},
		{Typeflag: tar.TypeReg, Name: "f", Mode: 0o644},
	} {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	s := newSandbox(t)
	if err := Extract(context.Background(), bytes.NewReader(gz(t, buf.Bytes())), s.dst, 0); err != nil {
		t.Fatalf("Extract: %v", err)
	}
	if got := listDir(t, s.dst); len(got) != 1 || got[0] != "f" {
		t.Errorf("extracted %q, want [f]", got)
	}
}

func TestExtractMaxBytes(t *testing.T) {
	t.Parallel()
	tgz := gz(t, makeTar(t,
		tarEntry{name: "a", body: strings.Repeat("a", 100)},
		tarEntry{name: "dir/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "b", body: strings.Repeat("b", 200)},
	))
	tests := []struct {
		name     string
		maxBytes int64
		wantErr  error
	}{
		{"one byte under the total", 299, ErrTooLarge},
		{"under the first file", 10, ErrTooLarge},
		{"exactly the total", 300, nil},
		{"zero means the 1 GiB default", 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := newSandbox(t)
			err := Extract(context.Background(), bytes.NewReader(tgz), s.dst, tt.maxBytes)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Extract(max %d) error = %v, want %v", tt.maxBytes, err, tt.wantErr)
			}
			if err != nil {
				if _, statErr := os.Lstat(filepath.Join(s.dst, "b")); !errors.Is(statErr, fs.ErrNotExist) {
					t.Errorf("the file over the limit was created anyway")
				}
			}
			s.assertUntouched(t)
		})
	}
}

func TestExtractRefusesBadInput(t *testing.T) {
	t.Parallel()
	valid := gz(t, makeTar(t, tarEntry{name: "f", body: "x"}))
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	truncated := gz(t, makeTar(t, tarEntry{name: "f", body: strings.Repeat("x", 4096)})[:1024])
	tests := []struct {
		name     string
		ctx      context.Context
		data     []byte
		dir      func(s sandbox) string
		maxBytes int64
		wantErr  error // nil: any error
	}{
		{name: "not gzip", data: []byte("plain text, not a tar.gz")},
		{name: "gzip but not tar", data: gz(t, bytes.Repeat([]byte("garbage!"), 200))},
		{name: "truncated archive", data: truncated},
		{name: "missing directory", data: valid, dir: func(s sandbox) string { return filepath.Join(s.dst, "nope") }},
		{name: "cancelled context", ctx: cancelled, data: valid, wantErr: context.Canceled},
		{name: "negative limit", data: valid, maxBytes: -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := newSandbox(t)
			ctx, dir := tt.ctx, s.dst
			if ctx == nil {
				ctx = context.Background()
			}
			if tt.dir != nil {
				dir = tt.dir(s)
			}
			err := Extract(ctx, bytes.NewReader(tt.data), dir, tt.maxBytes)
			if err == nil || (tt.wantErr != nil && !errors.Is(err, tt.wantErr)) {
				t.Fatalf("Extract error = %v, want %v", err, tt.wantErr)
			}
			s.assertUntouched(t)
		})
	}
}

// FuzzExtract feeds Extract arbitrary tar streams (gzipped here, so the
// fuzzer mutates the tar structure rather than breaking gzip checksums) and
// checks that it never panics, never creates anything outside its
// directory, and never leaves a symlink that resolves outside it.
func FuzzExtract(f *testing.F) {
	_, tgz := pack(f, newTree(f, sample, buildOpts{}), Options{})
	f.Add(gunzip(f, tgz))
	f.Add(makeTar(f, tarEntry{name: "a/b/c", body: "c"}, tarEntry{name: "a/l", typ: tar.TypeSymlink, linkname: "b/c"}))
	f.Add(makeTar(f, tarEntry{name: "../x", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "/abs", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "a/../../x", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "etc", typ: tar.TypeSymlink, linkname: "/etc"}, tarEntry{name: "etc/fuzz", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "out", typ: tar.TypeSymlink, linkname: "../outside"}, tarEntry{name: "out/x", body: "x"}))
	f.Add(makeTar(f, tarEntry{name: "a/b/s", typ: tar.TypeSymlink, linkname: "../.."}, tarEntry{name: "a/b/t", typ: tar.TypeSymlink, linkname: "s/.."}))
	f.Add(makeTar(f, tarEntry{name: "hl", typ: tar.TypeLink, linkname: "../outside/sentinel"}))
	f.Add(makeTar(f, tarEntry{name: "d/", typ: tar.TypeDir, mode: 0o555}, tarEntry{name: "d/f", body: "x"}))

	f.Fuzz(func(t *testing.T, raw []byte) {
		s := newSandbox(t)
		// A small cap keeps sparse or lying headers from filling the disk.
		_ = Extract(context.Background(), bytes.NewReader(gz(t, raw)), s.dst, 1<<20)
		s.assertUntouched(t)

		realDst, err := filepath.EvalSymlinks(s.dst)
		if err != nil {
			t.Fatal(err)
		}
		_ = filepath.WalkDir(s.dst, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil //nolint:nilerr // an unreadable entry is skipped: the walk only looks for symlinks that escape
			}
			if d.IsDir() {
				_ = os.Chmod(p, 0o755) // let cleanup remove it, and keep walking
			}
			if d.Type()&fs.ModeSymlink == 0 {
				return nil
			}
			resolved, err := filepath.EvalSymlinks(p)
			if err != nil {
				return nil //nolint:nilerr // dangling or looping: resolves nowhere, so cannot escape
			}
			if resolved != realDst && !strings.HasPrefix(resolved, realDst+string(filepath.Separator)) {
				t.Errorf("symlink %s resolves outside dst, to %s", p, resolved)
			}
			return nil
		})
	})
}

// ExtractVerified builds only the bytes the digest names: an object planted
// under another context's name is refused, whatever it holds.
func TestExtractVerifiedChecksTheDigest(t *testing.T) {
	t.Parallel()
	files := sample.with(nil)
	delete(files, "links/absolute") // Extract refuses absolute symlinks
	src := newTree(t, files, buildOpts{})
	res, tgz := pack(t, src, Options{})
	if err := ExtractVerified(context.Background(), bytes.NewReader(tgz), t.TempDir(), 0, res.Digest); err != nil {
		t.Fatalf("the right digest: %v", err)
	}
	other := newTree(t, tree{"evil": node{content: "planted"}}, buildOpts{})
	otherRes, planted := pack(t, other, Options{})
	err := ExtractVerified(context.Background(), bytes.NewReader(planted), t.TempDir(), 0, res.Digest)
	// The refusal names the digest asked for, never the object's own (it
	// would tell a prober what someone else's object holds).
	if !errors.Is(err, ErrDigestMismatch) || !strings.Contains(err.Error(), res.Digest) || strings.Contains(err.Error(), otherRes.Digest) {
		t.Fatalf("planted bytes under another digest: %v", err)
	}
}

// TestExtractVerifiedTellsBadBytesFromABadContext: an archive refused part
// way is a mismatch unless it is the very archive the digest names; bytes
// that are not even gzip are a mismatch too. Only the named archive's own
// fault is reported as that fault.
func TestExtractVerifiedTellsBadBytesFromABadContext(t *testing.T) {
	t.Parallel()
	raw := func(hdrs ...*tar.Header) ([]byte, string) {
		var tb bytes.Buffer
		tw := tar.NewWriter(&tb)
		for _, h := range hdrs {
			if err := tw.WriteHeader(h); err != nil {
				t.Fatal(err)
			}
			if h.Size > 0 {
				_, _ = tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
			}
		}
		_ = tw.Close()
		sum := sha256.Sum256(tb.Bytes())
		var gz bytes.Buffer
		zw := gzip.NewWriter(&gz)
		_, _ = zw.Write(tb.Bytes())
		_ = zw.Close()
		return gz.Bytes(), "sha256:" + hex.EncodeToString(sum[:])
	}
	unsafe, unsafeDigest := raw(&tar.Header{Name: "a", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1},
		&tar.Header{Name: "b", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd", Mode: 0o777})
	fine, fineDigest := raw(&tar.Header{Name: "a", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	_ = fine

	// The archive the digest names, refused for its own content: that
	// fault, which every request for it shares.
	err := ExtractVerified(context.Background(), bytes.NewReader(unsafe), t.TempDir(), 0, unsafeDigest)
	if err == nil || errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("the named archive's own fault: %v, want it and not a mismatch", err)
	}
	// The same bytes under another digest: a mismatch.
	if err := ExtractVerified(context.Background(), bytes.NewReader(unsafe), t.TempDir(), 0, fineDigest); !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("a refused archive under another digest: %v, want a mismatch", err)
	}
	// Not gzip at all.
	if err := ExtractVerified(context.Background(), strings.NewReader("garbage, not even gzip"), t.TempDir(), 0, fineDigest); !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("bytes that are not gzip: %v, want a mismatch", err)
	}
}

// A small archive of very many or very deeply nested entries is refused
// before it fills the disk: a gzip bomb of empty files, a deep directory
// chain.
func TestExtractRefusesBombsAndDeepTrees(t *testing.T) {
	t.Parallel()
	var many []tarEntry
	for i := range MaxEntries + 1 {
		many = append(many, tarEntry{name: fmt.Sprintf("f%06d", i)})
	}
	deep := strings.Repeat("d/", MaxDepth) + "file"
	for name, tgz := range map[string][]byte{
		"more entries than the cap":  gz(t, makeTar(t, many...)),
		"a path deeper than the cap": gz(t, makeTar(t, tarEntry{name: deep, body: "x"})),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := Extract(context.Background(), bytes.NewReader(tgz), t.TempDir(), 0)
			if !errors.Is(err, ErrTooLarge) {
				t.Fatalf("Extract = %v, want ErrTooLarge", err)
			}
		})
	}
	// At the caps exactly, both are fine.
	ok := strings.Repeat("d/", MaxDepth-1) + "file"
	if err := Extract(context.Background(), bytes.NewReader(gz(t, makeTar(t, tarEntry{name: ok, body: "x"}))), t.TempDir(), 0); err != nil {
		t.Fatalf("a path %d deep: %v", MaxDepth, err)
	}
}

// VerifyArchive accepts exactly the bytes a digest names, without
// unpacking, and tells a broken stream (retry) from other bytes
// (mismatch).
func TestVerifyArchive(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM scratch\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	res, err := Write(context.Background(), dir, &buf, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := VerifyArchive(ctx, bytes.NewReader(buf.Bytes()), 0, res.Digest); err != nil {
		t.Fatalf("its own bytes: %v", err)
	}
	other := "sha256:" + strings.Repeat("0", 64)
	if err := VerifyArchive(ctx, bytes.NewReader(buf.Bytes()), 0, other); !errors.Is(err, ErrDigestMismatch) || strings.Contains(err.Error(), res.Digest) {
		t.Fatalf("another digest: %v (must be a mismatch that does not name the object's digest)", err)
	}
	if err := VerifyArchive(ctx, strings.NewReader("not gzip at all"), 0, res.Digest); !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("not gzip: %v", err)
	}
	cut := buf.Bytes()[:buf.Len()/2]
	if err := VerifyArchive(ctx, bytes.NewReader(cut), 0, res.Digest); err == nil || errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("a stream cut short: %v, want an error another try may cure", err)
	}
}
