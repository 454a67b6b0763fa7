//go:build integration

package integration

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/subtle"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/cgi"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

// gitServer is a real git server for the git-source tests: bare
// repositories made with the git binary, served over smart HTTP by git's
// own `git http-backend` behind net/http/cgi, and over SSH by a Go SSH
// server that runs `git upload-pack` for a session's exec command. The
// handler in front of the CGI program plays the forge's part: basic auth
// for private repositories (checked before the CGI runs) and redirects.
// Every listener records what it was asked, so a test can tell which
// credentials reached it.
type gitServer struct {
	t       *testing.T
	git     string // the git binary
	backend string // git-http-backend
	root    string // bare repositories, <name>.git
	env     []string

	// private repositories ("/private.git") need user and pass over HTTP.
	private    map[string]bool
	user, pass string
	// redirects answer a repository path with a redirect to the URL.
	redirects map[string]string

	hostKey ssh.Signer
	// authorized SSH keys, by their wire form.
	authorized map[string]bool
}

// startGitServer checks that git and git-http-backend are installed
// (tools/node-packages.sh installs Debian's git) and prepares an empty
// server; repositories are added with repo, listeners with serveHTTP and
// serveSSH.
func startGitServer(t *testing.T) *gitServer {
	t.Helper()
	gitBin, err := exec.LookPath("git")
	if err != nil {
		t.Fatal("git is not installed: run make node-packages (tools/node-packages.sh installs Debian's git)")
	}
	out, err := exec.Command(gitBin, "--exec-path").Output()
	if err != nil {
		t.Fatalf("git --exec-path: %v", err)
	}
	backend := filepath.Join(strings.TrimSpace(string(out)), "git-http-backend")
	if _, err := os.Stat(backend); err != nil {
		t.Fatalf("%s is missing: run make node-packages (tools/node-packages.sh installs Debian's git)", backend)
	}
	home := t.TempDir()
	s := &gitServer{
		t: t, git: gitBin, backend: backend, root: t.TempDir(),
		// No system or user configuration of this machine's applies.
		env: []string{"HOME=" + home, "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null", "GIT_TERMINAL_PROMPT=0", "LC_ALL=C",
			"PATH=" + os.Getenv("PATH"),
			"GIT_AUTHOR_NAME=buildq test", "GIT_AUTHOR_EMAIL=test@buildq.invalid",
			"GIT_COMMITTER_NAME=buildq test", "GIT_COMMITTER_EMAIL=test@buildq.invalid"},
		private:    map[string]bool{},
		redirects:  map[string]string{},
		authorized: map[string]bool{},
	}
	s.hostKey, _ = newSSHKey(t)
	return s
}

// run runs git in dir and returns its trimmed stdout.
func (s *gitServer) run(dir string, args ...string) string {
	s.t.Helper()
	out, err := s.runE(dir, args...)
	if err != nil {
		s.t.Fatal(err)
	}
	return out
}

// runE is run for other goroutines than the test's: it returns the error.
func (s *gitServer) runE(dir string, args ...string) (string, error) {
	cmd := exec.Command(s.git, args...)
	cmd.Dir, cmd.Env = dir, s.env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %w\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}

// gitRepo is a working repository whose origin is a bare repository the
// server serves as /<name>.git.
type gitRepo struct {
	s    *gitServer
	name string
	work string
}

// repo makes an empty repository served as /<name>.git, with a working
// repository (branch main) that pushes to it.
func (s *gitServer) repo(name string) *gitRepo {
	s.t.Helper()
	r := &gitRepo{s: s, name: name, work: s.t.TempDir()}
	s.run(s.root, "init", "-q", "--bare", "-b", "main", name+".git")
	s.run(r.work, "init", "-q", "-b", "main")
	s.run(r.work, "remote", "add", "origin", r.bare())
	return r
}

func (r *gitRepo) bare() string { return filepath.Join(r.s.root, r.name+".git") }

// path is the repository's path in URLs.
func (r *gitRepo) path() string { return "/" + r.name + ".git" }

// gitFile is a file of a commit: content, optionally executable, or a
// symlink to link.
type gitFile struct {
	body string
	exec bool
	link string
}

