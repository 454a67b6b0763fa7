package gitsource

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"

	"github.com/go-git/go-git/v5/plumbing/format/pktline"
	"github.com/go-git/go-git/v5/plumbing/protocol/packp"
	"github.com/skeema/knownhosts"
	"golang.org/x/crypto/ssh"

	v1 "github.com/buildq/buildq/api/v1"
)

// sshRemote is a repository over SSH: one connection, dialed through the
// run's policy-checking dialer, and one git-upload-pack session per
// exchange (the first one also serves the advertisement). go-git's own
// SSH transport is not used: it dials without a context or a dialer of
// ours, and reads ~/.ssh/config and the agent.
type sshRemote struct {
	r        *run
	u        *url.URL
	hostPort string
	config   *ssh.ClientConfig
	client   *ssh.Client
	stop     func() bool
	pending  *sshSession // advertised, no request sent yet
	adv      *packp.AdvRefs

	mu         sync.Mutex
	hostKeyErr error
	hostKeyOK  bool
}

// sshSession is one git-upload-pack run.
type sshSession struct {
	s      *ssh.Session
	stdin  io.WriteCloser
	stdout io.Reader
	stderr *headBuffer
}

func (r *run) newSSHRemote(u *url.URL, user string) (*sshRemote, error) {
	port := u.Port()
	if port == "" {
		port = "22"
	}
	s := &sshRemote{r: r, u: u, hostPort: net.JoinHostPort(u.Hostname(), port)}
	cfg := &ssh.ClientConfig{User: user}
	c := r.creds
	if c != nil && len(c.SSHKey) > 0 {
		signer, err := ssh.ParsePrivateKey(c.SSHKey)
		if err != nil {
			return nil, refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("the tenant's SSH key cannot be used: %v", err), err)
		}
		cfg.Auth = []ssh.AuthMethod{ssh.PublicKeys(signer)}
	}
	var check ssh.HostKeyCallback
	switch {
	case c != nil && c.InsecureIgnoreHostKey:
		check = ssh.InsecureIgnoreHostKey() //nolint:gosec // the tenant's explicit choice (Credentials.InsecureIgnoreHostKey)
	case c != nil && len(c.KnownHosts) > 0:
		db, err := knownHostsDB(r.tempDir, c.KnownHosts)
		if err != nil {
			return nil, refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("the tenant's known hosts cannot be read: %v", err), err)
		}
		check = db.HostKeyCallback()
		cfg.HostKeyAlgorithms = db.HostKeyAlgorithms(s.hostPort)
	default:
		check = func(string, net.Addr, ssh.PublicKey) error {
			return errors.New("the tenant has no known hosts")
		}
	}
	cfg.HostKeyCallback = func(hostname string, remote net.Addr, key ssh.PublicKey) error {
		err := check(hostname, remote, key)
		s.mu.Lock()
		defer s.mu.Unlock()
		if err != nil {
			s.hostKeyErr = err
		} else {
			s.hostKeyOK = true
		}
		return err
	}
	s.config = cfg
	return s, nil
}

// knownHostsDB parses known_hosts lines (knownhosts reads only files).
func knownHostsDB(dir string, lines []byte) (*knownhosts.HostKeyDB, error) {
	f, err := os.CreateTemp(dir, "buildq-known-hosts-")
	if err != nil {
		return nil, fmt.Errorf("write known hosts: %w", err)
	}
	defer func() { _ = os.Remove(f.Name()) }()
	_, werr := f.Write(lines)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return nil, fmt.Errorf("write known hosts: %w", werr)
	}
	db, err := knownhosts.NewDB(f.Name())
	if err != nil {
		return nil, fmt.Errorf("parse known hosts: %w", err)
	}
	return db, nil
}

func (s *sshRemote) display() string { return s.u.String() }

// connect dials and authenticates, once.
func (s *sshRemote) connect(ctx context.Context) error {
	if s.client != nil {
		return nil
	}
	conn, err := s.r.dialContext(ctx, "tcp", s.hostPort)
	if err != nil {
		return transient("connect to "+s.display(), err)
	}
	// The handshake and every session read end when the Fetch does.
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	c, chans, reqs, err := ssh.NewClientConn(conn, s.hostPort, s.config)
	if err != nil {
		stop()
		_ = conn.Close()
		return s.handshakeError(ctx, err)
	}
	s.client, s.stop = ssh.NewClient(c, chans, reqs), stop
	return nil
}

// handshakeError tells an unknown host key and a refused key apart from
// trouble on the way.
func (s *sshRemote) handshakeError(ctx context.Context, err error) error {
	s.mu.Lock()
	keyErr, keyOK := s.hostKeyErr, s.hostKeyOK
	s.mu.Unlock()
	where := s.display()
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case keyErr != nil && knownhosts.IsHostKeyChanged(keyErr):
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("the SSH host key of %s does not match the tenant's known hosts", s.hostPort), nil)
	case keyErr != nil:
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("the SSH host key of %s is not among the tenant's known hosts", s.hostPort), nil)
	case keyOK && !isNetError(err):
		if len(s.config.Auth) == 0 {
			return refuse(v1.ReasonGitAuthFailed, where+" requires an SSH key and the tenant has none", nil)
		}
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("%s refused the tenant's SSH key: %v", where, err), err)
	}
	return transient("connect to "+where, err)
}

