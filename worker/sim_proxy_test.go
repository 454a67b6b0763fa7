package worker

// The fault simulation's network between a worker and nats-server: a TCP
// proxy per worker that can delay what it carries (latency on every KV
// operation, publish, ack and reply) and cut the worker off (a partition
// longer than the lease) while the server and the other workers go on.

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

type simProxy struct {
	ln     net.Listener
	target func() string // the server's address now

	mu      sync.Mutex
	lag     time.Duration // the most a chunk is held
	cut     bool
	conns   map[net.Conn]struct{}
	closed  bool
	rnd     func() float64
	stopped chan struct{}
}

func newSimProxy(target func() string, rnd func() float64) (*simProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &simProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}, rnd: rnd, stopped: make(chan struct{})}
	go p.accept()
	return p, nil
}

func (p *simProxy) url() string { return "nats://" + p.ln.Addr().String() }

func (p *simProxy) accept() {
	defer close(p.stopped)
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		cut, closed := p.cut, p.closed
		p.mu.Unlock()
		if cut || closed {
			_ = c.Close() // partitioned: the worker's reconnects fail
			continue
		}
		s, err := net.DialTimeout("tcp", p.target(), 2*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[s] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go p.pipe(c, s)
		go p.pipe(s, c)
	}
}

// pipe copies src to dst, holding each chunk for the current lag.
func (p *simProxy) pipe(src, dst net.Conn) {
	defer func() {
		_ = src.Close()
		_ = dst.Close()
		p.mu.Lock()
		delete(p.conns, src)
		delete(p.conns, dst)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			lag, cut := p.lag, p.cut
			d := time.Duration(0)
			if lag > 0 {
				d = time.Duration(p.rnd() * float64(lag))
			}
			p.mu.Unlock()
			if cut {
				return
			}
			if d > 0 {
				time.Sleep(d)
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				_ = err
			}
			return
		}
	}
}

// setLag holds every chunk for up to lag (0: none).
func (p *simProxy) setLag(lag time.Duration) {
	p.mu.Lock()
	p.lag = lag
	p.mu.Unlock()
}

// partition cuts the worker off (its connections drop, reconnects fail)
// until heal.
func (p *simProxy) partition() {
	p.mu.Lock()
	p.cut = true
	conns := make([]net.Conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

func (p *simProxy) heal() {
	p.mu.Lock()
	p.cut, p.lag = false, 0
	p.mu.Unlock()
}

func (p *simProxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.ln.Close()
	<-p.stopped
	p.partition()
}

func (p *simProxy) String() string { return fmt.Sprintf("proxy %s", p.ln.Addr()) }
