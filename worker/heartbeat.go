package worker

import (
	"context"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/buildq/buildq/worker/internal/mutant"
)

// A request's heartbeat: JetStream is told the request is still being
// worked on, at a pace that follows the consumer's AckWait.

// heartbeatEvery is a third of the shorter of this worker's AckWait and
// the consumer's as the server last reported it: workers started with
// different --ack-wait values share one consumer, and the last to start
// set its AckWait.
func (w *Worker) heartbeatEvery() time.Duration {
	d := w.cfg.AckWait
	if s := time.Duration(w.ackWait.Load()); s > 0 && s < d {
		d = s
	}
	return max(d/3, 100*time.Millisecond)
}

// ackWaitRefresh is how often a worker re-reads the consumer's AckWait;
// heartbeatCheck, how often a running request's heartbeat looks at it.
const (
	ackWaitRefresh = 2 * time.Second
	heartbeatCheck = time.Second
)

// refreshAckWait re-reads the consumer's AckWait.
func (w *Worker) refreshAckWait(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if info, err := w.cons.Info(ctx); err == nil {
		w.ackWait.Store(int64(info.Config.AckWait))
		w.ackPendingCapped.Store(info.Config.MaxAckPending > 0)
	}
}

// heartbeat tells JetStream the request is still being worked on, so a
// build longer than AckWait is not redelivered; ackWait, when known, is
// the AckWait of the message's own consumer.
func (w *Worker) heartbeat(msg jetstream.Msg, ackWait time.Duration) func() {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	// The pace follows the consumer's AckWait as it is now (re-read every
	// ackWaitRefresh), looked at every heartbeatCheck at least: a request
	// held on buildq-workers (taken straight from intake) whose AckWait an
	// operator lowered by hand is beaten at the new pace within a few
	// seconds, not after a beat of the old one. A queued request's pace
	// never exceeds a third of its dispatch consumer's AckWait when it was
	// taken (that AckWait is only ever raised).
	pace := func() time.Duration {
		every := w.heartbeatEvery()
		if ackWait > 0 {
			every = min(every, max(ackWait/3, 100*time.Millisecond))
		}
		return every
	}
	go func() {
		defer wg.Done()
		every := pace()
		step := min(every, heartbeatCheck)
		t := time.NewTicker(step)
		defer t.Stop()
		last := time.Now()
		for {
			select {
			case <-t.C:
				if !mutant.On("heartbeat-fixed-pace") {
					every = pace()
				}
				// Beaten now if the next look would come too late.
				if time.Since(last)+step >= every {
					if err := msg.InProgress(); err != nil {
						w.log.Debug("heartbeat failed", zap.Error(err))
					}
					last = time.Now()
				}
				if s := min(every, heartbeatCheck); s != step {
					step = s
					t.Reset(step)
				}
			case <-done:
				return
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}
