//go:build integration

package integration

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/crypto/ssh"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/natsconf"
	"github.com/buildq/buildq/publisher"
)

// gitFixtures are the repositories of TestGitSources, made with the git
// binary and served by gitServer.
type gitFixtures struct {
	// app: c0 → c1 (annotated tag v1) → c2 (main's tip); a .dockerignore,
	// an executable, a symlink and a sub-directory with its own
	// Dockerfile.
	app        *gitRepo
	c0, c1, c2 string
	// private is served over HTTP only with acme's token, over SSH only
	// to acme's key.
	private       *gitRepo
	privateCommit string
	// forced: main was at forcedOld, then force-pushed to forcedNew.
	forced               *gitRepo
	forcedOld, forcedNew string
	// super has a commit of lib as a submodule (a relative URL).
	super, lib  *gitRepo
	superCommit string
	// lfs has a Git LFS pointer; many a tree of 3000 distinct blobs;
	// big a blob of 65 MiB of zeros (over the worker's 64 MiB
	// MaxObjectBytes); both at most a few hundred KiB on the wire.
	lfs, many, big *gitRepo
	// pwn is a copy of app that only the attack requests name.
	pwn *gitRepo
}

const (
	appDockerfile = "FROM scratch\nCOPY . /src/\n"
	// bigBlobBytes is over gitsource.DefaultMaxObjectBytes (64 MiB).
	bigBlobBytes = 65 << 20
	manyBlobs    = 3000
	// gitMaxObjects is the strict worker's --git-max-objects: above
	// every fixture but many.
	gitMaxObjects = "1000"
)

func makeGitFixtures(t *testing.T, g *gitServer) *gitFixtures {
	t.Helper()
	start := time.Now()
	fx := &gitFixtures{big: &gitRepo{s: g, name: "big", work: t.TempDir()}}
	// The blob of zeros takes git seconds to hash and deflate: made
	// meanwhile.
	big := make(chan error, 1)
	go func() { big <- makeBigRepo(g, fx.big) }()

	fx.app = g.repo("app")
	fx.c0 = fx.app.commit("c0", map[string]gitFile{
		"Dockerfile":     {body: appDockerfile},
		".dockerignore":  {body: "secret.txt\n"},
		"secret.txt":     {body: "not for the build\n"},
		"version.txt":    {body: "c0\n"},
		"bin/run.sh":     {body: "#!/bin/sh\necho run\n", exec: true},
		"link":           {link: "version.txt"},
		"app/Dockerfile": {body: "FROM scratch\nCOPY . /app/\n"},
		"app/main.txt":   {body: "app at c0\n"},
	})
	fx.c1 = fx.app.commit("c1", map[string]gitFile{"version.txt": {body: "c1\n"}, "app/main.txt": {body: "app at c1\n"}})
	g.run(fx.app.work, "tag", "-a", "v1", "-m", "release v1", fx.c1)
	fx.c2 = fx.app.commit("c2", map[string]gitFile{"version.txt": {body: "c2\n"}, "app/main.txt": {body: "app at c2\n"}})
	fx.app.push("main", "v1")

	fx.pwn = &gitRepo{s: g, name: "pwn"}
	g.run(g.root, "clone", "-q", "--bare", fx.app.bare(), "pwn.git")

	fx.private = g.repo("private")
	fx.privateCommit = fx.private.commit("private", map[string]gitFile{
		"Dockerfile":  {body: "FROM scratch\nCOPY private.txt /private.txt\n"},
		"private.txt": {body: "acme's private source\n"},
	})
	fx.private.push("main")
	g.private[fx.private.path()] = true

	fx.forced = g.repo("forced")
	base := fx.forced.commit("base", map[string]gitFile{"Dockerfile": {body: appDockerfile}, "f": {body: "base\n"}})
	fx.forcedOld = fx.forced.commit("old", map[string]gitFile{"f": {body: "old\n"}})
	fx.forced.push("main")
	g.run(fx.forced.work, "reset", "-q", "--hard", base)
	fx.forcedNew = fx.forced.commit("new", map[string]gitFile{"f": {body: "new\n"}})
	fx.forced.push("--force", "main")

	fx.lib = g.repo("lib")
	libCommit := fx.lib.commit("lib", map[string]gitFile{"lib.txt": {body: "library at v1\n"}})
	fx.lib.push("main")
	fx.super = g.repo("super")
	if err := os.MkdirAll(filepath.Join(fx.super.work, "lib"), 0o755); err != nil {
		t.Fatal(err)
	}
	fx.superCommit = fx.super.commit("super", map[string]gitFile{
		"Dockerfile":  {body: appDockerfile},
		"main.txt":    {body: "superproject\n"},
		".gitmodules": {body: "[submodule \"lib\"]\n\tpath = lib\n\turl = ../lib.git\n"},
	}, []string{"update-index", "--add", "--cacheinfo", "160000," + libCommit + ",lib"})
	fx.super.push("main")

	fx.lfs = g.repo("lfs")
	fx.lfs.commit("lfs", map[string]gitFile{
		"Dockerfile":     {body: appDockerfile},
		".gitattributes": {body: "*.bin filter=lfs diff=lfs merge=lfs -text\n"},
		"model.bin":      {body: "version https://git-lfs.github.com/spec/v1\noid sha256:" + strings.Repeat("ab", 32) + "\nsize 1048576\n"},
	})
	fx.lfs.push("main")

	fx.many = g.repo("many")
	files := map[string]gitFile{"Dockerfile": {body: appDockerfile}}
	for i := range manyBlobs {
		files[fmt.Sprintf("many/%04d", i)] = gitFile{body: fmt.Sprintf("%d\n", i)}
	}
	fx.many.commit("many", files)
	fx.many.push("main")

	if err := <-big; err != nil {
		t.Fatalf("the big repository: %v", err)
	}
	t.Logf("git fixtures made in %s", time.Since(start).Round(10*time.Millisecond))
	return fx
}

