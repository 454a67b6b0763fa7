package gitsource

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/object"

	v1 "github.com/buildq/buildq/api/v1"
)

// serve serves repos (by name, "r" -> /r.git) over HTTP; it returns the
// server and the base URL.
func serve(t *testing.T, opts serverOpts, repos map[string]*testRepo) (*gitServer, string) {
	t.Helper()
	srv := newGitServer(t, opts)
	for name, repo := range repos {
		srv.repos["/"+name+".git"] = repo
	}
	url := srv.serveHTTP()
	return srv, url
}

func TestFetch_ResolvesRefsToTheirCommits(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	v1Files := map[string]f{"Dockerfile": reg("FROM scratch\n"), "a.txt": reg("one\n")}
	v2Files := map[string]f{"Dockerfile": reg("FROM scratch\n"), "a.txt": reg("two\n"), "run.sh": exe("#!/bin/sh\n"), "link": sym("a.txt")}
	c1 := repo.commitFiles("main", v1Files)
	c2 := repo.commitFiles("main", v2Files, c1)
	repo.setRef("refs/heads/feature", c1)
	repo.setRef("refs/tags/light", c1)
	repo.annotatedTag("v1", c1)
	srv, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	url := base + "/r.git"
	d1, d2 := uploadDigest(t, v1Files, ""), uploadDigest(t, v2Files, "")
	if d1 == d2 {
		t.Fatal("test setup: both commits have the same digest")
	}

	for _, tc := range []struct {
		name   string
		src    Source
		ref    string
		commit plumbing.Hash
		digest string
	}{
		{"branch", Source{URL: url, Ref: "main"}, "refs/heads/main", c2, d2},
		{"full ref", Source{URL: url, Ref: "refs/heads/feature"}, "refs/heads/feature", c1, d1},
		{"lightweight tag", Source{URL: url, Ref: "light"}, "refs/tags/light", c1, d1},
		{"annotated tag peels to its commit", Source{URL: url, Ref: "v1"}, "refs/tags/v1", c1, d1},
		{"annotated tag with its commit", Source{URL: url, Ref: "v1", Commit: c1.String()}, "refs/tags/v1", c1, d1},
		{"HEAD is its branch", Source{URL: url, Ref: "HEAD"}, "refs/heads/main", c2, d2},
		{"tip with its commit", Source{URL: url, Ref: "main", Commit: c2.String()}, "refs/heads/main", c2, d2},
		{"commit without ref", Source{URL: url, Commit: c1.String()}, "", c1, d1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(srv.uploads())
			c := fetchOK(t, newFetcher(t), tc.src)
			if c.Ref != tc.ref || c.Commit != tc.commit.String() || c.Digest != tc.digest {
				t.Errorf("got ref %q commit %s digest %s, want %q %s %s", c.Ref, c.Commit, c.Digest, tc.ref, tc.commit, tc.digest)
			}
			if c.URL != url || c.SubPath != "" {
				t.Errorf("got URL %q subPath %q", c.URL, c.SubPath)
			}
			if st, err := os.Stat(c.Path); err != nil || st.Size() != c.Size {
				t.Errorf("context file %s: %v (size %d, want %d)", c.Path, err, c.Size, st.Size())
			}
			// Exactly the needed commit: one exchange, one commit deep.
			ups := srv.uploads()[before:]
			if len(ups) != 1 || ups[0].depth != 1 {
				t.Errorf("upload-pack requests %+v, want one of depth 1", ups)
			}
		})
	}
}

// history commits n versions of a file on main, oldest first.
func history(repo *testRepo, n int) ([]plumbing.Hash, []map[string]f) {
	var commits []plumbing.Hash
	var files []map[string]f
	for i := range n {
		fs := map[string]f{"Dockerfile": reg("FROM scratch\n"), "version": reg(string(rune('a' + i)))}
		commits = append(commits, repo.commitFiles("main", fs, commits[max(0, i-1):i]...))
		files = append(files, fs)
	}
	return commits, files
}

