package worker

import (
	"sync"
	"testing"
	"time"
)

// The oracle's timing judgments (the order of takes, a finished Job's
// cleanup, one publisher per decision) hold in calm stretches of the
// schedule only: no fault injected near them (calm). A machine that
// cannot keep up is a fault the schedule did not inject: a handler that
// got no CPU for a second misses its AckWait and its request goes to
// another worker, a take is seen seconds after it was made. simStalls
// measures it: a goroutine that asks to sleep simStallTick at a time and
// adds up how late it wakes, per second of the schedule. A second whose
// wake-ups were late by more than simStallLimit in all is a stall, and
// a stretch near one is not calm.
type simStalls struct {
	mu   sync.Mutex
	late map[int64]time.Duration // second of the schedule → wake-up lateness
	stop chan struct{}
	done chan struct{}
}

const (
	simStallTick = 10 * time.Millisecond
	// simStallLimit: the world lost 30% of a second. On a quiet 2-core
	// machine running the 200 seeds 24 at a time, the worst second was
	// 158-216 ms late (2026-12-05): none is a stall there, and the timing
	// judgments keep their power (the mutants ignore-priority,
	// ignore-shares and no-job-cleanup are killed by them alone). With
	// two busy loops beside, 1,086 seconds of 200 seeds were late by
	// more than 250 ms.
	simStallLimit = 300 * time.Millisecond
)

// watch starts measuring; now is the schedule's clock.
func (s *simStalls) watch(now func() time.Duration) {
	s.late = map[int64]time.Duration{}
	s.stop, s.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(s.done)
		t := time.NewTimer(simStallTick)
		defer t.Stop()
		last := now()
		for {
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
			at := now()
			if late := at - last - simStallTick; late > 0 {
				s.mu.Lock()
				s.late[int64(at/time.Second)] += late
				s.mu.Unlock()
			}
			last = at
			t.Reset(simStallTick)
		}
	}()
}

// end stops measuring.
func (s *simStalls) end() {
	if s.stop == nil {
		return
	}
	close(s.stop)
	<-s.done
	s.stop = nil
}

// overlaps reports whether a stall lay between from and to, or within
// margin before from.
func (s *simStalls) overlaps(from, to, margin time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sec, late := range s.late {
		start := time.Duration(sec) * time.Second
		if late > simStallLimit && start <= to && start+time.Second+margin >= from {
			return true
		}
	}
	return false
}

// summary is the number of stalled seconds and the worst second's
// lateness.
func (s *simStalls) summary() (stalled int, worst time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, late := range s.late {
		if late > simStallLimit {
			stalled++
		}
		worst = max(worst, late)
	}
	return stalled, worst
}

// TestSimStallsNameTheSecondTheMachineLost: a clock that jumps 400 ms
// between two wake-ups makes its second a stall, and only stretches near
// that second stop being calm.
func TestSimStallsNameTheSecondTheMachineLost(t *testing.T) {
	var mu sync.Mutex
	var calls int
	t0 := time.Now()
	now := func() time.Duration {
		mu.Lock()
		defer mu.Unlock()
		calls++
		d := time.Since(t0) + 2*time.Second // the schedule's third second
		if calls > 5 {
			d += 400 * time.Millisecond // a wake-up 400 ms late
		}
		return d
	}
	w := &simWorld{sc: &simSchedule{}}
	w.stalls.watch(now)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if n, _ := w.stalls.summary(); n > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(simStallTick)
	}
	w.stalls.end()
	stalled, worst := w.stalls.summary()
	if stalled != 1 || worst < 400*time.Millisecond {
		t.Fatalf("stalled seconds %d, worst %s: want the one second that lost 400 ms", stalled, worst)
	}
	if w.calm(2*time.Second, 3*time.Second) {
		t.Error("a stretch over the stalled second is calm")
	}
	// Its margin: a stretch that starts within 2 s after the stall is not
	// judged either; one that starts later, or ends before it, is.
	if w.calm(4*time.Second, 5*time.Second) {
		t.Error("a stretch starting a second after the stall is calm")
	}
	if !w.calm(10*time.Second, 12*time.Second) {
		t.Error("a stretch far from the stall is not calm")
	}
	if !w.calm(0, time.Second) {
		t.Error("a stretch before the stall is not calm")
	}
}
