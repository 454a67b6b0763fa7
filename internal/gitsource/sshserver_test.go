package gitsource

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

// sshServer serves a gitServer's repositories over SSH: public-key auth
// against one authorized key, and exec of "git-upload-pack '<path>'".
type sshServer struct {
	git        *gitServer
	ln         net.Listener
	hostKey    ssh.Signer
	authorized ssh.PublicKey
	wg         sync.WaitGroup
}

// newKey returns a fresh ed25519 key as a signer and as PEM.
func newKey(t *testing.T) (ssh.Signer, []byte) {
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

// serveSSH starts an SSH server for git on 127.0.0.1 that lets in the
// holder of authorized.
func (s *gitServer) serveSSH(authorized ssh.PublicKey) *sshServer {
	t := s.t
	hostKey, _ := newKey(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &sshServer{git: s, ln: ln, hostKey: hostKey, authorized: authorized}
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: func(_ ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			if bytes.Equal(key.Marshal(), srv.authorized.Marshal()) {
				return &ssh.Permissions{}, nil
			}
			return nil, errors.New("unknown key")
		},
	}
	cfg.AddHostKey(hostKey)
	srv.wg.Add(1)
	go func() {
		defer srv.wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			srv.wg.Add(1)
			go func() {
				defer srv.wg.Done()
				srv.handle(conn, cfg)
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		srv.wg.Wait()
	})
	return srv
}

// url is the ssh:// URL of repository path ("/name.git").
func (srv *sshServer) url(path string) string {
	return "ssh://git@" + srv.ln.Addr().String() + path
}

// knownHosts is a known_hosts line for the server.
func (srv *sshServer) knownHosts() []byte {
	return []byte(knownhosts.Line([]string{knownhosts.Normalize(srv.ln.Addr().String())}, srv.hostKey.PublicKey()) + "\n")
}

func (srv *sshServer) handle(conn net.Conn, cfg *ssh.ServerConfig) {
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
		srv.git.count()
		wg.Add(1)
		go func() {
			defer wg.Done()
			srv.session(ch, creqs)
		}()
	}
	wg.Wait()
}

func (srv *sshServer) session(ch ssh.Channel, reqs <-chan *ssh.Request) {
	defer ch.Close()
	for req := range reqs {
		if req.Type != "exec" {
			_ = req.Reply(false, nil)
			continue
		}
		var payload struct{ Command string }
		if err := ssh.Unmarshal(req.Payload, &payload); err != nil {
			_ = req.Reply(false, nil)
			return
		}
		_ = req.Reply(true, nil)
		status := srv.exec(ch, payload.Command)
		_ = ch.CloseWrite()
		_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{status}))
		return
	}
}

// exec runs "git-upload-pack '<path>'" on the channel.
func (srv *sshServer) exec(ch ssh.Channel, cmd string) uint32 {
	path, ok := strings.CutPrefix(cmd, "git-upload-pack ")
	path = strings.Trim(path, "'")
	repo := srv.git.repos[path]
	if !ok || repo == nil {
		fmt.Fprintf(ch.Stderr(), "fatal: '%s' does not appear to be a git repository\n", path)
		return 128
	}
	if srv.git.realGit != "" {
		cmd := exec.Command(srv.git.realGit, "upload-pack", repo.dir)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = ch, ch, ch.Stderr()
		cmd.Env = []string{"HOME=" + repo.dir, "GIT_CONFIG_NOSYSTEM=1"}
		if err := cmd.Run(); err != nil {
			return 1
		}
		return 0
	}
	if err := srv.git.advertise(ch, repo, false); err != nil {
		return 1
	}
	if err := srv.git.upload(ch, ch, repo); err != nil && !errors.Is(err, io.EOF) {
		return 1
	}
	return 0
}
