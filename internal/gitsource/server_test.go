package gitsource

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/filemode"
	"github.com/go-git/go-git/v5/plumbing/format/packfile"
	"github.com/go-git/go-git/v5/plumbing/format/pktline"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp/capability"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp/sideband"
	"github.com/go-git/go-git/v5/plumbing/storer"
)

// gitServer is an in-process git server speaking upload-pack (protocol
// v0) over smart HTTP (ServeHTTP) and SSH (sshserver_test.go), written
// on go-git's object store and encoders. Unlike go-git's own
// plumbing/transport/server it makes shallow packs (deepen), can refuse
// wants that are not ref tips ("not our ref", git's default) or serve any
// reachable commit with blob filters (allow-reachable-sha1-in-want,
// uploadpack.allowFilter), as git and GitHub do.
type gitServer struct {
	t     *testing.T
	repos map[string]*testRepo // by URL path, "/name.git"
	opts  serverOpts
	// realGit, when set, is a git binary whose upload-pack serves SSH
	// sessions instead (interop tests).
	realGit string

	mu       sync.Mutex
	requests int             // HTTP requests and SSH sessions
	log      []uploadRequest // upload-pack requests served
}

type serverOpts struct {
	byHash    bool   // allow-reachable-sha1-in-want and filter
	noShallow bool   // no shallow capability: whole histories only
	user      string // HTTP basic auth required when set
	pass      string
}

func newGitServer(t *testing.T, opts serverOpts) *gitServer {
	return &gitServer{t: t, repos: map[string]*testRepo{}, opts: opts}
}

// serveHTTP starts the server on 127.0.0.1 and returns its base URL.
func (s *gitServer) serveHTTP() string {
	srv := httptest.NewServer(s)
	s.t.Cleanup(srv.Close)
	return srv.URL
}

func (s *gitServer) count() {
	s.mu.Lock()
	s.requests++
	s.mu.Unlock()
}

func (s *gitServer) requestCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests
}

func (s *gitServer) uploads() []uploadRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]uploadRequest(nil), s.log...)
}

