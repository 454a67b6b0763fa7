package gitsource

import (
	"net/url"
	"slices"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

func TestFetch_Submodules(t *testing.T) {
	t.Parallel()
	sub := newRepo(t)
	s1 := sub.commitFiles("main", map[string]f{"lib.go": reg("package lib // v1\n"), "tool": exe("#!/bin/sh\n")})
	// The submodule's branch moved on: s1 is no tip, so a server serving
	// tips only makes the fetch deepen the submodule's HEAD to find it.
	sub.commitFiles("main", map[string]f{"lib.go": reg("package lib // v2\n")}, s1)

	gitmodules := reg("[submodule \"lib\"]\n\tpath = vendor/lib\n\turl = ../sub.git\n" +
		"[submodule \"far\"]\n\tpath = far\n\turl = https://git.example.com/far.git\n")
	super := newRepo(t)
	superFiles := map[string]f{".gitmodules": gitmodules, "Dockerfile": reg("FROM scratch\n"), "vendor/lib": gitlink(s1)}
	super.commitFiles("main", superFiles)
	farFiles := map[string]f{".gitmodules": gitmodules, "Dockerfile": reg("FROM scratch\n"), "far": gitlink(s1)}
	super.commitFiles("far", farFiles)

	for _, opts := range []serverOpts{{}, {byHash: true}} {
		srv, base := serve(t, opts, map[string]*testRepo{"super": super, "sub": sub})
		url := base + "/super.git"

		// With submodules: the checkout `git clone --recurse-submodules` makes.
		c := fetchOK(t, newFetcher(t), Source{URL: url, Ref: "main", Submodules: true})
		deepened := slices.ContainsFunc(srv.uploads(), func(q uploadRequest) bool { return q.depth == DefaultMaxDepth })
		if deepened == opts.byHash {
			t.Errorf("%+v: submodule commit deepened = %v; by hash where served, deepened otherwise", opts, deepened)
		}
		want := uploadDigest(t, map[string]f{
			".gitmodules": gitmodules, "Dockerfile": reg("FROM scratch\n"),
			"vendor/lib/lib.go": reg("package lib // v1\n"), "vendor/lib/tool": exe("#!/bin/sh\n"),
		}, "")
		if c.Digest != want {
			t.Errorf("%+v: with submodules: digest %s, want %s", opts, c.Digest, want)
		}
		// Without: the empty directory a plain clone leaves.
		c = fetchOK(t, newFetcher(t), Source{URL: url, Ref: "main"})
		if want := uploadDigest(t, superFiles, ""); c.Digest != want {
			t.Errorf("%+v: without submodules: digest %s, want %s", opts, c.Digest, want)
		}
		// A submodule is under the same host policy.
		e := fetchErr(t, newFetcher(t), Source{URL: url, Ref: "far", Submodules: true}, v1.ReasonGitHostRefused)
		mustContain(t, e.Message, `submodule "far"`, "git.example.com", "--allowed-git-host")
	}
}

func TestResolveSubmoduleURL(t *testing.T) {
	t.Parallel()
	base, _ := url.Parse("https://git.example.com/org/super.git")
	for raw, want := range map[string]string{
		"../sub.git":                           "https://git.example.com/org/sub.git",
		"./nested":                             "https://git.example.com/org/super.git/nested",
		"../../other/x":                        "https://git.example.com/other/x",
		"https://github.com/a/b.git":           "https://github.com/a/b.git",
		"git@github.com:a/b.git":               "ssh://github.com/a/b.git",
		"ssh://deploy@host.example:2222/x.git": "ssh://host.example:2222/x.git",
		"https://user:secret@github.com/a/b":   "https://github.com/a/b",
	} {
		u, _, err := resolveSubmoduleURL(base, "git", raw)
		if err != nil || u.String() != want {
			t.Errorf("resolve %q = %v, %v; want %s", raw, u, err, want)
		}
	}
	for _, raw := range []string{"file:///etc", "/abs/path", "ext::sh -c id", "git://host/x", "C:\\x"} {
		if u, _, err := resolveSubmoduleURL(base, "git", raw); err == nil {
			t.Errorf("resolve %q = %v, want an error", raw, u)
		}
	}
}

// Each submodule a Fetch opens counts against MaxSubmodules.
func TestFetch_MaxSubmodules(t *testing.T) {
	t.Parallel()
	sub := newRepo(t)
	s1 := sub.commitFiles("main", map[string]f{"lib": reg("lib\n")})
	super := newRepo(t)
	super.commitFiles("main", map[string]f{
		".gitmodules": reg("[submodule \"a\"]\n\tpath = a\n\turl = ../sub.git\n" +
			"[submodule \"b\"]\n\tpath = b\n\turl = ../sub.git\n[submodule \"c\"]\n\tpath = c\n\turl = ../sub.git\n"),
		"Dockerfile": reg("FROM scratch\n"), "a": gitlink(s1), "b": gitlink(s1), "c": gitlink(s1),
	})
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"super": super, "sub": sub})
	src := Source{URL: base + "/super.git", Ref: "main", Submodules: true}
	fr := newFetcher(t)
	fr.Limits.MaxSubmodules = 2
	e := fetchErr(t, fr, src, v1.ReasonGitTooLarge)
	mustContain(t, e.Message, "MaxSubmodules=2", `"c"`)
	fr.Limits.MaxSubmodules = 3
	fetchOK(t, fr, src)
}
