package gitsource

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/go-git/go-git/v5/plumbing/filemode"
	"github.com/go-git/go-git/v5/plumbing/format/pktline"
	"github.com/go-git/go-git/v5/plumbing/object"

	v1 "github.com/buildq/buildq/api/v1"
)

// limited fetches ref of repo under limits and wants a GitTooLarge
// failure naming the limit; it returns the bytes the fetch received.
func limited(t *testing.T, repo *testRepo, src Source, lim Limits, says ...string) {
	t.Helper()
	limitedWith(t, v1.ReasonGitTooLarge, repo, src, lim, says...)
}

// limitedWith is limited for a limit with a reason of its own.
func limitedWith(t *testing.T, reason string, repo *testRepo, src Source, lim Limits, says ...string) {
	t.Helper()
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	src.URL = base + "/r.git"
	fr := newFetcher(t)
	fr.Limits = lim
	e := fetchErr(t, fr, src, reason)
	mustContain(t, e.Message, says...)
	if entries, _ := os.ReadDir(fr.TempDir); len(entries) != 0 {
		t.Errorf("a refused fetch left %d files behind", len(entries))
	}
}

func TestLimits_FetchBytes(t *testing.T) {
	t.Parallel()
	noise := make([]byte, 300<<10) // incompressible
	_, _ = rand.Read(noise)
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"noise": reg(string(noise))})
	limited(t, repo, Source{Ref: "main"}, Limits{MaxFetchBytes: 100 << 10}, "MaxFetchBytes=102400")
}

func TestLimits_Objects(t *testing.T) {
	t.Parallel()
	files := map[string]f{}
	for i := range 30 {
		files[fmt.Sprintf("f%02d", i)] = reg(fmt.Sprint(i))
	}
	repo := newRepo(t)
	repo.commitFiles("main", files)
	limitedWith(t, v1.ReasonGitTooManyObjects, repo, Source{Ref: "main"}, Limits{MaxObjects: 5}, "MaxObjects=5", "32 objects")
}

func TestLimits_ContextBytes(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("x", 1000)
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"a": reg(big), "b": reg(big), "c": reg(big)})
	limited(t, repo, Source{Ref: "main"}, Limits{MaxContextBytes: 2500}, "MaxContextBytes=2500")

	// What .dockerignore excludes is neither written nor counted.
	repo.commitFiles("excluded", map[string]f{"a": reg(big), "big.bin": reg(strings.Repeat("y", 10000)), ".dockerignore": reg("*.bin\n")})
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	fr := newFetcher(t)
	fr.Limits.MaxContextBytes = 2500
	fetchOK(t, fr, Source{URL: base + "/r.git", Ref: "excluded"})
}

// A blob of zeros deflates about a thousandfold: a few kilobytes fetched
// would be megabytes in go-git's memory. It is refused from its header.
func TestLimits_ZipBombBlob(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"zeros": reg(string(make([]byte, 16<<20)))})
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	fr := newFetcher(t)
	fr.Limits.MaxObjectBytes = 1 << 20
	e := fetchErr(t, fr, Source{URL: base + "/r.git", Ref: "main"}, v1.ReasonGitTooLarge)
	mustContain(t, e.Message, "MaxObjectBytes=1048576", "16777216 bytes")
}

// Deltas against one another claim sizes far beyond their bytes.
func TestLimits_ExpandedBytes(t *testing.T) {
	t.Parallel()
	base := make([]byte, 256<<10)
	_, _ = rand.Read(base)
	files := map[string]f{}
	for i := range 20 {
		v := bytes.Clone(base)
		v[i] ^= 0xff
		files[fmt.Sprintf("v%02d", i)] = reg(string(v))
	}
	repo := newRepo(t)
	repo.commitFiles("main", files)
	limited(t, repo, Source{Ref: "main"}, Limits{MaxExpandedBytes: 2 << 20}, "MaxExpandedBytes=2097152")
}

