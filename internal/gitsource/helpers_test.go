package gitsource

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-git/go-billy/v5/osfs"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/cache"
	"github.com/go-git/go-git/v5/plumbing/filemode"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/go-git/go-git/v5/storage/filesystem"

	"github.com/buildq/buildq/internal/contexttar"
)

// testRepo is a bare repository built object by object with go-git, so
// tests control every tree entry (modes, gitlinks, hostile names).
type testRepo struct {
	t   *testing.T
	dir string
	st  *filesystem.Storage
}

func newRepo(t *testing.T) *testRepo {
	t.Helper()
	dir := t.TempDir()
	st := filesystem.NewStorage(osfs.New(dir), cache.NewObjectLRUDefault())
	if err := st.Init(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return &testRepo{t: t, dir: dir, st: st}
}

// f is a file of a test tree: content with a mode (regular by default),
// a symlink target, or a gitlink's commit.
type f struct {
	content string
	mode    filemode.FileMode
	link    plumbing.Hash
}

func reg(s string) f            { return f{content: s, mode: filemode.Regular} }
func exe(s string) f            { return f{content: s, mode: filemode.Executable} }
func sym(s string) f            { return f{content: s, mode: filemode.Symlink} }
func gitlink(h plumbing.Hash) f { return f{mode: filemode.Submodule, link: h} }

func (r *testRepo) blob(content []byte) plumbing.Hash {
	r.t.Helper()
	obj := r.st.NewEncodedObject()
	obj.SetType(plumbing.BlobObject)
	w, err := obj.Writer()
	if err != nil {
		r.t.Fatal(err)
	}
	if _, err := w.Write(content); err != nil {
		r.t.Fatal(err)
	}
	_ = w.Close()
	h, err := r.st.SetEncodedObject(obj)
	if err != nil {
		r.t.Fatal(err)
	}
	return h
}

// rawTree stores a tree with entries exactly as given (order, names).
func (r *testRepo) rawTree(entries []object.TreeEntry) plumbing.Hash {
	r.t.Helper()
	obj := r.st.NewEncodedObject()
	if err := (&object.Tree{Entries: entries}).Encode(obj); err != nil {
		r.t.Fatal(err)
	}
	h, err := r.st.SetEncodedObject(obj)
	if err != nil {
		r.t.Fatal(err)
	}
	return h
}

// tree stores the nested trees of files (slash-separated paths).
func (r *testRepo) tree(files map[string]f) plumbing.Hash {
	r.t.Helper()
	sub := map[string]map[string]f{}
	var entries []object.TreeEntry
	for p, file := range files {
		if first, rest, ok := strings.Cut(p, "/"); ok {
			if sub[first] == nil {
				sub[first] = map[string]f{}
			}
			sub[first][rest] = file
			continue
		}
		e := object.TreeEntry{Name: p, Mode: file.mode}
		switch file.mode {
		case filemode.Submodule:
			e.Hash = file.link
		case filemode.Dir:
			r.t.Fatalf("git trees cannot hold the empty directory %q", p)
		default:
			e.Hash = r.blob([]byte(file.content))
		}
		entries = append(entries, e)
	}
	for name, files := range sub {
		entries = append(entries, object.TreeEntry{Name: name, Mode: filemode.Dir, Hash: r.tree(files)})
	}
	// git's order: names compared with a trailing "/" for trees.
	key := func(e object.TreeEntry) string {
		if e.Mode == filemode.Dir {
			return e.Name + "/"
		}
		return e.Name
	}
	sort.Slice(entries, func(i, j int) bool { return key(entries[i]) < key(entries[j]) })
	return r.rawTree(entries)
}

// ticks makes each commit's time later than the last (tests run in
// parallel, hence the atomic).
var ticks atomic.Int64

func tick() time.Time {
	return time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC).Add(time.Duration(ticks.Add(1)) * time.Minute)
}

func (r *testRepo) commit(tree plumbing.Hash, msg string, parents ...plumbing.Hash) plumbing.Hash {
	r.t.Helper()
	sig := object.Signature{Name: "t", Email: "t@example.com", When: tick()}
	obj := r.st.NewEncodedObject()
	c := &object.Commit{Author: sig, Committer: sig, Message: msg, TreeHash: tree, ParentHashes: parents}
	if err := c.Encode(obj); err != nil {
		r.t.Fatal(err)
	}
	h, err := r.st.SetEncodedObject(obj)
	if err != nil {
		r.t.Fatal(err)
	}
	return h
}

// commitFiles commits files on branch (moving it, creating HEAD).
func (r *testRepo) commitFiles(branch string, files map[string]f, parents ...plumbing.Hash) plumbing.Hash {
	r.t.Helper()
	h := r.commit(r.tree(files), "commit", parents...)
	r.setRef("refs/heads/"+branch, h)
	return h
}