// commit writes files into the working tree, stages everything (git add
// -A), runs the extra git commands (index edits), commits and returns the
// commit's hash.
func (r *gitRepo) commit(msg string, files map[string]gitFile, extra ...[]string) string {
	t := r.s.t
	t.Helper()
	for p, f := range files {
		full := filepath.Join(r.work, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		_ = os.Remove(full)
		var err error
		switch {
		case f.link != "":
			err = os.Symlink(f.link, full)
		case f.exec:
			err = os.WriteFile(full, []byte(f.body), 0o755)
		default:
			err = os.WriteFile(full, []byte(f.body), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	r.s.run(r.work, "add", "-A")
	for _, args := range extra {
		r.s.run(r.work, args...)
	}
	r.s.run(r.work, "commit", "-q", "--allow-empty", "-m", msg)
	return r.s.run(r.work, "rev-parse", "HEAD")
}

// push pushes refs to the served repository (git push origin refs...).
func (r *gitRepo) push(args ...string) {
	r.s.t.Helper()
	r.s.run(r.work, append([]string{"push", "-q", "origin"}, args...)...)
}

// checkout is what a user who cloned the repository and checked commit
// out would send with `buildq submit`: the working tree without .git
// (with its submodules checked out when submodules is set).
func (r *gitRepo) checkout(commit string, submodules bool) string {
	t := r.s.t
	t.Helper()
	dir := filepath.Join(t.TempDir(), r.name)
	r.s.run("", "clone", "-q", "--no-checkout", r.bare(), dir)
	r.s.run(dir, "checkout", "-q", "--detach", commit)
	if submodules {
		r.s.run(dir, "-c", "protocol.file.allow=always", "submodule", "update", "-q", "--init", "--recursive")
	}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Name() == ".git" {
			if err := os.RemoveAll(p); err != nil {
				return err
			}
			if d.IsDir() {
				return filepath.SkipDir
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// httpHit is one HTTP request a listener received.
type httpHit struct {
	repo, user, pass string
	auth             bool // an Authorization header came
	status           int
	sent             int64 // response bytes
}

// gitHTTP is one HTTP listener of the server.
type gitHTTP struct {
	URL    string
	mu     sync.Mutex
	hits   []httpHit
	stderr lockedBuffer
}

// hitsFor returns the requests for repository path repo ("/app.git").
func (g *gitHTTP) hitsFor(repo string) []httpHit {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []httpHit
	for _, h := range g.hits {
		if h.repo == repo {
			out = append(out, h)
		}
	}
	return out
}

func (g *gitHTTP) all() []httpHit {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]httpHit(nil), g.hits...)
}

// serveHTTP serves the repositories on host (an address of this
// machine) and returns the listener.
func (s *gitServer) serveHTTP(host string) *gitHTTP {
	s.t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		s.t.Fatal(err)
	}
	g := &gitHTTP{URL: "http://" + l.Addr().String()}
	backend := &cgi.Handler{
		Path: s.backend,
		Env: append([]string{"GIT_PROJECT_ROOT=" + s.root, "GIT_HTTP_EXPORT_ALL=1"},
			s.env...),
		Stderr: &g.stderr,
		// A client that stops reading (a refused pack) is no error here.
		Logger: log.New(&g.stderr, "cgi: ", 0),
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		repo := "/" + strings.SplitN(strings.TrimPrefix(r.URL.Path, "/"), "/", 2)[0]
		user, pass, auth := r.BasicAuth()
		cw := &countingResponse{ResponseWriter: w, status: http.StatusOK}
		defer func() {
			g.mu.Lock()
			g.hits = append(g.hits, httpHit{repo: repo, user: user, pass: pass, auth: auth, status: cw.status, sent: cw.n})
			g.mu.Unlock()
		}()
		if to, ok := s.redirects[repo]; ok {
			http.Redirect(cw, r, to+strings.TrimPrefix(r.URL.Path, repo)+"?"+r.URL.RawQuery, http.StatusFound)
			return
		}
		if s.private[repo] {
			okUser := subtle.ConstantTimeCompare([]byte(user), []byte(s.user)) == 1
			okPass := subtle.ConstantTimeCompare([]byte(pass), []byte(s.pass)) == 1
			if !auth || !okUser || !okPass {
				cw.Header().Set("WWW-Authenticate", `Basic realm="buildq-test-git"`)
				http.Error(cw, "Authentication failed", http.StatusUnauthorized)
				return
			}
		}
		backend.ServeHTTP(cw, r)
	})}
	go func() { _ = srv.Serve(l) }()
	s.t.Cleanup(func() {
		_ = srv.Close()
		if s.t.Failed() {
			s.t.Logf("git http-backend on %s:\n%s", g.URL, tail(g.stderr.String(), 3000))
		}
	})
	return g
}

// countingResponse records a response's status and size.
type countingResponse struct {
	http.ResponseWriter
	status int
	n      int64
}

func (c *countingResponse) WriteHeader(code int) {
	c.status = code
	c.ResponseWriter.WriteHeader(code)
}

func (c *countingResponse) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.n += int64(n)
	return n, err
}

func (c *countingResponse) Flush() {
	if f, ok := c.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// newSSHKey returns a fresh ed25519 key as a signer and as an OpenSSH
// PEM private key (what a kubernetes.io/ssh-auth Secret holds).
func newSSHKey(t *testing.T) (ssh.Signer, []byte) {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	return signer, pem.EncodeToMemory(block)
}

// authorize lets the holder of key in over SSH.
func (s *gitServer) authorize(key ssh.PublicKey) { s.authorized[string(key.Marshal())] = true }

// sshHit is one public key an SSH listener was offered, or one command
// it ran.
type sshHit struct {
	key      string // SHA256 fingerprint
	accepted bool
	command  string
}

// gitSSH is one SSH listener of the server.
type gitSSH struct {
	addr string
	mu   sync.Mutex
	hits []sshHit
	s    *gitServer
}

func (g *gitSSH) record(h sshHit) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.hits = append(g.hits, h)
}

func (g *gitSSH) all() []sshHit {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]sshHit(nil), g.hits...)
}

