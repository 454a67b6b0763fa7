// Package testnats runs embedded nats-servers for tests: one with
// JetStream and a file store on a loopback port, which can be stopped and
// started again on the same port and store (a restart keeps every stream,
// as a real server's does). Every package's tests start their NATS here.
package testnats

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Config says how a Server runs. The zero value is a server on a free
// loopback port with its store in a test temp dir, without logs.
type Config struct {
	Name string
	Port int    // 0: a free one, kept across restarts
	Dir  string // "": tb.TempDir()
	// NoJetStream runs a plain server (a relay in front of another).
	NoJetStream bool
	// Configure changes the options further (users, a cluster, logging).
	Configure func(*server.Options)
}

// Server is a restartable embedded nats-server.
type Server struct {
	opts server.Options // the port is fixed after the first start

	mu  sync.Mutex
	srv *server.Server // nil while stopped
}

// Start starts a server; tb's cleanup stops it.
func Start(tb testing.TB, cfg Config) *Server {
	tb.Helper()
	if cfg.Dir == "" {
		cfg.Dir = tb.TempDir()
	}
	port := cfg.Port
	if port == 0 {
		port = -1
	}
	n := &Server{opts: server.Options{
		ServerName: cfg.Name, Host: "127.0.0.1", Port: port, JetStream: !cfg.NoJetStream, StoreDir: cfg.Dir,
		NoLog: true, NoSigs: true, JetStreamMaxMemory: 64 << 20, JetStreamMaxStore: 1 << 30,
	}}
	if cfg.Configure != nil {
		cfg.Configure(&n.opts)
	}
	if err := n.Start(); err != nil {
		tb.Fatalf("nats-server: %v", err)
	}
	tb.Cleanup(n.Stop)
	return n
}

// JetStream starts a fresh server with JetStream and connects to it: the
// shortest world a package's tests need. The connection closes, and the
// server stops, at tb's cleanup.
func JetStream(tb testing.TB) (*Server, *nats.Conn, jetstream.JetStream) {
	tb.Helper()
	srv := Start(tb, Config{})
	nc := srv.Connect(tb)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	return srv, nc, js
}

// Connect connects to the server; the connection closes at tb's cleanup.
func (n *Server) Connect(tb testing.TB, opts ...nats.Option) *nats.Conn {
	tb.Helper()
	nc, err := nats.Connect(n.URL(), opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	return nc
}

// Start starts the server on its port and store; it retries while the
// port is still held by the server stopped before.
func (n *Server) Start() error {
	var last error
	for range 50 {
		n.mu.Lock()
		opts := n.opts
		n.mu.Unlock()
		srv, err := server.NewServer(&opts)
		if err != nil {
			return err
		}
		if !opts.NoLog {
			srv.ConfigureLogger()
		}
		srv.Start()
		if srv.ReadyForConnections(10 * time.Second) {
			n.mu.Lock()
			n.srv = srv
			if n.opts.Port <= 0 {
				n.opts.Port = srv.Addr().(*net.TCPAddr).Port
			}
			n.mu.Unlock()
			return nil
		}
		srv.Shutdown()
		last = fmt.Errorf("nats-server on port %d did not start", opts.Port)
		time.Sleep(100 * time.Millisecond)
	}
	return last
}

// Stop shuts the server down and waits until it is gone (a no-op while
// stopped).
func (n *Server) Stop() {
	n.mu.Lock()
	srv := n.srv
	n.srv = nil
	n.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Restart stops the server and starts it again on the same store and port
// after down.
func (n *Server) Restart(down time.Duration) error {
	n.Stop()
	time.Sleep(down)
	return n.Start()
}

// Running reports whether the server is up.
func (n *Server) Running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv != nil
}

// Server is the server running now (nil while stopped).
func (n *Server) Server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// Addr is the server's host:port, the same across restarts.
func (n *Server) Addr() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return fmt.Sprintf("127.0.0.1:%d", n.opts.Port)
}

// URL is the server's client URL, the same across restarts.
func (n *Server) URL() string { return "nats://" + n.Addr() }
