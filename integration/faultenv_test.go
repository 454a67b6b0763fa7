//go:build integration

package integration

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/buildq/buildq/internal/kaniko"
)

// Helpers of the real-process fault tests (faults_test.go, cluster_test.go):
// holds per build name, an HTTP fault proxy, a private kube-apiserver, and
// the checks every fault test ends with.

// holds keeps the build pods of a request name running until that name is
// released; pods of other names run at once.
type holds struct {
	mu sync.Mutex
	ch map[string]chan struct{}
}

func newHolds(t *testing.T, names ...string) *holds {
	h := &holds{ch: map[string]chan struct{}{}}
	for _, n := range names {
		h.ch[n] = make(chan struct{})
	}
	t.Cleanup(func() {
		for _, n := range names {
			h.release(n)
		}
	})
	return h
}

func (h *holds) fault(p *corev1.Pod) fault {
	h.mu.Lock()
	defer h.mu.Unlock()
	return fault{hold: h.ch[p.Labels[kaniko.LabelName]]}
}

func (h *holds) release(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.ch[name]:
	default:
		close(h.ch[name])
	}
}

// dropConn as a faultProxy rule's answer closes the client's connection
// without a response, as a server that died mid-request.
const dropConn = -1

// faultProxy is an HTTP reverse proxy in front of one of the suite's shared
// servers (MinIO, the registry), for one test: the shared server stays up
// for everyone else while this test's clients see it fail. rule decides per
// request: 0 passes it on, dropConn drops the connection, any other value
// is answered with that status.
type faultProxy struct {
	addr string
	mu   sync.Mutex
	rule func(*http.Request) int
	// delay holds every request this long before it is passed on (the
	// benchmarks' injected latency).
	delay time.Duration
	// faulted lists "METHOD path" of every request the rule failed.
	faulted []string
}

func startFaultProxy(t *testing.T, target string) *faultProxy {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil || u.Host == "" {
		t.Fatalf("proxy target %q: %v", target, err)
	}
	// The Host header is kept: S3 signatures cover it, and the registry
	// builds its upload URLs from it (so they lead back through the proxy).
	rp := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) {
		pr.SetURL(u)
		pr.Out.Host = pr.In.Host
	}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{addr: ln.Addr().String()}
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		code := 0
		if p.rule != nil {
			code = p.rule(r)
		}
		if code != 0 {
			p.faulted = append(p.faulted, r.Method+" "+r.URL.Path)
		}
		delay := p.delay
		p.mu.Unlock()
		if delay > 0 {
			time.Sleep(delay)
		}
		switch code {
		case 0:
			rp.ServeHTTP(w, r)
		case dropConn:
			if hj, ok := w.(http.Hijacker); ok {
				if c, _, err := hj.Hijack(); err == nil {
					c.Close()
					return
				}
			}
			panic(http.ErrAbortHandler)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			fmt.Fprintf(w, `{"errors":[{"code":"UNAVAILABLE","message":"fault injected by the test (%d)"}]}`, code)
		}
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return p
}

func (p *faultProxy) setDelay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

func (p *faultProxy) setRule(rule func(*http.Request) int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rule = rule
}

// count returns how many faulted requests had method and a path containing
// part.
func (p *faultProxy) count(method, part string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, f := range p.faulted {
		m, path, _ := strings.Cut(f, " ")
		if (method == "" || m == method) && strings.Contains(path, part) {
			n++
		}
	}
	return n
}