// makeBigRepo makes big.git: one commit with a blob of bigBlobBytes zeros.
// The file is sparse (no disk), git streams it into a pack with a low
// bigFileThreshold instead of reading it into memory, and the served
// repository is a local clone (hard links: no second pass over the blob).
// It runs on its own goroutine, so it reports errors instead of failing
// the test.
func makeBigRepo(g *gitServer, r *gitRepo) error {
	if err := os.WriteFile(filepath.Join(r.work, "Dockerfile"), []byte(appDockerfile), 0o644); err != nil {
		return err
	}
	zeros, err := os.Create(filepath.Join(r.work, "zeros.bin"))
	if err != nil {
		return err
	}
	err = zeros.Truncate(bigBlobBytes)
	if cerr := zeros.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	for _, args := range [][]string{
		{"init", "-q", "-b", "main"},
		{"-c", "core.bigFileThreshold=1m", "add", "-A"},
		{"commit", "-q", "-m", "a blob of zeros"},
		{"clone", "-q", "--bare", "--local", r.work, r.bare()},
		{"--git-dir", r.bare(), "config", "core.bigFileThreshold", "1m"},
	} {
		if _, err := g.runE(r.work, args...); err != nil {
			return err
		}
	}
	return nil
}

// gitEnv is one worker's side of TestGitSources: its suite, results and
// the request ids its Jobs were made for.
type gitEnv struct {
	s    *suite
	res  *results
	jobs func() map[string]string
}

func newGitEnv(t *testing.T, workerArgs ...string) *gitEnv {
	t.Helper()
	s := newSuite(t, options{workerArgs: append(fetchArgs(), workerArgs...)})
	e := &gitEnv{s: s, jobs: s.jobRequests()}
	s.startWorker("w1")
	e.res = s.collect()
	s.waitWorkers()
	return e
}

// publish publishes a request of tenant for src.
func (e *gitEnv) publish(t *testing.T, tenant, name string, src v1.GitSource) *v1.Request {
	t.Helper()
	req := &v1.Request{Tenant: tenant, Name: name, Source: v1.Source{Git: &src}}
	if _, err := e.s.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	return req
}

// gitWant is what a git build's result must say.
type gitWant struct {
	url, ref, commit, subPath string
	// checkout is the checked-out directory the context must equal.
	checkout string
	// files that the image must hold (path → content), and must not.
	files   map[string]string
	without []string
}

