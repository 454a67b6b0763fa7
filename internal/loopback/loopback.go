// Package loopback hands out 127.0.0.1 addresses for the test servers to
// listen on.
package loopback

import (
	"net"
	"sync"
)

var (
	mu     sync.Mutex
	handed = map[string]bool{}
)

// FreeAddr returns a 127.0.0.1 address nothing listened on when it was
// picked, and never one it returned before in this process. The kernel
// may hand a just-closed ephemeral port out again: a cluster's nodes
// whose addresses are all picked before any of them starts got the same
// route port twice, and the third node could not bind it.
func FreeAddr() string {
	mu.Lock()
	defer mu.Unlock()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			panic(err)
		}
		addr := l.Addr().String()
		_ = l.Close()
		if !handed[addr] {
			handed[addr] = true
			return addr
		}
	}
}
