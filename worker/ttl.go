package worker

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// expired reports whether a request waited in the queue longer than
// QueueTTL before a worker first took it, and if so the failed result's
// message. Both ends of the wait are the server's clock: from the
// request's JetStream timestamp (when the server stored it) to the
// server's timestamp of le, the ledger entry the first handler of the
// request has just created (fresh). Neither the producer's clock nor the
// worker's decides: a worker whose clock is off, by any amount, neither
// expires a fresh request nor builds a stale one (docs/design.md §6). An
// entry whose time cannot be read does not expire the request.
//
// Only a request no handler took before is checked — its first handler,
// the one that created its entry (the caller's fresh), not its first
// delivery: a request that was taken in time and is redelivered later (a
// transient failure, a worker handing it back at shutdown, a crash) has
// its entry, and may have a build running or others waiting on it, and
// expiring it then would abandon work already started; a delivery nobody
// handled (to a worker's pull that died with it, or an admission that
// failed) started nothing.
func (w *Worker) expired(ctx context.Context, meta *jetstream.MsgMetadata, le *ledger.Entry) (string, bool) {
	ttl := w.cfg.QueueTTL
	if ttl <= 0 || le == nil {
		return "", false
	}
	written, err := w.ledger.WrittenAt(ctx, le)
	if err != nil {
		w.log.Warn("reading the server's time of the request's ledger entry failed; the queue TTL is not applied",
			zap.String("requestId", le.E.RequestID), zap.Error(err))
		return "", false
	}
	waited := written.Sub(meta.Timestamp)
	if waited <= ttl {
		return "", false
	}
	return fmt.Sprintf("waited %s in the queue, longer than the queue TTL of %s; not built",
		waited.Round(time.Millisecond), ttl), true
}

// expiredVerdict is the result of a request that expired in the queue: no
// build, no claim, terminated.
func expiredVerdict(v verdict, message string) verdict {
	v.Data.Status, v.Data.Reason, v.Data.Message = v1.StatusFailed, v1.ReasonExpired, message
	v.Term = true
	return v
}
