package gateway

import (
	"errors"
	"net"
	"testing"
	"time"
)

// LimitListener accepts at most n connections open at once; closing one
// lets the next in; closing the listener ends a waiting Accept.
func TestLimitListener(t *testing.T) {
	t.Parallel()
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := LimitListener(inner, 2)
	accepted := make(chan net.Conn, 4)
	acceptErr := make(chan error, 1)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				acceptErr <- err
				return
			}
			accepted <- c
		}
	}()
	for range 3 {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
	}
	first, second := <-accepted, <-accepted
	select {
	case <-accepted:
		t.Fatal("a third connection was accepted while two were open")
	case <-time.After(100 * time.Millisecond): // the absence of an event: a bounded wait
	}
	_ = first.Close()
	_ = first.Close() // a second Close frees nothing more
	var third net.Conn
	select {
	case third = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("closing a connection let no waiting one in")
	}
	// Two open again: Accept waits for a slot, and Close ends the wait.
	_ = ln.Close()
	select {
	case err := <-acceptErr:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end Accept")
	}
	_ = second.Close()
	_ = third.Close()
}
