package worker

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// boundedKV bounds each single request to a key-value bucket at attempt
// (apiAttempt in production). A request on the wire when the connection
// to its server drops is never answered: the client waits out its
// context, and the ledger's and the runs' writes run on contexts of 15 s
// and more, so one lost write after a NATS restart held a request's
// delivery (and this worker's publishing lock on it) that long. A
// request that runs out fails as a timeout always could, with its
// outcome unknown; every caller already treats it so (a create or an
// update read again, a write retried with the request). Nothing is sent
// again here: a write is not a read. Watches and listings keep their
// callers' contexts, which bound how long they run.
type boundedKV struct {
	jetstream.KeyValue
	attempt time.Duration
}

func bounded(kv jetstream.KeyValue) jetstream.KeyValue {
	return boundedKV{KeyValue: kv, attempt: apiAttempt}
}

func (b boundedKV) ctx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, b.attempt)
}

func (b boundedKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.Get(ctx, key)
}

func (b boundedKV) GetRevision(ctx context.Context, key string, revision uint64) (jetstream.KeyValueEntry, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.GetRevision(ctx, key, revision)
}

func (b boundedKV) Put(ctx context.Context, key string, value []byte) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.Put(ctx, key, value)
}

func (b boundedKV) PutString(ctx context.Context, key string, value string) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.PutString(ctx, key, value)
}

func (b boundedKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.Create(ctx, key, value, opts...)
}

func (b boundedKV) Update(ctx context.Context, key string, value []byte, revision uint64) (uint64, error) {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.Update(ctx, key, value, revision)
}

func (b boundedKV) Delete(ctx context.Context, key string, opts ...jetstream.KVDeleteOpt) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.Delete(ctx, key, opts...)
}

func (b boundedKV) Purge(ctx context.Context, key string, opts ...jetstream.KVDeleteOpt) error {
	ctx, cancel := b.ctx(ctx)
	defer cancel()
	return b.KeyValue.Purge(ctx, key, opts...)
}
