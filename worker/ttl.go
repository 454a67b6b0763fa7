package worker

import (
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// expired reports whether a request waited in the queue longer than
// QueueTTL before a worker first took it, and if so the failed result's
// message. The wait is measured from the request's JetStream timestamp
// (when the server stored it), so a producer's clock does not matter.
//
// Only the first delivery is checked: a request that was taken in time
// and is redelivered later (a transient failure, a worker handing it back
// at shutdown, a crash) may have a build running or others waiting on it,
// and expiring it then would abandon work already started.
func (w *Worker) expired(meta *jetstream.MsgMetadata, now time.Time) (string, bool) {
	ttl := w.cfg.QueueTTL
	if ttl <= 0 || meta.NumDelivered > 1 {
		return "", false
	}
	waited := now.Sub(meta.Timestamp)
	if waited <= ttl {
		return "", false
	}
	return fmt.Sprintf("waited %s in the queue, longer than the queue TTL of %s; not built",
		waited.Round(time.Millisecond), ttl), true
}

// expiredVerdict is the result of a request that expired in the queue: no
// build, no claim, terminated.
func expiredVerdict(v verdict, message string) verdict {
	v.data.Status, v.data.Reason, v.data.Message = v1.StatusFailed, v1.ReasonExpired, message
	v.term = true
	return v
}