func TestFetch_CommitBelowTheTip(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts serverOpts
		want []uploadRequest // the exchanges: how the commit was fetched
	}{
		{"by hash, then the history's commits and trees", serverOpts{byHash: true}, []uploadRequest{{depth: 1}, {depth: DefaultMaxDepth, filter: "blob:none"}}},
		{"deepened when wants must be tips", serverOpts{}, []uploadRequest{{depth: DefaultMaxDepth}}},
		{"whole history from a server without shallow", serverOpts{noShallow: true}, []uploadRequest{{depth: 0}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			repo := newRepo(t)
			commits, files := history(repo, 4)
			srv, base := serve(t, tc.opts, map[string]*testRepo{"r": repo})
			c := fetchOK(t, newFetcher(t), Source{URL: base + "/r.git", Ref: "main", Commit: commits[1].String()})
			if c.Commit != commits[1].String() || c.Digest != uploadDigest(t, files[1], "") {
				t.Errorf("got commit %s digest %s, want %s", c.Commit, c.Digest, commits[1])
			}
			ups := srv.uploads()
			if len(ups) != len(tc.want) {
				t.Fatalf("upload-pack requests %+v, want %d", ups, len(tc.want))
			}
			for i, want := range tc.want {
				if ups[i].depth != want.depth || ups[i].filter != want.filter {
					t.Errorf("request %d: depth %d filter %q, want %d %q", i, ups[i].depth, ups[i].filter, want.depth, want.filter)
				}
			}
		})
	}
}

func TestFetch_ForcePushedBranch(t *testing.T) {
	t.Parallel()
	for _, opts := range []serverOpts{{byHash: true}, {}} {
		repo := newRepo(t)
		old, _ := history(repo, 2)
		newFiles := map[string]f{"Dockerfile": reg("FROM scratch\n"), "rewritten": reg("yes")}
		tip := repo.commitFiles("main", newFiles) // a new root: the old commits are unreachable
		_, base := serve(t, opts, map[string]*testRepo{"r": repo})
		url := base + "/r.git"

		e := fetchErr(t, newFetcher(t), Source{URL: url, Ref: "main", Commit: old[1].String()}, v1.ReasonGitCommitNotFound)
		mustContain(t, e.Message, old[1].String(), "refs/heads/main")
		c := fetchOK(t, newFetcher(t), Source{URL: url, Ref: "main"})
		if c.Commit != tip.String() || c.Digest != uploadDigest(t, newFiles, "") {
			t.Errorf("without a commit: got %s, want the new tip %s", c.Commit, tip)
		}
	}
}

func TestFetch_RequestFaultsFailAtOnce(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	commits, _ := history(repo, 3)
	repo.commitFiles("files", map[string]f{"dir/file": reg("x")})
	srv, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	url := base + "/r.git"
	fr := newFetcher(t)

	e := fetchErr(t, fr, Source{URL: url, Ref: "nope"}, v1.ReasonGitRefNotFound)
	mustContain(t, e.Message, `"nope"`, url)

	// Not a tip, and the server serves tips only: its own words.
	e = fetchErr(t, fr, Source{URL: url, Commit: commits[0].String()}, v1.ReasonGitCommitNotFound)
	mustContain(t, e.Message, "not our ref", commits[0].String())

	e = fetchErr(t, fr, Source{URL: url, Ref: "files", SubPath: "missing"}, v1.ReasonGitSubPath)
	mustContain(t, e.Message, `"missing"`)
	e = fetchErr(t, fr, Source{URL: url, Ref: "files", SubPath: "dir/file"}, v1.ReasonGitSubPath)
	mustContain(t, e.Message, "not a directory")

	e = fetchErr(t, fr, Source{URL: base + "/absent.git", Ref: "main"}, v1.ReasonGitAuthFailed)
	mustContain(t, e.Message, "404")

	// v1 validation refuses these; Fetch does too, before any request.
	n := srv.requestCount()
	for _, src := range []Source{
		{URL: url, Ref: "--upload-pack=touch /tmp/x"},
		{URL: url, Ref: "-b"},
		{URL: url},
		{URL: url, Commit: "HEAD~1"},
		{URL: url, Ref: "main", SubPath: "../etc"},
		{URL: url, Ref: "main", Dockerfile: "/etc/passwd"},
		{URL: "file:///etc", Ref: "main"},
		{URL: "ext::sh -c touch% /tmp/x", Ref: "main"},
	} {
		_ = fetchErr(t, fr, src, v1.ReasonInvalidRequest)
	}
	if got := srv.requestCount(); got != n {
		t.Errorf("invalid sources made %d requests", got-n)
	}
}