// url is the ssh:// URL of repository path ("/app.git").
func (g *gitSSH) url(repo string) string { return "ssh://git@" + g.addr + repo }

// knownHosts is the listener's known_hosts line.
func (g *gitSSH) knownHosts() string {
	return knownhosts.Line([]string{knownhosts.Normalize(g.addr)}, g.s.hostKey.PublicKey()) + "\n"
}

// serveSSH serves the repositories over SSH on 127.0.0.1: public-key
// auth against the authorized keys, and exec of "git-upload-pack
// '<path>'" (what git and buildq send), run as `git upload-pack` on the
// repository. Nothing of the command reaches a shell.
func (s *gitServer) serveSSH() *gitSSH {
	s.t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.t.Fatal(err)
	}
	g := &gitSSH{addr: l.Addr().String(), s: s}
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: func(_ ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			ok := s.authorized[string(key.Marshal())]
			g.record(sshHit{key: ssh.FingerprintSHA256(key), accepted: ok})
			if !ok {
				return nil, errors.New("unknown key")
			}
			return &ssh.Permissions{}, nil
		},
	}
	cfg.AddHostKey(s.hostKey)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				g.handle(conn, cfg)
			}()
		}
	}()
	s.t.Cleanup(func() {
		_ = l.Close()
		wg.Wait()
	})
	return g
}

func (g *gitSSH) handle(conn net.Conn, cfg *ssh.ServerConfig) {
	defer conn.Close()
	sconn, chans, reqs, err := ssh.NewServerConn(conn, cfg)
	if err != nil {
		return
	}
	defer sconn.Close()
	go ssh.DiscardRequests(reqs)
	var wg sync.WaitGroup
	for nc := range chans {
		if nc.ChannelType() != "session" {
			_ = nc.Reject(ssh.UnknownChannelType, "sessions only")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			g.session(ch, creqs)
		}()
	}
	wg.Wait()
}

func (g *gitSSH) session(ch ssh.Channel, reqs <-chan *ssh.Request) {
	defer ch.Close()
	for req := range reqs {
		if req.Type != "exec" {
			_ = req.Reply(false, nil) // env, pty-req, shell: none
			continue
		}
		var payload struct{ Command string }
		if err := ssh.Unmarshal(req.Payload, &payload); err != nil {
			_ = req.Reply(false, nil)
			return
		}
		_ = req.Reply(true, nil)
		g.record(sshHit{command: payload.Command})
		status := g.exec(ch, payload.Command)
		_ = ch.CloseWrite()
		_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{status}))
		return
	}
}

// uploadPackRe is the one command the server runs.
var uploadPackRe = regexp.MustCompile(`^git-upload-pack '(/[a-z0-9-]+\.git)'$`)

func (g *gitSSH) exec(ch ssh.Channel, command string) uint32 {
	m := uploadPackRe.FindStringSubmatch(command)
	var dir string
	if m != nil {
		dir = filepath.Join(g.s.root, m[1])
	}
	if fi, err := os.Stat(dir); m == nil || err != nil || !fi.IsDir() {
		_, _ = io.WriteString(ch.Stderr(), "fatal: '"+command+"' does not appear to be a git repository\n")
		return 128
	}
	cmd := exec.Command(g.s.git, "upload-pack", "--strict", dir)
	cmd.Env = g.s.env
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return 1
	}
	cmd.Stdout, cmd.Stderr = ch, ch.Stderr()
	if err := cmd.Start(); err != nil {
		return 1
	}
	// The channel's reads end when the client closes it, which may be
	// after upload-pack is done: copy apart from Wait.
	go func() { _, _ = io.Copy(stdin, ch); _ = stdin.Close() }()
	if err := cmd.Wait(); err != nil {
		return 1
	}
	return 0
}
