//go:build integration

package integration

import (
	"io"
	"net"
	"net/url"
	"path/filepath"
	"sync"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
)

// apiProxy is a TCP proxy in front of kube-apiserver for one worker. cut
// breaks every connection through it (the worker's watches) and refuses new
// ones until restore: the API server is unreachable for the worker only,
// while the Job controller and the kubelet go on.
type apiProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	down   bool
}

func startAPIProxy(t *testing.T) (*apiProxy, string) {
	t.Helper()
	u, err := url.Parse(shared.restConfig.Host)
	if err != nil || u.Host == "" {
		t.Fatalf("api server host %q: %v", shared.restConfig.Host, err)
	}
	target := u.Host
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &apiProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	go p.serve()
	t.Cleanup(func() { ln.Close(); p.cut() })
	// A kubeconfig for the worker that goes through the proxy. The serving
	// certificate is for 127.0.0.1, whatever the port.
	kc, err := clientcmd.LoadFromFile(shared.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range kc.Clusters {
		c.Server = "https://" + ln.Addr().String()
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return p, path
}

func (p *apiProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.down {
			p.mu.Unlock()
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go pipe(c, up)
		go pipe(up, c)
	}
}

func pipe(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	dst.Close()
	src.Close()
}

// cut closes every proxied connection and refuses new ones.
func (p *apiProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		c.Close()
	}
	p.conns = map[net.Conn]struct{}{}
}

func (p *apiProxy) restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}
