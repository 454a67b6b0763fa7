package worker

// The test world's NATS: one embedded nats-server with JetStream and a
// file store, which can be stopped and started again on the same port and
// store (a restart keeps every stream, as a real server's does). The
// harness, the fault simulation and the scale benchmark's NATS processes
// all run it.

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// natsServer is a restartable embedded nats-server.
type natsServer struct {
	opts server.Options // the port is fixed after the first start

	mu  sync.Mutex
	srv *server.Server // nil while stopped
}

// natsConfig says how a natsServer runs. The zero value is a server on a
// free loopback port with its store in a test temp dir, without logs.
type natsConfig struct {
	name string
	port int    // 0: a free one, kept across restarts
	dir  string // "": t.TempDir()
	// configure changes the options further (a cluster, logging).
	configure func(*server.Options)
}

// startNATS starts a server; t's cleanup stops it.
func startNATS(t testing.TB, cfg natsConfig) *natsServer {
	t.Helper()
	if cfg.dir == "" {
		cfg.dir = t.TempDir()
	}
	port := cfg.port
	if port == 0 {
		port = -1
	}
	n := &natsServer{opts: server.Options{
		ServerName: cfg.name, Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: cfg.dir,
		NoLog: true, NoSigs: true, JetStreamMaxMemory: 64 << 20, JetStreamMaxStore: 1 << 30,
	}}
	if cfg.configure != nil {
		cfg.configure(&n.opts)
	}
	if err := n.start(); err != nil {
		t.Fatalf("nats-server: %v", err)
	}
	t.Cleanup(n.stop)
	return n
}

// start starts the server on its port and store; it retries while the
// port is still held by the server stopped before.
func (n *natsServer) start() error {
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

// stop shuts the server down and waits until it is gone (a no-op while
// stopped).
func (n *natsServer) stop() {
	n.mu.Lock()
	srv := n.srv
	n.srv = nil
	n.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// restart stops the server and starts it again on the same store and port
// after down.
func (n *natsServer) restart(down time.Duration) error {
	n.stop()
	time.Sleep(down)
	return n.start()
}

// running reports whether the server is up.
func (n *natsServer) running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv != nil
}

// server is the server running now (nil while stopped).
func (n *natsServer) server() *server.Server {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv
}

// addr is the server's host:port, the same across restarts.
func (n *natsServer) addr() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return fmt.Sprintf("127.0.0.1:%d", n.opts.Port)
}

func (n *natsServer) url() string { return "nats://" + n.addr() }