// ServeHTTP implements git's smart HTTP protocol for upload-pack.
func (s *gitServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.count()
	if s.opts.user != "" {
		if u, p, ok := r.BasicAuth(); !ok || u != s.opts.user || p != s.opts.pass {
			w.Header().Set("WWW-Authenticate", `Basic realm="git"`)
			http.Error(w, "Authentication failed", http.StatusUnauthorized)
			return
		}
	}
	switch {
	case r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/info/refs") && r.URL.Query().Get("service") == "git-upload-pack":
		repo := s.repos[strings.TrimSuffix(r.URL.Path, "/info/refs")]
		if repo == nil {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/x-git-upload-pack-advertisement")
		if err := s.advertise(w, repo, true); err != nil {
			s.t.Errorf("advertise: %v", err)
		}
	case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/git-upload-pack"):
		repo := s.repos[strings.TrimSuffix(r.URL.Path, "/git-upload-pack")]
		if repo == nil {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/x-git-upload-pack-result")
		if err := s.upload(r.Body, w, repo); err != nil && !errors.Is(err, io.ErrClosedPipe) {
			s.t.Logf("upload-pack: %v", err)
		}
	default:
		http.NotFound(w, r)
	}
}

// refs lists repo's refs: name -> hash, and peeled values of tags.
func refs(repo *testRepo) (map[string]plumbing.Hash, map[string]plumbing.Hash, error) {
	out, peeled := map[string]plumbing.Hash{}, map[string]plumbing.Hash{}
	iter, err := repo.st.IterReferences()
	if err != nil {
		return nil, nil, err
	}
	err = iter.ForEach(func(ref *plumbing.Reference) error {
		if ref.Type() != plumbing.HashReference {
			return nil
		}
		out[ref.Name().String()] = ref.Hash()
		if tag, err := object.GetTag(repo.st, ref.Hash()); err == nil {
			peeled[ref.Name().String()] = tag.Target
		}
		return nil
	})
	return out, peeled, err
}

func (s *gitServer) advertise(w io.Writer, repo *testRepo, httpPrefix bool) error {
	ar := packp.NewAdvRefs()
	if httpPrefix {
		ar.Prefix = [][]byte{[]byte("# service=git-upload-pack"), pktline.Flush}
	}
	all, peeled, err := refs(repo)
	if err != nil {
		return err
	}
	ar.References, ar.Peeled = all, peeled
	caps := []capability.Capability{capability.OFSDelta, capability.Sideband64k, capability.NoProgress}
	if !s.opts.noShallow {
		caps = append(caps, capability.Shallow)
	}
	if s.opts.byHash {
		caps = append(caps, capability.AllowReachableSHA1InWant, capability.Filter)
	}
	for _, c := range caps {
		if err := ar.Capabilities.Add(c); err != nil {
			return err
		}
	}
	_ = ar.Capabilities.Add(capability.Agent, "buildq-test")
	if head, err := repo.st.Reference(plumbing.HEAD); err == nil && head.Type() == plumbing.SymbolicReference {
		if h, ok := all[head.Target().String()]; ok {
			ar.Head = &h
			_ = ar.Capabilities.Add(capability.SymRef, "HEAD:"+head.Target().String())
		}
	}
	return ar.Encode(w)
}

// upload answers one upload-pack request read from in.
func (s *gitServer) upload(in io.Reader, w io.Writer, repo *testRepo) error {
	sc := pktline.NewScanner(in)
	var q uploadRequest
	sb := false
	for sc.Scan() {
		line := strings.TrimSuffix(string(sc.Bytes()), "\n")
		if line == "" {
			break
		}
		fields := strings.Fields(line)
		switch fields[0] {
		case "want":
			q.wants = append(q.wants, plumbing.NewHash(fields[1]))
			for _, c := range fields[2:] {
				sb = sb || c == "side-band-64k"
			}
		case "deepen":
			q.depth, _ = strconv.Atoi(fields[1])
		case "filter":
			q.filter = packp.Filter(fields[1])
		}
	}
	if len(q.wants) == 0 {
		return sc.Err() // refs only: the client said goodbye with a flush
	}
	for sc.Scan() {
		if strings.TrimSpace(string(sc.Bytes())) == "done" {
			break
		}
	}
	s.mu.Lock()
	s.log = append(s.log, q)
	s.mu.Unlock()

	enc := pktline.NewEncoder(w)
	if bad, err := s.notOurs(repo, q.wants); err != nil || !bad.IsZero() {
		if err != nil {
			return err
		}
		return (&pktline.ErrorLine{Text: "upload-pack: not our ref " + bad.String()}).Encode(w)
	}
	objs, shallows, err := closure(repo.st, q)
	if err != nil {
		return err
	}
	if q.depth > 0 {
		for _, h := range shallows {
			if err := enc.Encodef("shallow %s\n", h); err != nil {
				return err
			}
		}
		if err := enc.Flush(); err != nil {
			return err
		}
	}
	if err := enc.Encodef("NAK\n"); err != nil {
		return err
	}
	out := w
	if sb {
		out = sideband.NewMuxer(sideband.Sideband64k, w)
	}
	if _, err := packfile.NewEncoder(out, repo.st, false).Encode(objs, 10); err != nil {
		return err
	}
	if sb {
		return enc.Flush()
	}
	return nil
}

// notOurs returns the first want the server will not serve: not a ref
// tip (git's default), or with byHash not reachable from any ref.
func (s *gitServer) notOurs(repo *testRepo, wants []plumbing.Hash) (plumbing.Hash, error) {
	all, _, err := refs(repo)
	if err != nil {
		return plumbing.ZeroHash, err
	}
	tips := map[plumbing.Hash]bool{}
	for _, h := range all {
		tips[h] = true
	}
	var reachable map[plumbing.Hash]bool
	for _, want := range wants {
		if tips[want] {
			continue
		}
		if !s.opts.byHash {
			return want, nil
		}
		if reachable == nil {
			reachable = map[plumbing.Hash]bool{}
			for tip := range tips {
				_ = walkCommits(repo.st, peelTo(repo.st, tip), 0, func(h plumbing.Hash, _ *object.Commit, _ bool) { reachable[h] = true })
			}
		}
		if !reachable[want] {
			return want, nil
		}
	}
	return plumbing.ZeroHash, nil
}

func peelTo(st storer.EncodedObjectStorer, h plumbing.Hash) plumbing.Hash {
	for {
		tag, err := object.GetTag(st, h)
		if err != nil {
			return h
		}
		h = tag.Target
	}
}

// walkCommits calls fn for each commit within depth (0 = all) of start,
// saying whether it is a shallow boundary (has parents not walked).
func walkCommits(st storer.EncodedObjectStorer, start plumbing.Hash, depth int, fn func(plumbing.Hash, *object.Commit, bool)) error {
	type item struct {
		h plumbing.Hash
		d int
	}
	seen := map[plumbing.Hash]bool{start: true}
	queue := []item{{start, 1}}
	for len(queue) > 0 {
		it := queue[0]
		queue = queue[1:]
		c, err := object.GetCommit(st, it.h)
		if err != nil {
			return fmt.Errorf("commit %s: %w", it.h, err)
		}
		boundary := depth > 0 && it.d >= depth && len(c.ParentHashes) > 0
		fn(it.h, c, boundary)
		if boundary {
			continue
		}
		for _, p := range c.ParentHashes {
			if !seen[p] {
				seen[p] = true
				queue = append(queue, item{p, it.d + 1})
			}
		}
	}
	return nil
}

// closure lists the objects a request gets, and the shallow boundary.
func closure(st storer.EncodedObjectStorer, q uploadRequest) ([]plumbing.Hash, []plumbing.Hash, error) {
	seen := map[plumbing.Hash]bool{}
	var objs, shallows []plumbing.Hash
	add := func(h plumbing.Hash) bool {
		if seen[h] {
			return false
		}
		seen[h] = true
		objs = append(objs, h)
		return true
	}
	var addTree func(h plumbing.Hash) error
	addTree = func(h plumbing.Hash) error {
		if !add(h) {
			return nil
		}
		t, err := object.GetTree(st, h)
		if err != nil {
			return err
		}
		for _, e := range t.Entries {
			switch {
			case e.Mode == filemode.Dir:
				if err := addTree(e.Hash); err != nil {
					return err
				}
			case e.Mode == filemode.Submodule:
			case q.filter != "blob:none":
				add(e.Hash)
			}
		}
		return nil
	}
	for _, want := range q.wants {
		h := want
		for {
			tag, err := object.GetTag(st, h)
			if err != nil {
				break
			}
			add(h)
			h = tag.Target
		}
		var werr error
		err := walkCommits(st, h, q.depth, func(ch plumbing.Hash, c *object.Commit, boundary bool) {
			if boundary {
				shallows = append(shallows, ch)
			}
			if add(ch) && werr == nil {
				werr = addTree(c.TreeHash)
			}
		})
		if err == nil {
			err = werr
		}
		if err != nil {
			return nil, nil, err
		}
	}
	return objs, shallows, nil
}
