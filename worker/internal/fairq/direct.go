package fairq

import (
	"context"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// Dispatch straight from intake (docs/design.md §2d). A request that
// would be queued only to be taken at once — this worker's dispatcher
// waits with a build slot free and found nothing to take — skips the
// queue's hop (a publish, a wake-up, a fetch, a delete and an ack): intake
// hands it to that dispatcher, which runs it on the free slot as it would
// a request it fetched, and the request's own message in BUILDQ_REQUESTS
// is what the handler heartbeats, acks, or gives back. Fair share holds:
// the dispatcher takes the hand-over only where it found no tenant with
// work it could take, so the request takes a slot nobody queued was
// owed (another worker's request admitted in the same instant waits for
// the next free slot, as it would behind a fetch a moment earlier).
//
// Only for
//   - a first delivery: a redelivery may follow an admission whose ack
//     was lost, and its queued copy would run as well;
//   - a tenant with neither a concurrency limit nor a queue limit: its
//     slots and its queue count are kept in BUILDQ_QUEUE and the slots
//     bucket, by the queue's message (slots.go), and a request that never
//     was in the queue is in neither.
//
// A request handed back (the worker stops) or retried later goes back to
// BUILDQ_REQUESTS (its message's Nak), and is then admitted to the queue
// like any redelivery.

// dispatchDirect hands msg to this worker's waiting dispatcher if it may
// (see above), and reports whether it did.
func (q *Queue) dispatchDirect(msg jetstream.Msg, meta *jetstream.MsgMetadata, tenant, prio string) bool {
	if !q.directable(meta, tenant) {
		return false
	}
	tk := &taken{msg: directMsg{Msg: msg, hdr: directHeaders(msg.Headers())}, tenant: tenant, prio: prio, direct: true}
	select {
	case q.direct <- tk:
		q.takenDirect.Add(1)
		if q.cfg.Metrics != nil {
			q.cfg.Metrics.TakenDirect()
		}
		return true
	default:
		return false // the dispatcher is busy, or holds no free slot: the queue
	}
}

// directable reports whether a request may be taken straight from intake
// (see above).
func (q *Queue) directable(meta *jetstream.MsgMetadata, tenant string) bool {
	if tenant == invalidTenant || (meta.NumDelivered != 1 && !mutant.On("direct-redelivered")) {
		return false
	}
	return (q.cfg.Fair.ConcurrencyOf(tenant) == 0 && q.cfg.Fair.QueueLimitOf(tenant) == 0) || mutant.On("direct-limited")
}

// takenAtOnce reports whether a request intake is about to admit would
// most likely be taken straight from intake: it may be, and this
// worker's dispatcher waits idle with a slot free now.
func (q *Queue) takenAtOnce(meta *jetstream.MsgMetadata, tenant string) bool {
	return q.directable(meta, tenant) && q.idle.Load()
}

// Idle reports whether this worker's dispatcher waits now with a slot
// free and nothing to take (a request arriving is taken straight from
// intake, if it may be).
func (q *Queue) Idle() bool { return q.idle.Load() }

// TakenDirect is how many requests this worker's handlers took straight
// from intake.
func (q *Queue) TakenDirect() uint64 { return q.takenDirect.Load() }

// runDirect runs a request intake handed over, on the slot its
// dispatcher held for it.
func (q *Queue) runDirect(workCtx context.Context, tk *taken, finished func()) {
	extra := q.extraSlots(tk.tenant, "", 0) // no limit: takes nothing
	q.handle(workCtx, Incoming{Msg: tk.msg, Extra: extra}, finished)
	extra.finish(false, 0)
}

// directMsg is a request's message from BUILDQ_REQUESTS with the headers
// its queued copy would have had: the handler sees a request alike
// whichever way it came.
type directMsg struct {
	jetstream.Msg
	hdr nats.Header
}

func (m directMsg) Headers() nats.Header { return m.hdr }

// directHeaders are h as intake copies them to the queue, and as the
// queued copy gives them back to the handler (queuemsg.go): without
// JetStream's publish controls and intake's own headers, the message id
// kept.
func directHeaders(h nats.Header) nats.Header {
	out := nats.Header{}
	for k, vs := range h {
		if l := strings.ToLower(k); strings.HasPrefix(l, "nats-") || strings.HasPrefix(l, "buildq-intake-") {
			continue
		}
		out[k] = vs
	}
	if id := h.Get(v1.MsgIDHeader); id != "" {
		out.Set(v1.MsgIDHeader, id)
	}
	return out
}
