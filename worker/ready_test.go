package worker

import (
	"strings"
	"testing"
	"time"
)

// Ready (the readiness probe) is false until Run has set the streams up,
// true while it takes requests, false while NATS is unreachable, and
// false again once it stops.
func TestReadyFollowsTheWorker(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w, err := New(e.nc, nil, testConfig("unstarted"))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Ready(); err == nil || !strings.Contains(err.Error(), "starting") {
		t.Fatalf("a worker not running: Ready() = %v", err)
	}
	r := e.startWorker("w1", nil)
	eventually(t, 10*time.Second, "the worker ready", func() bool { return r.w.Ready() == nil })
	r.w.nc.Close()
	if err := r.w.Ready(); err == nil || !strings.Contains(err.Error(), "NATS connection") {
		t.Fatalf("with its NATS connection closed: Ready() = %v", err)
	}
	r.stop(t)
	if err := r.w.Ready(); err == nil {
		t.Fatal("a stopped worker is ready")
	}
}
