package loopback

import (
	"net"
	"testing"
)

// The kernel hands a just-closed port out again within a few hundred
// binds on this machine's Linux; FreeAddr must not.
func TestFreeAddrNeverHandsAnAddressOutTwice(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		a := FreeAddr()
		if seen[a] {
			t.Fatalf("%s handed out twice", a)
		}
		seen[a] = true
	}
	l, err := net.Listen("tcp", FreeAddr())
	if err != nil {
		t.Fatalf("an address FreeAddr gave cannot be listened on: %v", err)
	}
	_ = l.Close()
}
