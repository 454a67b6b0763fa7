package worker

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/buildq/buildq/internal/testnats"
)

// A result published first is the request's decision only while no other
// result can be stored for it outside the duplicate window. A publish
// written while the connection is down waits in nats.go's reconnect
// buffer and goes out whenever the connection is back, however long that
// takes — beside whatever another worker decided meanwhile. So a worker
// that publishes first refuses a connection that keeps such a buffer.
func TestAWorkerPublishingFirstRefusesAConnectionThatBuffersPublishes(t *testing.T) {
	srv := testnats.Start(t, testnats.Config{})
	_, err := New(srv.Connect(t), nil, testConfig("buffered"))
	if err == nil || !strings.Contains(err.Error(), "nats.ReconnectBufSize(-1)") {
		t.Fatalf("New on a connection with the default reconnect buffer = %v; want it refused, naming nats.ReconnectBufSize(-1)", err)
	}
	cfg := testConfig("record-first")
	cfg.FirstAge = -1
	if _, err := New(srv.Connect(t), nil, cfg); err != nil {
		t.Fatalf("New recording every decision first, on a buffering connection: %v; want it accepted", err)
	}
	if _, err := New(srv.Connect(t, nats.ReconnectBufSize(-1)), nil, testConfig("unbuffered")); err != nil {
		t.Fatalf("New on a connection without a reconnect buffer: %v", err)
	}
}

// What the refusal relies on: on a connection without a reconnect buffer,
// a publish made while it is down fails at once and is never sent later;
// with the default buffer the same publish goes out after the reconnect.
func TestAPublishWhileDisconnectedIsNeverSentLaterWithoutAReconnectBuffer(t *testing.T) {
	for _, tc := range []struct {
		name      string
		opts      []nats.Option
		delivered bool
	}{
		{"default buffer", nil, true},
		{"no buffer", []nats.Option{nats.ReconnectBufSize(-1)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := testnats.Start(t, testnats.Config{})
			reconnected := make(chan struct{}, 1)
			opts := append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond),
				nats.ReconnectHandler(func(*nats.Conn) { reconnected <- struct{}{} })}, tc.opts...)
			nc := srv.Connect(t, opts...)
			got := make(chan *nats.Msg, 1)
			if _, err := nc.ChanSubscribe("late.result", got); err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			srv.Stop()
			deadline := time.Now().Add(5 * time.Second)
			for nc.Status() != nats.RECONNECTING {
				if time.Now().After(deadline) {
					t.Fatalf("the connection is %v after the server stopped; want RECONNECTING", nc.Status())
				}
				time.Sleep(5 * time.Millisecond)
			}
			err := nc.Publish("late.result", []byte("succeeded"))
			if tc.delivered && err != nil {
				t.Fatalf("publish while reconnecting with the default buffer: %v", err)
			}
			if !tc.delivered && !errors.Is(err, nats.ErrReconnectBufExceeded) {
				t.Fatalf("publish while reconnecting without a buffer = %v; want %v at once", err, nats.ErrReconnectBufExceeded)
			}
			if err := srv.Start(); err != nil {
				t.Fatal(err)
			}
			select {
			case <-reconnected:
			case <-time.After(10 * time.Second):
				t.Fatal("no reconnect after the server came back")
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			select {
			case m := <-got:
				if !tc.delivered {
					t.Fatalf("a publish refused while disconnected went out after the reconnect: %q", m.Data)
				}
			case <-time.After(500 * time.Millisecond):
				if tc.delivered {
					t.Fatal("the default buffer's publish never went out: this test no longer shows what the buffer does")
				}
			}
		})
	}
}