func TestFetch_SubPathWithDockerignoreIsTheUploadOfThatDirectory(t *testing.T) {
	t.Parallel()
	app := map[string]f{
		".dockerignore":        reg("*.log\n!keep.log\nsecret/\nDockerfile\ndocker\n"),
		"Dockerfile":           reg("FROM scratch\n"),
		"main.go":              reg("package main\n"),
		"debug.log":            reg("noise"),
		"keep.log":             reg("kept"),
		"secret/key":           reg("hidden"),
		"bin/run":              exe("#!/bin/sh\necho hi\n"),
		"link":                 sym("../README.md"),
		"abs":                  sym("/etc/passwd"),
		"docker/Dockerfile.pr": reg("FROM scratch\n"),
	}
	files := map[string]f{"README.md": reg("top")}
	for p, file := range app {
		files["app/"+p] = file
	}
	repo := newRepo(t)
	repo.commitFiles("main", files)
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})

	for _, dockerfile := range []string{"", "docker/Dockerfile.pr"} {
		c := fetchOK(t, newFetcher(t), Source{URL: base + "/r.git", Ref: "main", SubPath: "app", Dockerfile: dockerfile})
		if want := uploadDigest(t, app, dockerfile); c.Digest != want {
			t.Errorf("Dockerfile %q: digest %s, want the upload's %s", dockerfile, c.Digest, want)
		}
		got := names(t, c)
		for _, absent := range []string{"debug.log", "secret", "README.md"} {
			if slices.Contains(got, absent) {
				t.Errorf("Dockerfile %q: the context holds excluded %q", dockerfile, absent)
			}
		}
		kept := []string{".dockerignore", "keep.log", "bin/run", "link", "abs"}
		if dockerfile == "" {
			kept = append(kept, "Dockerfile")
		} else {
			kept = append(kept, dockerfile)
		}
		for _, name := range kept {
			if !slices.Contains(got, name) {
				t.Errorf("Dockerfile %q: the context lacks %q (has %v)", dockerfile, name, got)
			}
		}
	}
}

// names lists the entries of a context's tar.
func names(t *testing.T, c *Context) []string {
	t.Helper()
	rc, err := c.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	zr, err := gzip.NewReader(rc)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var out []string
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, strings.TrimSuffix(hdr.Name, "/"))
	}
}

func TestFetch_IdenticalTreesShareADigest(t *testing.T) {
	t.Parallel()
	files := map[string]f{"Dockerfile": reg("FROM scratch\nCOPY . /\n"), "src/a.go": reg("package a\n"), "run": exe("x")}
	a := newRepo(t)
	first := a.commitFiles("main", map[string]f{"other": reg("history")})
	a.commitFiles("main", files, first)
	b := newRepo(t)
	b.commit(b.tree(files), "another message") // dangling: not what is fetched
	b.setRef("refs/heads/other", b.commit(b.tree(files), "yet another message"))
	c := newRepo(t)
	nested := map[string]f{"README": reg("not in the context")}
	for p, file := range files {
		nested["sub/"+p] = file
	}
	c.commitFiles("main", nested)
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"a": a, "b": b, "c": c})

	fr := newFetcher(t)
	got := []*Context{
		fetchOK(t, fr, Source{URL: base + "/a.git", Ref: "main"}),
		fetchOK(t, fr, Source{URL: base + "/b.git", Ref: "other"}),
		fetchOK(t, fr, Source{URL: base + "/c.git", Ref: "main", SubPath: "sub"}),
	}
	want := uploadDigest(t, files, "")
	for i, c := range got {
		if c.Digest != want {
			t.Errorf("context %d (%s at %s): digest %s, want %s", i, c.URL, c.Commit, c.Digest, want)
		}
	}
	if got[0].Commit == got[1].Commit || got[1].Commit == got[2].Commit {
		t.Error("test setup: the commits should differ")
	}
}

