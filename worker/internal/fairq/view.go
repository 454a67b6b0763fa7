package fairq

// The dispatcher's view of the queue (docs/design.md §2d): what it knows
// of the requests waiting, from the queue stream's per-subject counts
// (its looks) and from admissions announced on buildq.internal.queued,
// and the idle wait that keeps the view fresh while it takes intake's
// requests straight away.

import (
	"context"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// woken records an admitted request ("<tenant> <priority>") or a freed
// concurrency slot ("<tenant>") announced on wakeSubject.
func (d *dispatcher) woken(m *nats.Msg) {
	tenant, prio, admitted := strings.Cut(string(m.Data), " ")
	if _, ok := v1.PriorityOf(prio); !ok || tenant == "" {
		return
	}
	d.mu.Lock()
	if admitted {
		if d.view[tenant] == nil {
			d.view[tenant] = map[string]uint64{}
		}
		d.view[tenant][prio]++
		if d.woke != nil {
			if d.woke[tenant] == nil {
				d.woke[tenant] = map[string]uint64{}
			}
			d.woke[tenant][prio]++
		}
	}
	delete(d.dry, tenant)
	delete(d.full, tenant)
	d.mu.Unlock()
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// look reads the queue's per-subject counts into the view, unless a look
// is in flight already, and returns what is closed when the look in
// flight ends. It runs on its own: an idle dispatcher goes on taking
// intake's requests while it reads (next).
func (d *dispatcher) look(ctx context.Context) <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.looking == nil {
		done := make(chan struct{})
		d.looking = done
		go func() {
			d.lookWith(ctx, d.read)
			d.mu.Lock()
			d.looking = nil
			d.mu.Unlock()
			close(done)
		}()
	}
	return d.looking
}

// lookEnded waits for the look in flight, if any, to end.
func (d *dispatcher) lookEnded() {
	d.mu.Lock()
	l := d.looking
	d.mu.Unlock()
	if l != nil {
		<-l
	}
}

// lookWith makes the view from read's per-subject counts. An admission
// announced while the read is in flight may be missing from its answer:
// it is added to the answer, or the request would wait for the next idle
// poll with a slot free. One the answer did count is counted twice: a
// fetch then finds fewer than the view says, and the view is corrected.
func (d *dispatcher) lookWith(ctx context.Context, read func(context.Context) (map[string]uint64, error)) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	d.mu.Lock()
	d.woke = map[string]map[string]uint64{}
	d.mu.Unlock()
	subjects, err := read(ctx)
	if err != nil {
		d.mu.Lock()
		d.woke = nil
		d.mu.Unlock()
		d.q.log.Debug("reading the queue failed", zap.Error(err))
		return
	}
	view := map[string]map[string]uint64{}
	for subj, n := range subjects {
		parts := strings.Split(subj, ".")
		if len(parts) != 4 || n == 0 {
			continue
		}
		if view[parts[2]] == nil {
			view[parts[2]] = map[string]uint64{}
		}
		view[parts[2]][parts[3]] = n
	}
	d.mu.Lock()
	for t, ps := range d.woke {
		for p, n := range ps {
			if view[t] == nil {
				view[t] = map[string]uint64{}
			}
			view[t][p] += n
		}
	}
	d.woke = nil
	d.view, d.viewAt, d.dry = view, time.Now(), map[string]bool{}
	d.mu.Unlock()
}

// idle waits, with a slot free and nothing to take, for intake's next
// request (dispatchDirect: it runs here at once, and is returned), for an
// announcement, or for the view to be read again every poll. The poll's
// look runs while the dispatcher stays idle: a request arriving during its
// round trip is still taken at once, where it would otherwise go the
// queue's way (a publish, a fetch and a delete more) — at a steady rate
// near the poll's, about one request in twelve did. It returns nil to
// pick again: something was announced, the poll's look ended (the view
// is fresh), or ctx ended.
func (d *dispatcher) idle(ctx context.Context) *taken {
	d.q.idle.Store(true)
	defer d.q.idle.Store(false)
	poll := time.NewTimer(d.poll)
	defer poll.Stop()
	var (
		looked <-chan struct{} // nil until the poll's look is sent
		before time.Time       // the view's time when it was sent
	)
	for {
		select {
		case tk := <-d.q.direct:
			return tk
		case <-d.wake:
			return nil
		case <-poll.C:
			d.mu.Lock()
			before = d.viewAt
			d.mu.Unlock()
			looked = d.look(ctx)
		case <-looked:
			d.mu.Lock()
			read := d.viewAt.After(before)
			d.mu.Unlock()
			if read {
				return nil
			}
			// The read failed: the view is as it was, and the next
			// poll reads again (a pick now would only send another).
			looked = nil
			poll.Reset(d.poll)
		case <-ctx.Done():
			return nil
		}
	}
}
