package runs

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A held run's lease is renewed every third of the lease, each renewal a
// new revision; Stop returns the record as last written.
func TestHoldRenewsTheLeaseUntilStopped(t *testing.T) {
	t.Parallel()
	s, _, _ := newStore(t)
	r := building("k1", "run-1", "w1")
	rev := claim(t, s, r)
	h, runCtx := s.Hold(t.Context(), r, rev, HoldOptions{Owner: "w1", Lease: 300 * time.Millisecond, Now: time.Now})
	defer h.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, cur := get(t, s, "k1"); cur >= rev+2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the lease was not renewed twice in 5 s at a 300 ms lease")
		}
		time.Sleep(20 * time.Millisecond)
	}
	held, heldRev := h.Stop()
	got, gotRev := get(t, s, "k1")
	if heldRev != gotRev || !held.LeaseUntil.Equal(got.LeaseUntil) {
		t.Fatalf("Stop returned revision %d (lease %s), the record is at %d (lease %s)", heldRev, held.LeaseUntil, gotRev, got.LeaseUntil)
	}
	time.Sleep(300 * time.Millisecond)
	if _, after := get(t, s, "k1"); after != gotRev {
		t.Fatalf("renewed after Stop: revision %d, was %d", after, gotRev)
	}
	if runCtx.Err() != nil {
		t.Fatalf("Stop ended the run's context: %v", context.Cause(runCtx))
	}
}

// Another worker taking the run over ends the holder's run context with
// ErrLostClaim at its next renewal.
func TestHoldCancelsTheRunWhenAnotherWorkerTakesItOver(t *testing.T) {
	t.Parallel()
	s, _, _ := newStore(t)
	r := building("k1", "run-1", "w1")
	rev := claim(t, s, r)
	h, runCtx := s.Hold(t.Context(), r, rev, HoldOptions{Owner: "w1", Lease: 300 * time.Millisecond, Now: time.Now})
	defer h.Close()
	cur, curRev := get(t, s, "k1")
	taken := *cur
	taken.Owner = "w2"
	if _, ok, err := s.TakeOver(t.Context(), &taken, curRev); err != nil || !ok {
		t.Fatalf("take-over: ok %v, %v", ok, err)
	}
	select {
	case <-runCtx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the run's context was not canceled after the take-over")
	}
	if !errors.Is(context.Cause(runCtx), ErrLostClaim) {
		t.Fatalf("cause %v, want ErrLostClaim", context.Cause(runCtx))
	}
}

// Started records the Job and cancels a run that ended while its Job was
// being created (a cancel found nothing to delete); Current follows the
// record.
func TestHoldStartedCancelsARunEndedMeanwhile(t *testing.T) {
	t.Parallel()
	s, _, _ := newStore(t)
	r := building("k1", "run-1", "w1")
	rev := claim(t, s, r)
	h, runCtx := s.Hold(t.Context(), r, rev, HoldOptions{Owner: "w1", Lease: time.Hour, Now: time.Now})
	defer h.Close()
	if !h.Current(t.Context()) {
		t.Fatal("Current is false for the held run")
	}
	h.Started(t.Context(), "job-1")
	if runCtx.Err() != nil {
		t.Fatalf("Started canceled a run still held: %v", context.Cause(runCtx))
	}
	if held, _ := h.Held(); held.Job != "job-1" {
		t.Fatalf("held record's Job %q", held.Job)
	}
	cur, curRev := get(t, s, "k1")
	if ok, err := s.EndAt(t.Context(), Canceled(cur, time.Now()), curRev); err != nil || !ok {
		t.Fatalf("cancel: ok %v, %v", ok, err)
	}
	if h.Current(t.Context()) {
		t.Fatal("Current is true for an ended run")
	}
	h.Started(t.Context(), "job-1")
	if !errors.Is(context.Cause(runCtx), ErrLostClaim) {
		t.Fatalf("cause %v after Started on an ended run, want ErrLostClaim", context.Cause(runCtx))
	}
}
