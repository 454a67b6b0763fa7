package devstack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"go.uber.org/zap"
)

// natsServer is the embedded nats-server with JetStream.
type natsServer struct {
	srv  *server.Server
	log  *natsLogger
	addr string // as requested, for error messages
	url  string
}

// startNATS starts nats-server in-process. Start() in nats-server is
// synchronous up to opening the client listener, so when it returns either
// the server listens or the logger has seen the fatal error that stopped it.
func startNATS(storeDir, addr string, log *zap.Logger) (*natsServer, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("nats: bad address %q: %w", addr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("nats: bad port in %q: %w", addr, err)
	}
	if port == 0 {
		// nats-server treats port 0 as "use the default 4222"; -1 is its
		// spelling of "pick a free port".
		port = server.RANDOM_PORT
	}

	opts := &server.Options{
		// A stable name keeps the server's identity the same across
		// restarts, which makes its logs easier to follow.
		ServerName: "buildq-dev",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   storeDir,
		// The embedding process owns signal handling (Ctrl-C must stop the
		// whole `buildq dev`, not just NATS).
		NoSigs: true,
		// No monitoring, cluster, leafnode or websocket listeners: every
		// listener is a port that could clash and must be loopback-only.
		HTTPPort: 0,
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	nl := &natsLogger{log: log.Named("nats")}
	// Debug and trace stay off: they log every protocol message, which
	// would drown the dev output even at debug level.
	srv.SetLoggerV2(nl, false, false, false)
	srv.Start()

	ns := &natsServer{srv: srv, log: nl, addr: addr}
	if fatal := nl.fatalMessage(); fatal != "" || srv.Addr() == nil {
		listening := srv.Addr() != nil
		srv.Shutdown()
		srv.WaitForShutdown()
		if !listening && addrInUse(addr) {
			return nil, &AddrInUseError{Service: "nats", Addr: addr, Flag: natsFlag,
				Err: &net.OpError{Op: "listen", Net: "tcp", Err: syscall.EADDRINUSE}}
		}
		if fatal == "" {
			fatal = "server did not start listening"
		}
		return nil, fmt.Errorf("nats: %s", fatal)
	}
	ns.url = "nats://" + srv.Addr().String()
	return ns, nil
}

// waitReady waits until NATS accepts clients and JetStream is up.
func (n *natsServer) waitReady(ctx context.Context) error {
	for {
		if n.srv.ReadyForConnections(100 * time.Millisecond) {
			if !n.srv.JetStreamEnabled() {
				return errors.New("nats: JetStream is not enabled")
			}
			return nil
		}
		if fatal := n.log.fatalMessage(); fatal != "" {
			return fmt.Errorf("nats: %s", fatal)
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("nats: not ready on %s: %w", n.addr, err)
		}
	}
}

func (n *natsServer) shutdown() error {
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
	return nil
}

// addrInUse tells whether addr is taken by someone else. nats-server only
// reports a listen failure as a formatted log line, so the cause is found by
// trying the address again.
func addrInUse(addr string) bool {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return errors.Is(err, syscall.EADDRINUSE)
	}
	_ = ln.Close()
	return false
}

// natsLogger adapts zap to nats-server's Logger. Everything goes to debug
// (the dev stack's own messages are what the user wants to see), except
// fatal errors: nats-server's default logger would exit the process on
// those, so they are logged as errors and remembered for Start to return.
type natsLogger struct {
	log *zap.Logger

	mu    sync.Mutex
	fatal string
}

var _ server.Logger = (*natsLogger)(nil)

func (l *natsLogger) debugf(level, format string, v []any) {
	// Check first so a disabled logger costs no Sprintf.
	if l.log.Core().Enabled(zap.DebugLevel) {
		l.log.Debug(fmt.Sprintf(format, v...), zap.String("nats_level", level))
	}
}

func (l *natsLogger) Noticef(format string, v ...any) { l.debugf("notice", format, v) }
func (l *natsLogger) Warnf(format string, v ...any)   { l.debugf("warn", format, v) }
func (l *natsLogger) Errorf(format string, v ...any)  { l.debugf("error", format, v) }
func (l *natsLogger) Debugf(format string, v ...any)  { l.debugf("debug", format, v) }
func (l *natsLogger) Tracef(format string, v ...any)  { l.debugf("trace", format, v) }

func (l *natsLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	l.log.Error(msg)
	l.mu.Lock()
	if l.fatal == "" {
		l.fatal = msg
	}
	l.mu.Unlock()
}

func (l *natsLogger) fatalMessage() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fatal
}