// One small tree object can list the same empty blob a million times.
func TestLimits_TreeEntriesBomb(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	empty := repo.blob(nil)
	entries := make([]object.TreeEntry, 60_000)
	for i := range entries {
		entries[i] = object.TreeEntry{Name: fmt.Sprintf("f%05d", i), Mode: filemode.Regular, Hash: empty}
	}
	repo.setRef("refs/heads/main", repo.commit(repo.rawTree(entries), "wide"))
	limited(t, repo, Source{Ref: "main"}, Limits{}, "more than 50000 files and directories")

	deep := repo.tree(map[string]f{strings.Repeat("d/", 70) + "f": reg("x")})
	repo.setRef("refs/heads/deep", repo.commit(deep, "deep"))
	limited(t, repo, Source{Ref: "deep"}, Limits{}, "more than 64 directories deep")
}

func TestLimits_Depth(t *testing.T) {
	t.Parallel()
	for _, opts := range []serverOpts{{}, {noShallow: true}, {byHash: true}} {
		repo := newRepo(t)
		commits, files := history(repo, 5)
		_, base := serve(t, opts, map[string]*testRepo{"r": repo})
		fr := newFetcher(t)
		fr.Limits.MaxDepth = 3
		e := fetchErr(t, fr, Source{URL: base + "/r.git", Ref: "main", Commit: commits[0].String()}, v1.ReasonGitTooDeep)
		mustContain(t, e.Message, "MaxDepth=3", commits[0].String())
		// The third commit from the tip is within the limit.
		c := fetchOK(t, fr, Source{URL: base + "/r.git", Ref: "main", Commit: commits[2].String()})
		if c.Digest != uploadDigest(t, files[2], "") {
			t.Errorf("%+v: digest %s", opts, c.Digest)
		}
	}
}

func TestLimits_Timeout(t *testing.T) {
	t.Parallel()
	// The server never answers: it waits for the client to give up.
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	fr := newFetcher(t)
	fr.Limits.Timeout = 200 * time.Millisecond
	e := fetchErr(t, fr, Source{URL: srv.URL + "/r.git", Ref: "main"}, v1.ReasonGitTimeout)
	mustContain(t, e.Message, "200ms", "Timeout")

	// An SSH server that accepts and never speaks: the handshake ends
	// with the Fetch's deadline.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, conn); _ = conn.Close() }()
		}
	}()
	fr.Credentials = creds(&Credentials{InsecureIgnoreHostKey: true})
	e = fetchErr(t, fr, Source{URL: "ssh://git@" + ln.Addr().String() + "/r.git", Ref: "main"}, v1.ReasonGitTimeout)
	mustContain(t, e.Message, "Timeout")
}

// A ref advertisement is read up to 16 MiB: go-git holds every ref in
// maps.
func TestLimits_Advertisement(t *testing.T) {
	t.Parallel()
	advertise := func(bytes int) string {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodGet {
				http.NotFound(w, r)
				return
			}
			w.Header().Set("Content-Type", "application/x-git-upload-pack-advertisement")
			enc := pktline.NewEncoder(w)
			hash := strings.Repeat("1", 40)
			_ = enc.EncodeString("# service=git-upload-pack\n")
			_ = enc.Flush()
			_ = enc.EncodeString(hash + " refs/heads/main\x00ofs-delta side-band-64k\n")
			for i, sent := 0, 0; sent < bytes; i++ {
				line := fmt.Sprintf("%s refs/heads/%06d-%s\n", hash, i, strings.Repeat("x", 60000))
				_ = enc.EncodeString(line)
				sent += len(line) + 4
			}
			_ = enc.Flush()
		}))
		t.Cleanup(srv.Close)
		return srv.URL + "/r.git"
	}
	e := fetchErr(t, newFetcher(t), Source{URL: advertise(17 << 20), Ref: "main"}, v1.ReasonGitTooLarge)
	mustContain(t, e.Message, "more than 16 MiB of refs")

	// Just under: read, then the fetch fails for want of a pack.
	c, err := newFetcher(t).Fetch(context.Background(), "tenant", Source{URL: advertise(15 << 20), Ref: "main"}, nil)
	if err == nil {
		_ = c.Remove()
		t.Fatal("fetched from a server without packs")
	}
	if !strings.Contains(err.Error(), "404") {
		t.Fatalf("a 15 MiB advertisement: %v, want the upload-pack request's 404", err)
	}
}
