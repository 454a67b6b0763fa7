package gitsource

import (
	"bytes"
	"context"
	"crypto/sha1" //nolint:gosec // the pack format's checksum
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/format/pktline"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp/capability"

	v1 "github.com/buildq/buildq/api/v1"
)

// rawPackServer advertises an honest repository's refs and answers every
// upload-pack request with pack, whatever was asked.
func rawPackServer(t *testing.T, pack []byte) string {
	t.Helper()
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"Dockerfile": reg("FROM scratch\n")})
	git := newGitServer(t, serverOpts{})
	git.repos["/r.git"] = repo
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			git.ServeHTTP(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/x-git-upload-pack-result")
		enc := pktline.NewEncoder(w)
		_ = enc.Flush() // the shallow list
		_ = enc.EncodeString("NAK\n")
		for i := 0; i < len(pack); i += 60000 {
			_ = enc.Encode(append([]byte{1}, pack[i:min(i+60000, len(pack))]...))
		}
		_ = enc.Flush()
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/r.git"
}

// A chain of deltas deeper than git's default pack.depth is refused from
// the delta that crosses it; one as deep passes the guard (and the fetch
// then fails for the commit the pack lacks).
func TestPackGuard_DeltaDepth(t *testing.T) {
	t.Parallel()
	fr := newFetcher(t)
	fr.Limits.MaxExpandedBytes = 1 << 40
	e := fetchErr(t, fr, Source{URL: rawPackServer(t, interleavedDeltaChains(1, maxDeltaDepth+1, 1024)), Ref: "main"}, v1.ReasonGitTooDeep)
	mustContain(t, e.Message, fmt.Sprintf("limit of %d deltas", maxDeltaDepth))

	c, err := fr.Fetch(context.Background(), "tenant", Source{URL: rawPackServer(t, interleavedDeltaChains(1, maxDeltaDepth, 1024)), Ref: "main"}, nil)
	if err == nil {
		_ = c.Remove()
		t.Fatal("fetched a pack without the commit")
	}
	if errors.As(err, &e) && e.Reason == v1.ReasonGitTooLarge {
		t.Fatalf("a chain of %d deltas refused: %s", maxDeltaDepth, e.Message)
	}
}

// A delta is charged what rebuilding it from its chain's whole object
// takes: chains of 1 KiB objects, 10 deltas deep, declare 11 KiB a chain
// and are charged 1 + (2+1) + 3 + 4 + ... + 11 = 67 KiB (the first delta
// is applied twice), and the deltas' own few bytes.
func TestPackGuard_DeltaChainsAreChargedTheirChain(t *testing.T) {
	t.Parallel()
	const chains, depth, size = 4, 10, 1024
	pack := interleavedDeltaChains(chains, depth, size)
	fr := newFetcher(t)
	fr.Limits.MaxExpandedBytes = chains * (depth + 1) * size * 4 // over what the objects declare
	e := fetchErr(t, fr, Source{URL: rawPackServer(t, pack), Ref: "main"}, v1.ReasonGitTooLarge)
	mustContain(t, e.Message, fmt.Sprintf("MaxExpandedBytes=%d", fr.Limits.MaxExpandedBytes))

	fr.Limits.MaxExpandedBytes = chains * 70 * size // over 67 KiB a chain, deltas' own bytes included
	c, err := fr.Fetch(context.Background(), "tenant", Source{URL: rawPackServer(t, pack), Ref: "main"}, nil)
	if err == nil {
		_ = c.Remove()
	}
	if errors.As(err, &e) && e.Reason == v1.ReasonGitTooLarge {
		t.Fatalf("charged more than the chains' cost: %s", e.Message)
	}
}

// refDeltaPack is a pack of a blob and a REF_DELTA against it.
func refDeltaPack() []byte {
	var p bytes.Buffer
	p.WriteString("PACK")
	_ = binary.Write(&p, binary.BigEndian, uint32(2))
	_ = binary.Write(&p, binary.BigEndian, uint32(2))
	blob := []byte("hello")
	p.Write(packObjectHeader(3, uint64(len(blob))))
	p.Write(deflated(blob))
	base := sha1.Sum([]byte("blob 5\x00hello")) //nolint:gosec // git's object name
	delta := append(deltaVarint(5), deltaVarint(6)...)
	delta = append(delta, 0x90, 5, 1, '!') // copy 5 from 0; insert "!"
	p.Write(packObjectHeader(objREFDelta, uint64(len(delta))))
	p.Write(base[:])
	p.Write(deflated(delta))
	sum := sha1.Sum(p.Bytes()) //nolint:gosec // the pack format's checksum
	p.Write(sum[:])
	return p.Bytes()
}

// buildq asks for ofs-delta and no thin pack: a delta whose base is named
// by hash is refused, its cost being unknown.
func TestPackGuard_RefDeltaRefused(t *testing.T) {
	t.Parallel()
	e := fetchErr(t, newFetcher(t), Source{URL: rawPackServer(t, refDeltaPack()), Ref: "main"}, v1.ReasonInvalidRequest)
	mustContain(t, e.Message, "REF_DELTA", "ofs-delta")

	for _, offered := range []bool{true, false} {
		caps := capability.NewList()
		if offered {
			_ = caps.Add(capability.OFSDelta)
		}
		_ = caps.Add(capability.ThinPack)
		enc, err := uploadRequest{wants: []plumbing.Hash{plumbing.NewHash("1234567890123456789012345678901234567890")}}.encode(caps)
		if err != nil {
			t.Fatal(err)
		}
		if enc.ofsDelta != offered || bytes.Contains(enc.body, []byte(capability.OFSDelta)) != offered {
			t.Errorf("ofs-delta offered %v: asked %v, request %q", offered, enc.ofsDelta, enc.body)
		}
		if bytes.Contains(enc.body, []byte(capability.ThinPack)) {
			t.Errorf("asked for a thin pack: %q", enc.body)
		}
	}
}

// go-git indexes a pack in the pack writer's Close, which takes no
// context; the Timeout still ends it (through the store's files). The
// pack passes limits raised out of the way and would keep go-git busy
// for many seconds.
func TestPackGuard_TimeoutEndsIndexing(t *testing.T) {
	if testing.Short() {
		t.Skip("a second of delta resolution")
	}
	t.Parallel()
	u := rawPackServer(t, interleavedDeltaChains(100, 8, 1<<20))
	fr := newFetcher(t)
	fr.Limits = Limits{MaxExpandedBytes: 1 << 50, Timeout: time.Second}
	start := time.Now()
	e := fetchErr(t, fr, Source{URL: u, Ref: "main"}, v1.ReasonGitTimeout)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("a fetch with a Timeout of 1s took %s: %s", took.Round(time.Millisecond), e.Message)
	}
}
