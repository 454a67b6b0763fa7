package worker

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// createWorkersConsumer creates or updates buildq-workers. Its AckWait is
// only ever raised, never lowered, like the dispatch consumers' (§2d): a
// request a handler took straight from intake (fairq's direct.go) is held
// on this consumer, heartbeaten every third of the AckWait it had when it
// was taken, and a lower AckWait set under it would have it redelivered
// while it runs. A worker started with a shorter --ack-wait heartbeats
// more often and changes nothing; lowering it is `nats consumer edit`
// (or rm) by hand. Two workers starting at once may write in the wrong
// order: each reads the consumer back and raises it again, before it takes
// any request.
func createWorkersConsumer(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.Consumer, error) {
	ackWait := cfg.AckWait
	for try := 0; ; try++ {
		if cur, err := js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer); err == nil && cur.CachedInfo().Config.AckWait > ackWait && !mutant.On("workers-ackwait-lowered") {
			ackWait = cur.CachedInfo().Config.AckWait
		}
		cons, err := upsertWorkersConsumer(ctx, js, ackWait)
		if err != nil {
			return nil, err
		}
		// Read back: lowered meanwhile by a worker that read it before
		// this one raised it, it is raised again (a failed read leaves it
		// as written).
		if back, err := cons.Info(ctx); err == nil && back.Config.AckWait < ackWait && try < 4 {
			continue
		}
		return cons, nil
	}
}

func upsertWorkersConsumer(ctx context.Context, js jetstream.JetStream, ackWait time.Duration) (jetstream.Consumer, error) {
	cons, err := js.CreateOrUpdateConsumer(ctx, v1.RequestsStream, jetstream.ConsumerConfig{
		Durable:     v1.WorkersConsumer,
		Description: "buildq workers (shared)",
		AckPolicy:   jetstream.AckExplicitPolicy,
		AckWait:     ackWait,
		// Unlimited on the server: a hand-back at shutdown counts as a
		// delivery, and a message past the server's MaxDeliver is never
		// delivered again, so a request handed back on its last delivery
		// would be stranded without a result. The worker enforces
		// cfg.MaxDeliver itself, on transient failures.
		MaxDeliver: -1,
		// Unlimited too: intake holds first deliveries while their key
		// builds (intakehold.go), each worker at most maxHeldAtIntake, and
		// the server's default of 1,000 would stop every worker's fetch
		// of new requests — the builds' own among them — behind them.
		MaxAckPending: -1,
		FilterSubject: v1.RequestsPrefix + ".>",
	})
	if err != nil {
		return nil, fmt.Errorf("create consumer %s: %w", v1.WorkersConsumer, err)
	}
	return cons, nil
}