func isNetError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed)
}

// session starts git-upload-pack for the repository's path.
func (s *sshRemote) session(ctx context.Context) (*sshSession, error) {
	if err := s.connect(ctx); err != nil {
		return nil, err
	}
	sess, err := s.client.NewSession()
	if err != nil {
		return nil, transient("open an SSH session to "+s.display(), err)
	}
	out := &sshSession{s: sess, stderr: &headBuffer{max: 4 << 10}}
	sess.Stderr = out.stderr
	if out.stdin, err = sess.StdinPipe(); err == nil {
		out.stdout, err = sess.StdoutPipe()
	}
	if err == nil {
		err = sess.Start("git-upload-pack " + shellQuote(s.u.Path))
	}
	if err != nil {
		_ = sess.Close()
		return nil, transient("run git-upload-pack on "+s.display(), err)
	}
	return out, nil
}

// readAdvertisement reads a session's advertisement; an empty one is the
// server refusing in words on stderr.
func (s *sshRemote) readAdvertisement(sess *sshSession) (*packp.AdvRefs, error) {
	adv, err := decodeAdvertisement(sess.stdout, s.display())
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		return adv, err
	}
	_ = sess.s.Wait() // the server has closed stdout: its stderr is complete
	words := serverWords(sess.stderr.String())
	if words == "" {
		return nil, transient("list the refs of "+s.display(), errors.New("the SSH server closed the session without a word"))
	}
	if looksNotFound(words) {
		return nil, refuse(v1.ReasonGitAuthFailed,
			fmt.Sprintf("%s: no such repository, or none the tenant's key can see: %s", s.display(), words), nil)
	}
	return nil, &Error{Message: fmt.Sprintf("%s: %s", s.display(), words), Transient: true}
}

// advertise implements remote.
func (s *sshRemote) advertise(ctx context.Context) (*packp.AdvRefs, error) {
	if s.adv != nil {
		return s.adv, nil
	}
	sess, err := s.session(ctx)
	if err != nil {
		return nil, err
	}
	adv, err := s.readAdvertisement(sess)
	if err != nil {
		_ = sess.s.Close()
		return nil, err
	}
	s.adv, s.pending = adv, sess
	return adv, nil
}

// uploadPack implements remote.
func (s *sshRemote) uploadPack(ctx context.Context, body []byte) (io.ReadCloser, error) {
	sess := s.pending
	s.pending = nil
	if sess == nil {
		var err error
		if sess, err = s.session(ctx); err != nil {
			return nil, err
		}
		if _, err := s.readAdvertisement(sess); err != nil {
			_ = sess.s.Close()
			return nil, err
		}
	}
	if _, err := sess.stdin.Write(body); err != nil {
		_ = sess.s.Close()
		return nil, transient("send the request to "+s.display(), err)
	}
	_ = sess.stdin.Close()
	return &sessionReader{Reader: sess.stdout, sess: sess}, nil
}

// close implements remote.
func (s *sshRemote) close() error {
	if s.pending != nil {
		// A session only asked for refs ends with a flush-pkt.
		_, _ = s.pending.stdin.Write(pktline.FlushPkt)
		_ = s.pending.stdin.Close()
		_ = s.pending.s.Close()
		s.pending = nil
	}
	if s.client != nil {
		s.stop()
		return s.client.Close()
	}
	return nil
}

// sessionReader is a session's stdout; closing it ends the session.
// Errors read from it carry the server's stderr words when it has some.
type sessionReader struct {
	io.Reader
	sess *sshSession
}

// Read implements io.Reader.
func (s *sessionReader) Read(p []byte) (int, error) {
	n, err := s.Reader.Read(p)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		if words := serverWords(s.sess.stderr.String()); words != "" {
			return n, &serverError{text: words}
		}
	}
	return n, err
}

// Close ends the session.
func (s *sessionReader) Close() error { return s.sess.s.Close() }

// shellQuote quotes a path for the remote shell, as git's sq_quote_buf.
func shellQuote(p string) string {
	var b strings.Builder
	b.WriteByte('\'')
	for i := range len(p) {
		if c := p[i]; c == '\'' || c == '!' {
			b.WriteString(`'\` + string(c) + `'`)
			continue
		}
		b.WriteByte(p[i])
	}
	b.WriteByte('\'')
	return b.String()
}

// headBuffer keeps the first max bytes written to it (a server's stderr).
type headBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
	max int
}

// Write implements io.Writer; it never fails.
func (h *headBuffer) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if room := h.max - h.buf.Len(); room > 0 {
		h.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (h *headBuffer) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.buf.String()
}