// built checks that r is the successful build of want: its source, its
// context digest (that of the checkout, as `buildq submit` computes it),
// the image's files; and that a `buildq submit` of the checkout
// afterwards is answered from the cache with the same key and image.
func (e *gitEnv) built(t *testing.T, r v1.Result, want gitWant) {
	t.Helper()
	d := r.Data
	if d.Status != v1.StatusSucceeded || d.Key == "" || d.Digest == "" {
		t.Fatalf("result %s, want succeeded", mustJSON(r))
	}
	local, err := contexttar.Digest(context.Background(), want.checkout, contexttar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	wantSrc := v1.SourceInfo{GitURL: want.url, Ref: want.ref, Commit: want.commit, SubPath: want.subPath, ContextDigest: local.Digest}
	if d.Source == nil || *d.Source != wantSrc {
		t.Fatalf("result source %s, want %s", mustJSON(d.Source), mustJSON(wantSrc))
	}
	files := imageFiles(t, d.ImageRef)
	for p, body := range want.files {
		if f, ok := files[p]; !ok || string(f.body) != body {
			t.Errorf("image %s: %s is %q (present: %v), want %q", d.ImageRef, p, f.body, ok, body)
		}
	}
	for _, p := range want.without {
		if _, ok := files[p]; ok {
			t.Errorf("image %s has %s, which .dockerignore excludes", d.ImageRef, p)
		}
	}
	out, errOut, code := runCLI(t, 3*time.Minute, "submit", want.checkout, "--tenant", d.Tenant, "--name", d.Name,
		"--nats-url", e.s.natsURL, "--s3-endpoint", e.s.minioEndpoint, "--s3-bucket", shared.bucket,
		"--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword,
		"--wait", "--wait-timeout", "2m", "-o", "json")
	var up v1.ResultData
	if code != 0 || json.Unmarshal([]byte(out), &up) != nil {
		t.Fatalf("buildq submit %s: exit %d\n%s\n%s", want.checkout, code, out, errOut)
	}
	if up.Status != v1.StatusSucceeded || up.Origin != v1.OriginCache || up.Key != d.Key || up.Digest != d.Digest {
		t.Fatalf("buildq submit of the checkout: %s; want succeeded from the cache with key %s and digest %s", mustJSON(up), d.Key, d.Digest)
	}
	if e.jobs()[up.RequestID] != "" {
		t.Errorf("the upload of the checkout made a Job")
	}
}

// refused checks that req failed at once with reason: one result, no
// image, no Job; its message holds each of words.
func (e *gitEnv) refused(t *testing.T, req *v1.Request, reason string, words ...string) v1.Result {
	t.Helper()
	r := e.res.waitID(t, req.RequestID, 2*time.Minute)
	d := r.Data
	if d.Status != v1.StatusFailed || d.Reason != reason || d.Image != "" || d.Digest != "" || d.ImageRef != "" || d.Job != "" {
		t.Fatalf("result %s, want failed/%s with no image and no Job", mustJSON(r), reason)
	}
	for _, w := range words {
		if !strings.Contains(d.Message, w) {
			t.Errorf("message %q does not say %q", d.Message, w)
		}
	}
	if tenant, ok := e.jobs()[req.RequestID]; ok {
		t.Errorf("a Job (tenant %s) was made for request %s", tenant, req.RequestID)
	}
	return r
}

// TestGitSources builds git sources through real `buildq worker`
// processes (the emulated node) from a real git server: git http-backend
// behind net/http/cgi and git upload-pack behind a Go SSH server. Every
// outcome is read from the published results; the collector fails the
// test if any request gets more than one.
//
//   - branch, annotated tag, commit without a ref, subPath, submodules (on
//     and off): succeeded, the result names the url, the ref, the
//     resolved commit and a context digest equal to that of the checked-out
//     directory (contexttar, as `buildq submit` computes it), the image
//     holds that commit's files, and a `buildq submit` of the checkout
//     afterwards is answered from the cache under the same key;
//   - a private repository with tenant acme's token (HTTP) and key with
//     known_hosts (SSH); tenants beta (no credentials) and globex (its
//     own, which the server refuses) asking for it, its commit pinned, get
//     GitAuthFailed, no image and no Job, and the listeners they reached
//     never saw acme's token or key;
//   - a commit that a force-push made unreachable (GitCommitNotFound), a
//     Git LFS pointer (GitLFSPointer), an unknown ref (GitRefNotFound);
//   - attacks: a ref that reads as an option (a raw publish: the CLI and
//     SDK refuse it) is InvalidRequest and nothing runs; a redirect to the
//     cloud metadata address and a host not in --allowed-git-host are
//     GitHostRefused, the latter before any connection; pack bombs, a few
//     hundred KiB on the wire: a tree of 3000 blobs against
//     --git-max-objects (GitTooManyObjects) and a 65 MiB blob of zeros
//     against the 64 MiB object limit (GitTooLarge).
//
// Failures never create a Job.
func TestGitSources(t *testing.T) {
	g := startGitServer(t)
	fx := makeGitFixtures(t, g)

	// Tenant acme's git Secret: a token for HTTP, a key and known_hosts
	// for SSH. globex has its own token and key, which the server does
	// not accept; beta has nothing.
	acmeSigner, acmeKey := newSSHKey(t)
	_, globexKey := newSSHKey(t)
	g.authorize(acmeSigner.PublicKey())
	g.user, g.pass = "acme-ci", "acme-token-"+randomHex(t, 16)
	g.redirects["/moved.git"] = "http://169.254.169.254/latest/meta-data/moved.git"

	web := g.serveHTTP("127.0.0.1")
	sshd := g.serveSSH()
	// The listeners only the other tenants' requests reach, so what
	// they saw is theirs alone.
	witnessHTTP := g.serveHTTP("127.0.0.1")
	witnessSSH := g.serveSSH()
	// A git server at an address the strict worker is not allowed.
	elsewhere := g.serveHTTP("127.0.0.2")

	knownHosts := sshd.knownHosts() + witnessSSH.knownHosts()
	creds := t.TempDir()
	for tenant, keys := range map[string]map[string]string{
		"acme":   {"username": g.user + "\n", "password": g.pass + "\n", "ssh-privatekey": string(acmeKey), "known_hosts": knownHosts},
		"globex": {"username": "globex-ci", "password": "globex-token-" + randomHex(t, 16), "ssh-privatekey": string(globexKey), "known_hosts": knownHosts},
	} {
		for k, v := range keys {
			p := filepath.Join(creds, tenant, k)
			if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte(v), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}

	strict := newGitEnv(t, "--allowed-git-host", "127.0.0.1", "--insecure-git-host", "127.0.0.1",
		"--tenant-git-secret", "buildq-git-{tenant}", "--tenant-git-configs", creds,
		"--git-max-objects", gitMaxObjects, "--git-timeout", "2m")
	// Any host name, no private address but 127.0.0.1: a redirect passes
	// the name check and meets the address check.
	open := newGitEnv(t, "--allowed-git-host", "*", "--allowed-git-host", "127.0.0.1", "--insecure-git-host", "*")

	appURL := web.URL + fx.app.path()
	root := func(version string) map[string]string {
		return map[string]string{"src/version.txt": version + "\n", "src/Dockerfile": appDockerfile, "src/bin/run.sh": "#!/bin/sh\necho run\n"}
	}

	t.Run("branch, with buildq submit --git", func(t *testing.T) {
		t.Parallel()
		out, errOut, code := runCLI(t, 3*time.Minute, "submit", "--git", appURL, "--ref", "main", "--tenant", "acme", "--name", "app-branch",
			"--nats-url", strict.s.natsURL, "--wait", "--wait-timeout", "2m", "-o", "json")
		var d v1.ResultData
		if code != 0 || json.Unmarshal([]byte(out), &d) != nil {
			t.Fatalf("buildq submit --git: exit %d\n%s\n%s", code, out, errOut)
		}
		r := strict.res.waitID(t, d.RequestID, time.Minute)
		if mustJSON(r.Data) != mustJSON(d) {
			t.Errorf("the CLI printed %s, the published result is %s", mustJSON(d), mustJSON(r.Data))
		}
		strict.built(t, r, gitWant{url: appURL, ref: "refs/heads/main", commit: fx.c2, checkout: fx.app.checkout(fx.c2, false),
			files: root("c2"), without: []string{"src/secret.txt"}})
	})

	t.Run("annotated tag", func(t *testing.T) {
		t.Parallel()
		req := strict.publish(t, "acme", "app-tag", v1.GitSource{URL: appURL, Ref: "v1"})
		strict.built(t, strict.res.waitID(t, req.RequestID, 2*time.Minute), gitWant{url: appURL, ref: "refs/tags/v1", commit: fx.c1,
			checkout: fx.app.checkout(fx.c1, false), files: root("c1"), without: []string{"src/secret.txt"}})
	})

	t.Run("commit without a ref, below every tip", func(t *testing.T) {
		t.Parallel()
		req := strict.publish(t, "acme", "app-commit", v1.GitSource{URL: appURL, Commit: fx.c0})
		strict.built(t, strict.res.waitID(t, req.RequestID, 2*time.Minute), gitWant{url: appURL, commit: fx.c0,
			checkout: fx.app.checkout(fx.c0, false), files: root("c0"), without: []string{"src/secret.txt"}})
	})

	t.Run("subPath", func(t *testing.T) {
		t.Parallel()
		req := strict.publish(t, "acme", "app-sub", v1.GitSource{URL: appURL, Ref: "main", SubPath: "app"})
		strict.built(t, strict.res.waitID(t, req.RequestID, 2*time.Minute), gitWant{url: appURL, ref: "refs/heads/main", commit: fx.c2, subPath: "app",
			checkout: filepath.Join(fx.app.checkout(fx.c2, false), "app"), files: map[string]string{"app/main.txt": "app at c2\n"}})
	})

	t.Run("submodules, fetched and not", func(t *testing.T) {
		t.Parallel()
		u := web.URL + fx.super.path()
		with := strict.publish(t, "acme", "super-with", v1.GitSource{URL: u, Ref: "main", Submodules: true})
		without := strict.publish(t, "acme", "super-without", v1.GitSource{URL: u, Ref: "main"})
		strict.built(t, strict.res.waitID(t, with.RequestID, 2*time.Minute), gitWant{url: u, ref: "refs/heads/main", commit: fx.superCommit,
			checkout: fx.super.checkout(fx.superCommit, true), files: map[string]string{"src/lib/lib.txt": "library at v1\n", "src/main.txt": "superproject\n"}})
		strict.built(t, strict.res.waitID(t, without.RequestID, 2*time.Minute), gitWant{url: u, ref: "refs/heads/main", commit: fx.superCommit,
			checkout: fx.super.checkout(fx.superCommit, false), files: map[string]string{"src/main.txt": "superproject\n"}, without: []string{"src/lib/lib.txt"}})
	})

	privateFiles := map[string]string{"private.txt": "acme's private source\n"}

	t.Run("private repository over HTTP with the tenant's token", func(t *testing.T) {
		t.Parallel()
		u := web.URL + fx.private.path()
		req := strict.publish(t, "acme", "private-http", v1.GitSource{URL: u, Ref: "main"})
		strict.built(t, strict.res.waitID(t, req.RequestID, 2*time.Minute), gitWant{url: u, ref: "refs/heads/main", commit: fx.privateCommit,
			checkout: fx.private.checkout(fx.privateCommit, false), files: privateFiles})
		// The server checked acme's token (the CGI ran only after it).
		authorized := 0
		for _, h := range web.hitsFor(fx.private.path()) {
			if h.auth && h.user == g.user && h.status == http.StatusOK {
				authorized++
			}
		}
		if authorized == 0 {
			t.Errorf("the server served %s with acme's token to nobody: %+v", fx.private.path(), web.hitsFor(fx.private.path()))
		}
	})

	t.Run("private repository over SSH with the tenant's key and known_hosts", func(t *testing.T) {
		t.Parallel()
		u := sshd.url(fx.private.path())
		req := strict.publish(t, "acme", "private-ssh", v1.GitSource{URL: u, Ref: "main"})
		// Results name the SSH URL with its user name (no secret), as
		// asked.
		strict.built(t, strict.res.waitID(t, req.RequestID, 2*time.Minute), gitWant{url: u, ref: "refs/heads/main", commit: fx.privateCommit,
			checkout: fx.private.checkout(fx.privateCommit, false), files: privateFiles})
	})

	t.Run("other tenants never use acme's credentials", func(t *testing.T) {
		t.Parallel()
		// Each pins the commit acme builds: knowing it gets nothing.
		var reqs []*v1.Request
		for _, tenant := range []string{"beta", "globex"} {
			for _, u := range []string{witnessHTTP.URL + fx.private.path(), witnessSSH.url(fx.private.path())} {
				reqs = append(reqs, strict.publish(t, tenant, "stolen", v1.GitSource{URL: u, Ref: "main", Commit: fx.privateCommit}))
			}
		}
		strict.refused(t, reqs[0], v1.ReasonGitAuthFailed, "requires credentials and the tenant has none")
		strict.refused(t, reqs[1], v1.ReasonGitAuthFailed, "known hosts")
		strict.refused(t, reqs[2], v1.ReasonGitAuthFailed, "refused the tenant's credentials")
		strict.refused(t, reqs[3], v1.ReasonGitAuthFailed, "refused the tenant's SSH key")
		for _, h := range witnessHTTP.all() {
			if h.pass == g.pass || h.user == g.user {
				t.Errorf("acme's token reached the server for another tenant: %+v", h)
			}
			if h.status == http.StatusOK {
				t.Errorf("the server served another tenant: %+v", h)
			}
		}
		acmeFP := ssh.FingerprintSHA256(acmeSigner.PublicKey())
		offered := 0
		for _, h := range witnessSSH.all() {
			switch {
			case h.key == acmeFP:
				t.Errorf("acme's SSH key was offered for another tenant")
			case h.command != "":
				t.Errorf("the SSH server ran %q for another tenant", h.command)
			case h.key != "" && !h.accepted:
				offered++
			}
		}
		if offered == 0 {
			t.Errorf("globex's own SSH key never reached the server: %+v", witnessSSH.all())
		}
		for id, tenant := range strict.jobs() {
			if tenant == "beta" || tenant == "globex" {
				t.Errorf("a Job of tenant %s (request %s)", tenant, id)
			}
		}
	})

	t.Run("a commit a force-push left behind is GitCommitNotFound", func(t *testing.T) {
		t.Parallel()
		u := web.URL + fx.forced.path()
		onBranch := strict.publish(t, "acme", "forced", v1.GitSource{URL: u, Ref: "main", Commit: fx.forcedOld})
		alone := strict.publish(t, "acme", "forced", v1.GitSource{URL: u, Commit: fx.forcedOld})
		strict.refused(t, onBranch, v1.ReasonGitCommitNotFound, fx.forcedOld)
		strict.refused(t, alone, v1.ReasonGitCommitNotFound, fx.forcedOld)
		// The branch itself still builds.
		tip := strict.publish(t, "acme", "forced", v1.GitSource{URL: u, Ref: "main"})
		if r := strict.res.waitID(t, tip.RequestID, 2*time.Minute); r.Data.Status != v1.StatusSucceeded || r.Data.Source == nil || r.Data.Source.Commit != fx.forcedNew {
			t.Fatalf("main after the force-push: %s, want succeeded at %s", mustJSON(r), fx.forcedNew)
		}
	})

	t.Run("a Git LFS pointer is GitLFSPointer", func(t *testing.T) {
		t.Parallel()
		req := strict.publish(t, "acme", "lfs", v1.GitSource{URL: web.URL + fx.lfs.path(), Ref: "main"})
		strict.refused(t, req, v1.ReasonGitLFS, "model.bin")
	})

	t.Run("an unknown ref is GitRefNotFound", func(t *testing.T) {
		t.Parallel()
		req := strict.publish(t, "acme", "noref", v1.GitSource{URL: appURL, Ref: "no-such-branch"})
		strict.refused(t, req, v1.ReasonGitRefNotFound, "no-such-branch")
	})

	t.Run("a ref that reads as an option runs nothing", func(t *testing.T) {
		t.Parallel()
		pwned := filepath.Join(t.TempDir(), "pwned")
		flag := "--upload-pack=touch " + pwned
		if _, err := strict.s.pub.Publish(context.Background(), &v1.Request{Tenant: "acme", Name: "flag",
			Source: v1.Source{Git: &v1.GitSource{URL: web.URL + fx.pwn.path(), Ref: flag}}}); err == nil {
			t.Fatalf("the SDK published a ref %q", flag)
		}
		for _, u := range []string{web.URL + fx.pwn.path(), sshd.url(fx.pwn.path())} {
			req := strict.publishRaw(t, "acme", "flag", v1.GitSource{URL: u, Ref: flag})
			strict.refused(t, req, v1.ReasonInvalidRequest, "source.git.ref", "starts with '-'")
		}
		// A sub-path is a path, never an argument: it is looked up in
		// the commit's tree (after the commit was fetched, by hash).
		sub := strict.publishRaw(t, "acme", "flag", v1.GitSource{URL: web.URL + fx.pwn.path(), Commit: fx.c2, SubPath: flag})
		strict.refused(t, sub, v1.ReasonGitSubPath, "has no directory")
		if _, err := os.Stat(pwned); err == nil {
			t.Fatalf("%s exists: a ref ran as a command", pwned)
		}
		// The refused refs reached no git server (the sub-path's request
		// fetched the commit: one advertisement, one upload-pack).
		if hits := web.hitsFor(fx.pwn.path()); len(hits) > 2 {
			t.Errorf("the git server was asked for %s %d times, want 2 (the sub-path's fetch): %+v", fx.pwn.path(), len(hits), hits)
		}
		for _, h := range sshd.all() {
			if strings.Contains(h.command, "pwn") {
				t.Errorf("the SSH server ran %q", h.command)
			}
		}
	})

	t.Run("a host not in --allowed-git-host is refused before any connection", func(t *testing.T) {
		t.Parallel()
		req := strict.publish(t, "acme", "elsewhere", v1.GitSource{URL: elsewhere.URL + fx.app.path(), Ref: "main"})
		strict.refused(t, req, v1.ReasonGitHostRefused, "127.0.0.2", "--allowed-git-host")
		if hits := elsewhere.all(); len(hits) > 0 {
			t.Errorf("the refused host was contacted: %+v", hits)
		}
	})

	t.Run("a redirect to the cloud metadata address is GitHostRefused", func(t *testing.T) {
		t.Parallel()
		u := web.URL + "/moved.git"
		// Not an allowed host, for the strict worker; for the open one
		// an allowed name whose address (link-local) is refused.
		strict.refused(t, strict.publish(t, "acme", "moved", v1.GitSource{URL: u, Ref: "main"}), v1.ReasonGitHostRefused, "169.254.169.254")
		open.refused(t, open.publish(t, "acme", "moved", v1.GitSource{URL: u, Ref: "main"}), v1.ReasonGitHostRefused, "169.254.169.254", "link-local")
		for _, h := range web.hitsFor("/moved.git") {
			if h.status != http.StatusFound {
				t.Errorf("moved.git answered %d", h.status)
			}
		}
	})

	t.Run("pack bombs are refused by the limits", func(t *testing.T) {
		t.Parallel()
		many := strict.publish(t, "acme", "bomb", v1.GitSource{URL: web.URL + fx.many.path(), Ref: "main"})
		big := strict.publish(t, "acme", "bomb", v1.GitSource{URL: web.URL + fx.big.path(), Ref: "main"})
		strict.refused(t, many, v1.ReasonGitTooManyObjects, "MaxObjects="+gitMaxObjects)
		strict.refused(t, big, v1.ReasonGitTooLarge, "MaxObjectBytes")
		for _, repo := range []string{fx.many.path(), fx.big.path()} {
			var sent int64
			for _, h := range web.hitsFor(repo) {
				sent += h.sent
			}
			t.Logf("%s: %d bytes sent by the git server", repo, sent)
		}
	})
}

// publishRaw publishes src as tenant's request without the SDK's
// validation, as any NATS client of the tenant can.
func (e *gitEnv) publishRaw(t *testing.T, tenant, name string, src v1.GitSource) *v1.Request {
	t.Helper()
	req := &v1.Request{APIVersion: v1.APIVersion, RequestID: publisher.NewRequestID(), Tenant: tenant, Name: name,
		Source: v1.Source{Git: &src}, SubmittedAt: time.Now().UTC()}
	b, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(v1.RequestSubject(tenant))
	m.Header.Set(v1.MsgIDHeader, v1.MsgID(tenant, req.RequestID))
	m.Data = b
	if _, err := e.s.js().PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	return req
}

// waitID waits for the result of request id.
func (r *results) waitID(t *testing.T, id string, timeout time.Duration) v1.Result {
	t.Helper()
	var got v1.Result
	eventually(t, timeout, "the result of "+id, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, res := range r.got {
			if res.ID == id {
				got = res
				return true
			}
		}
		return false
	})
	return got
}

// waitWorkers waits until a worker made the requests stream and its
// consumer.
func (s *suite) waitWorkers() {
	s.t.Helper()
	js := s.js()
	eventually(s.t, time.Minute, "a worker's consumer", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
		return err == nil
	})
}