func (r *testRepo) setRef(name string, h plumbing.Hash) {
	r.t.Helper()
	if err := r.st.SetReference(plumbing.NewHashReference(plumbing.ReferenceName(name), h)); err != nil {
		r.t.Fatal(err)
	}
	if _, err := r.st.Reference(plumbing.HEAD); err != nil {
		head := plumbing.NewSymbolicReference(plumbing.HEAD, plumbing.ReferenceName(name))
		if err := r.st.SetReference(head); err != nil {
			r.t.Fatal(err)
		}
	}
}

// annotatedTag stores refs/tags/name as a tag object pointing at target.
func (r *testRepo) annotatedTag(name string, target plumbing.Hash) plumbing.Hash {
	r.t.Helper()
	obj := r.st.NewEncodedObject()
	tag := &object.Tag{Name: name, Tagger: object.Signature{Name: "t", When: tick()}, Message: "tag " + name,
		TargetType: plumbing.CommitObject, Target: target}
	if err := tag.Encode(obj); err != nil {
		r.t.Fatal(err)
	}
	h, err := r.st.SetEncodedObject(obj)
	if err != nil {
		r.t.Fatal(err)
	}
	r.setRef("refs/tags/"+name, h)
	return h
}

// writeDir writes files into a new directory the way a checkout does
// (gitlinks as empty directories), standing for the directory a user
// would upload with `buildq submit`.
func writeDir(t *testing.T, files map[string]f) string {
	t.Helper()
	root := t.TempDir()
	for p, file := range files {
		full := filepath.Join(root, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		switch file.mode {
		case filemode.Submodule, filemode.Dir:
			err = os.MkdirAll(full, 0o755)
		case filemode.Symlink:
			err = os.Symlink(file.content, full)
		case filemode.Executable:
			err = os.WriteFile(full, []byte(file.content), 0o755)
		default:
			err = os.WriteFile(full, []byte(file.content), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// uploadDigest is the contextDigest `buildq submit` computes for files.
func uploadDigest(t *testing.T, files map[string]f, dockerfile string) string {
	t.Helper()
	res, err := contexttar.Digest(context.Background(), writeDir(t, files), contexttar.Options{Dockerfile: dockerfile})
	if err != nil {
		t.Fatal(err)
	}
	return res.Digest
}

// newFetcher may reach 127.0.0.1 (an IP entry, so its loopback address
// too) over plain http.
func newFetcher(t *testing.T) *Fetcher {
	return &Fetcher{
		Policy:  Policy{AllowedHosts: []string{"127.0.0.1"}, InsecureHosts: []string{"127.0.0.1"}},
		TempDir: t.TempDir(),
	}
}

// fetchOK fetches src and fails the test on error; the context is
// removed at the end of the test.
func fetchOK(t *testing.T, fr *Fetcher, src Source) *Context {
	t.Helper()
	c, err := fr.Fetch(context.Background(), "tenant", src, nil)
	if err != nil {
		t.Fatalf("Fetch(%+v): %v", src, err)
	}
	t.Cleanup(func() { _ = c.Remove() })
	return c
}

// fetchErr fetches src and returns its *Error, failing the test when it
// succeeds or the reason is not want.
func fetchErr(t *testing.T, fr *Fetcher, src Source, want string) *Error {
	t.Helper()
	c, err := fr.Fetch(context.Background(), "tenant", src, nil)
	if err == nil {
		_ = c.Remove()
		t.Fatalf("Fetch(%+v) succeeded, want reason %q", src, want)
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("Fetch error %T %v is not an *Error", err, err)
	}
	if e.Reason != want {
		t.Fatalf("Fetch reason = %q (transient %v), want %q; message: %s", e.Reason, e.Transient, want, e.Message)
	}
	if e.Transient != (want == "") {
		t.Fatalf("Fetch error transient = %v for reason %q: %s", e.Transient, want, e.Message)
	}
	return e
}

// mustContain fails unless s holds every one of subs.
func mustContain(t *testing.T, s string, subs ...string) {
	t.Helper()
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			t.Errorf("%q does not mention %q", s, sub)
		}
	}
}

// noSecret fails if the error, its chain or its %+v form holds secret.
func noSecret(t *testing.T, err error, secrets ...string) {
	t.Helper()
	for e := err; e != nil; e = errors.Unwrap(e) {
		for _, s := range secrets {
			for _, text := range []string{e.Error(), fmt.Sprintf("%+v", e), fmt.Sprintf("%#v", e)} {
				if strings.Contains(text, s) {
					t.Errorf("error %q reveals the secret %q", text, s)
				}
			}
		}
	}
}