func TestFetch_LFSPointerIsRefused(t *testing.T) {
	t.Parallel()
	pointer := reg("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n")
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"Dockerfile": reg("FROM scratch\n"), "models/big.bin": pointer})
	repo.commitFiles("ignored", map[string]f{"Dockerfile": reg("FROM scratch\n"), "models/big.bin": pointer, ".dockerignore": reg("models\n")})
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})

	e := fetchErr(t, newFetcher(t), Source{URL: base + "/r.git", Ref: "main"}, v1.ReasonGitLFS)
	mustContain(t, e.Message, "models/big.bin")
	// Excluded, it is not in the context, so not a problem.
	fetchOK(t, newFetcher(t), Source{URL: base + "/r.git", Ref: "ignored"})
}

func TestFetch_HostileTreesCannotWriteOutside(t *testing.T) {
	t.Parallel()
	outside := t.TempDir()
	repo := newRepo(t)
	blob := repo.blob([]byte("pwned"))
	link := repo.blob([]byte(outside))
	inner := repo.rawTree([]object.TreeEntry{{Name: "file", Mode: 0o100644, Hash: blob}})
	for name, entries := range map[string][]object.TreeEntry{
		// a symlink to outside, then a directory of the same name
		"through-symlink": {{Name: "a", Mode: 0o120000, Hash: link}, {Name: "a", Mode: 0o40000, Hash: inner}},
		"dot-git":         {{Name: ".git", Mode: 0o40000, Hash: inner}},
		"dot-GIT":         {{Name: ".GIT", Mode: 0o40000, Hash: inner}},
		"dot-dot":         {{Name: "..", Mode: 0o40000, Hash: inner}},
		"slash":           {{Name: "x/../../y", Mode: 0o100644, Hash: blob}},
		"odd-mode":        {{Name: "dev", Mode: 0o20644, Hash: blob}},
	} {
		repo.setRef("refs/heads/"+name, repo.commit(repo.rawTree(entries), name))
	}
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	for ref, says := range map[string]string{
		"through-symlink": `holds "a" twice`,
		"dot-git":         "git refuses to check out",
		"dot-GIT":         "git refuses to check out",
		"dot-dot":         "git refuses to check out",
		"slash":           "git refuses to check out",
		"odd-mode":        "does not check out",
	} {
		e := fetchErr(t, newFetcher(t), Source{URL: base + "/r.git", Ref: ref}, v1.ReasonInvalidRequest)
		mustContain(t, e.Message, says)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("a fetch wrote outside its directory: %v", entries)
	}
}

func TestFetch_ReportsEachStep(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	history(repo, 3)
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	var steps []Progress
	c, err := newFetcher(t).Fetch(context.Background(), "tenant", Source{URL: base + "/r.git", Ref: "main"},
		func(p Progress) { steps = append(steps, p) })
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Remove() }()
	order := map[string]int{StepResolving: 0, StepFetching: 1, StepPacking: 2}
	seen := map[string]bool{}
	last, objects := -1, int64(0)
	for _, p := range steps {
		n, ok := order[p.Step]
		if !ok || n < last {
			t.Fatalf("step %q out of order in %+v", p.Step, steps)
		}
		last, seen[p.Step] = n, true
		if p.Step == StepFetching {
			objects = max(objects, p.Objects)
		}
	}
	if len(seen) != 3 || objects == 0 {
		t.Errorf("steps %+v: want all three, fetching with objects", steps)
	}
}

func TestFetch_LeavesOnlyTheContextBehind(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	history(repo, 2)
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	fr := newFetcher(t)
	ls := func() []string {
		entries, err := os.ReadDir(fr.TempDir)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		return names
	}

	c, err := fr.Fetch(context.Background(), "tenant", Source{URL: base + "/r.git", Ref: "main"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := ls(); len(got) != 1 || got[0] != filepath.Base(c.Path) {
		t.Errorf("after a fetch the temp dir holds %v, want only %s", got, filepath.Base(c.Path))
	}
	if err := c.Remove(); err != nil {
		t.Fatal(err)
	}
	_ = fetchErr(t, fr, Source{URL: base + "/r.git", Ref: "main", SubPath: "nope"}, v1.ReasonGitSubPath)
	fr.Limits.MaxObjectBytes = 10 // fails in the middle of a pack
	_ = fetchErr(t, fr, Source{URL: base + "/r.git", Ref: "main"}, v1.ReasonGitTooLarge)
	if got := ls(); len(got) != 0 {
		t.Errorf("after Remove and failures the temp dir holds %v", got)
	}
}