// jobRequests records, for every Job created in the namespace, the
// request it was made for and its tenant.
func (s *suite) jobRequests() func() map[string]string {
	s.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s.t.Cleanup(cancel)
	w, err := shared.kube.BatchV1().Jobs(s.ns).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		s.t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string]string{}
	go func() {
		for ev := range w.ResultChan() {
			if j, ok := ev.Object.(*batchv1.Job); ok {
				mu.Lock()
				seen[j.Annotations[kaniko.AnnotationRequestID]] = j.Labels[kaniko.LabelTenant]
				mu.Unlock()
			}
		}
	}()
	return func() map[string]string {
		mu.Lock()
		defer mu.Unlock()
		out := make(map[string]string, len(seen))
		for k, v := range seen {
			out[k] = v
		}
		return out
	}
}

// testGitPushOnRealNode runs a GitHub push end to end on the real node:
// the suite's NATS with an account per tenant (deploy/nats/buildq.conf),
// a `buildq gateway` that publishes as tenant acme's own NATS user, a
// signed push webhook for a commit the branch has already moved past (a
// late delivery), the worker packing exactly that commit, and the real
// kaniko executor building it. The image in the registry holds that
// commit's file, not the branch tip's.
func testGitPushOnRealNode(t *testing.T, node *realNode) {
	g := startGitServer(t)
	repo := g.repo("hook")
	repo.commit("first", map[string]gitFile{"Dockerfile": {body: "FROM scratch\nCOPY pushed.txt /pushed.txt\n"}, "pushed.txt": {body: "first\n"}})
	repo.push("main")
	web := g.serveHTTP("127.0.0.1")
	repoURL := web.URL + repo.path()

	// The shipped NATS configuration, the users' keys made here.
	conf, err := filepath.Abs(filepath.Join("..", "deploy", "nats", "buildq.conf"))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := natsconf.NewUserKeys(natsconf.Users([]string{"acme", "globex"}))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	seed := func(user string) string { return filepath.Join(dir, user+".seed") }
	var env []string
	for _, k := range keys {
		if err := os.WriteFile(seed(k.User), k.Seed, 0o600); err != nil {
			t.Fatal(err)
		}
		env = append(env, natsconf.NKeyVar(k.User)+"="+k.Public)
	}
	admin, err := nats.NkeyOptionFromSeed(seed(natsconf.AdminKey))
	if err != nil {
		t.Fatal(err)
	}
	s := newSuite(t, options{node: node, natsConfig: conf, natsEnv: env, natsOptions: []nats.Option{admin},
		workerArgs: []string{"--nats-nkey", seed(natsconf.WorkerKey), "--allowed-git-host", "127.0.0.1", "--insecure-git-host", "127.0.0.1"}})
	s.startWorker("w1")
	res := s.collect()
	s.waitWorkers()

	// The gateway: acme's own NATS user, a GitHub webhook secret, a
	// trigger for the repository's main branch.
	secret := randomHex(t, 20)
	for name, content := range map[string]string{"msgid.key": randomHex(t, 32), "github-secret": secret + "\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, `msgIdKeyFile: msgid.key
tenants:
  - name: acme
    nats: {nkeySeedFile: acme.seed}
    webhooks:
      github: {secretFile: github-secret}
    triggers:
      - repository: %s
        name: hook
        branches: [main]
`, repoURL), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr()
	gw := exec.Command(filepath.Join(shared.bin, "buildq"), "gateway", "--config", cfg, "--addr", addr,
		"--nats-url", s.natsURL, "--log-format", "console")
	gwLog := &lockedBuffer{}
	gw.Stdout, gw.Stderr = gwLog, gwLog
	if err := gw.Start(); err != nil {
		t.Fatal(err)
	}
	gwDone := make(chan struct{})
	go func() { _ = gw.Wait(); close(gwDone) }()
	t.Cleanup(func() {
		_ = gw.Process.Signal(os.Interrupt)
		select {
		case <-gwDone:
		case <-time.After(30 * time.Second):
			_ = gw.Process.Kill()
			<-gwDone
		}
		if t.Failed() {
			t.Logf("buildq gateway:\n%s", tail(gwLog.String(), 4000))
		}
	})
	eventually(t, time.Minute, "the gateway to be ready", func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	// The push: main moves from first to pushed. The branch has moved on
	// again by the time the webhook arrives.
	before := g.run(repo.work, "rev-parse", "HEAD")
	pushed := repo.commit("pushed", map[string]gitFile{"pushed.txt": {body: "the pushed commit\n"}})
	repo.push("main")
	later := repo.commit("later", map[string]gitFile{"pushed.txt": {body: "a later commit\n"}})
	repo.push("main")

	payload, err := json.Marshal(map[string]any{
		"ref": "refs/heads/main", "before": before, "after": pushed, "created": false, "deleted": false, "forced": false,
		"head_commit": map[string]any{"id": pushed, "message": "pushed"},
		"repository":  map[string]any{"full_name": "acme/hook", "clone_url": repoURL, "html_url": repoURL, "ssh_url": "git@127.0.0.1:acme/hook.git"},
		"pusher":      map[string]any{"name": "acme-dev"},
	})
	if err != nil {
		t.Fatal(err)
	}
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write(payload)
	hook, err := http.NewRequest(http.MethodPost, "http://"+addr+"/hooks/github/acme", bytes.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	hook.Header.Set("Content-Type", "application/json")
	hook.Header.Set("X-GitHub-Event", "push")
	hook.Header.Set("X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-"+randomHex(t, 6))
	hook.Header.Set("X-Hub-Signature-256", "sha256="+hex.EncodeToString(mac.Sum(nil)))
	resp, err := http.DefaultClient.Do(hook)
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		RequestIDs []string `json:"requestIds"`
		Message    string   `json:"message"`
	}
	err = json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusAccepted || len(answer.RequestIDs) != 1 {
		t.Fatalf("the gateway answered the push %d %+v (%v), want 202 with one request id", resp.StatusCode, answer, err)
	}

	start := time.Now()
	r := res.waitID(t, answer.RequestIDs[0], 5*time.Minute)
	want := v1.SourceInfo{GitURL: repoURL, Ref: "refs/heads/main", Commit: pushed}
	// Built by a Job (the node suite's template puts its Pod on the real
	// node, whose kaniko is the real executor).
	if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Job == "" ||
		r.Data.Tenant != "acme" || r.Data.Name != "hook" || r.Data.Source == nil {
		t.Fatalf("result %s, want acme/hook built by a Job", mustJSON(r))
	}
	got := *r.Data.Source
	got.ContextDigest = ""
	if got != want {
		t.Fatalf("result source %s, want %s (the pushed commit, not main's tip %s)", mustJSON(r.Data.Source), mustJSON(want), later)
	}
	t.Logf("built the pushed commit on the real node %s after the webhook", time.Since(start).Round(100*time.Millisecond))
	files := imageFiles(t, r.Data.ImageRef)
	if f, ok := files["pushed.txt"]; !ok || string(f.body) != "the pushed commit\n" {
		t.Fatalf("image %s: pushed.txt is %q (present: %v), want the pushed commit's", r.Data.ImageRef, f.body, ok)
	}
}
