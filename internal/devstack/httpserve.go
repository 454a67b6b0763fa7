package devstack

import (
	"context"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"
)

// httpServer serves one service's handler on a listener we opened, and
// shuts it down without waiting on connections that carry no request.
type httpServer struct {
	name string
	log  *zap.Logger
	srv  *http.Server
	done chan struct{} // closed when Serve returns

	mu    sync.Mutex
	conns map[net.Conn]http.ConnState
}

// serveHTTP starts serving handler on ln in the background.
func serveHTTP(name string, ln net.Listener, handler http.Handler, l *zap.Logger) *httpServer {
	h := &httpServer{
		name:  name,
		log:   l,
		done:  make(chan struct{}),
		conns: make(map[net.Conn]http.ConnState),
	}
	h.srv = &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          debugStdLog(l),
		ConnState:         h.trackConn,
	}
	go func() {
		defer close(h.done)
		if err := h.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			l.Error(name+" server stopped", zap.Error(err))
		}
	}()
	return h
}

func (h *httpServer) trackConn(c net.Conn, st http.ConnState) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch st {
	case http.StateHijacked, http.StateClosed:
		delete(h.conns, c)
	default:
		h.conns[c] = st
	}
}

// closeUnused closes connections that were accepted but never sent a
// request. Clients' transports open such spare connections routinely, and
// http.Server.Shutdown only counts them as idle after 5 seconds, which
// would make every Close take that long.
func (h *httpServer) closeUnused() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for c, st := range h.conns {
		if st == http.StateNew {
			_ = c.Close()
		}
	}
}

// shutdown lets in-flight requests finish for up to shutdownTimeout, then
// drops them, and waits for the Serve goroutine so nothing outlives Close.
// Dropping requests of a stopping dev stack is expected (the user pressed
// Ctrl-C), so it is logged rather than returned as an error.
func (h *httpServer) shutdown() error {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- h.srv.Shutdown(ctx) }()

	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var err error
wait:
	for {
		h.closeUnused()
		select {
		case err = <-errc:
			break wait
		case <-tick.C:
		}
	}
	if errors.Is(err, context.DeadlineExceeded) {
		h.log.Warn(h.name+": requests still running at shutdown were cut off", zap.Duration("grace", shutdownTimeout))
		err = h.srv.Close()
	}
	<-h.done
	return err
}

// debugStdLog gives net/http a logger that writes to zap at debug level, so
// its connection-level complaints never reach stderr.
func debugStdLog(l *zap.Logger) *log.Logger {
	std, err := zap.NewStdLogAt(l, zap.DebugLevel)
	if err != nil { // only for invalid levels
		return log.New(io.Discard, "", 0)
	}
	return std
}
