package worker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// lostKV answers no request, as a server that dropped the connection
// after the request went out: each waits out its context.
type lostKV struct{ jetstream.KeyValue }

func (lostKV) Get(ctx context.Context, _ string) (jetstream.KeyValueEntry, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (lostKV) Create(ctx context.Context, _ string, _ []byte, _ ...jetstream.KVCreateOpt) (uint64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

func (lostKV) Update(ctx context.Context, _ string, _ []byte, _ uint64) (uint64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

func (lostKV) Put(ctx context.Context, _ string, _ []byte) (uint64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

func (lostKV) Delete(ctx context.Context, _ string, _ ...jetstream.KVDeleteOpt) error {
	<-ctx.Done()
	return ctx.Err()
}

func (lostKV) Purge(ctx context.Context, _ string, _ ...jetstream.KVDeleteOpt) error {
	<-ctx.Done()
	return ctx.Err()
}

// A key-value request whose answer is lost with the connection fails
// once its attempt runs out, with its caller's context still alive: the
// caller's handling of an unknown outcome starts then, not when a 15 s
// context is spent. The request is not sent again.
func TestAKeyValueRequestLostWithTheConnectionFailsOnItsOwn(t *testing.T) {
	t.Parallel()
	kv := boundedKV{KeyValue: lostKV{}, attempt: 100 * time.Millisecond}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for name, call := range map[string]func() error{
		"get":    func() error { _, err := kv.Get(ctx, "k"); return err },
		"create": func() error { _, err := kv.Create(ctx, "k", nil); return err },
		"update": func() error { _, err := kv.Update(ctx, "k", nil, 7); return err },
		"put":    func() error { _, err := kv.Put(ctx, "k", nil); return err },
		"delete": func() error { return kv.Delete(ctx, "k") },
		"purge":  func() error { return kv.Purge(ctx, "k") },
	} {
		if err := call(); !errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
			t.Errorf("%s with its answer lost: %v, the caller's context: %v; want the attempt's deadline, the caller's context alive", name, err, ctx.Err())
		}
	}
}

// The worker's buckets are bounded so: the ledger's and the runs'.
func TestTheWorkersBucketsBoundEachRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := ruleWorker(t, e, countingBackend{runs: make(chan Build, 1)})
	for name, kv := range map[string]jetstream.KeyValue{"ledger": w.ledger.Bucket(), "runs": w.runs.Bucket()} {
		b, ok := kv.(boundedKV)
		if !ok || b.attempt != apiAttempt {
			t.Errorf("the %s bucket is a %T (attempt %v), want boundedKV with apiAttempt", name, kv, b.attempt)
		}
	}
}
