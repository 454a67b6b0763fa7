package ledger

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// world is one embedded NATS server with JetStream and the real
// buildq-requests bucket, which every ledger of a test shares.
type world struct {
	t  *testing.T
	js jetstream.JetStream
	kv jetstream.KeyValue
}

func newWorld(t *testing.T) *world {
	t.Helper()
	_, _, js := testnats.JetStream(t)
	kv, err := EnsureBucket(t.Context(), js, BucketConfig{TTL: time.Hour, Storage: jetstream.FileStorage, Replicas: 1})
	if err != nil {
		t.Fatal(err)
	}
	return &world{t: t, js: js, kv: kv}
}

// clock is a test clock that moves only when told.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock { return &clock{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// ledger returns worker's ledger on the world's bucket (kv, when given,
// wraps it).
func (w *world) ledger(worker string, clk *clock, grace time.Duration, kv ...jetstream.KeyValue) *Ledger {
	l := New(Config{Worker: worker, Now: clk.Now, PublishGrace: grace})
	if len(kv) > 0 {
		l.UseBucket(kv[0])
	} else {
		l.UseBucket(w.kv)
	}
	st, err := BucketStream(w.t.Context(), w.js)
	if err != nil {
		w.t.Fatal(err)
	}
	l.UseStream(st)
	return l
}

// open opens the entry of tenant's request id as the first message
// (sequence 1) would.
func open(t *testing.T, l *Ledger, tenant, id string) *Entry {
	t.Helper()
	le, fresh, err := l.Open(t.Context(), tenant, "app", id, "key1", 1, msgTime)
	if err != nil || !fresh {
		t.Fatalf("Open(%s/%s) = fresh %v, %v; want a fresh entry", tenant, id, fresh, err)
	}
	return le
}

// msgTime is the request message's stream time in the tests.
var msgTime = time.Date(2030, 1, 2, 3, 0, 0, 123456789, time.UTC)

// read reads the stored entry, failing the test when it is absent.
func read(t *testing.T, l *Ledger, tenant, id string) *Entry {
	t.Helper()
	le, err := l.Get(t.Context(), tenant, id)
	if err != nil {
		t.Fatal(err)
	}
	if le == nil {
		t.Fatalf("no entry for %s/%s", tenant, id)
	}
	return le
}

// decision is a result for tenant's request id with status st.
func decision(tenant, id string, st v1.Status) Decision {
	d := Decision{Tenant: tenant, Name: "app", Data: v1.ResultData{
		RequestID: id, Tenant: tenant, Name: "app", Key: "key1", Status: st, Origin: v1.OriginBuild,
	}}
	switch st {
	case v1.StatusSucceeded:
		d.Data.Digest, d.Data.Image, d.Data.ImageRef = "sha256:"+id, "reg/app:1", "reg/app@sha256:"+id
	case v1.StatusFailed:
		d.Data.Reason, d.Data.Message, d.Data.LogTail = "BuildFailed", "exit 1", "boom"
	}
	return d
}

// faultyKV wraps the bucket to run a hook before a write: the hook may
// write the bucket itself (a concurrent writer) or return an error that
// the write then returns instead of being sent.
type faultyKV struct {
	jetstream.KeyValue
	mu           sync.Mutex
	beforeUpdate func(key string, rev uint64) error
	beforeCreate func(key string) error
	getErr       error
	updates      int
}

func (f *faultyKV) failGet(err error) {
	f.mu.Lock()
	f.getErr = err
	f.mu.Unlock()
}

func (f *faultyKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	f.mu.Lock()
	err := f.getErr
	f.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return f.KeyValue.Get(ctx, key)
}

func (f *faultyKV) onUpdate(fn func(key string, rev uint64) error) {
	f.mu.Lock()
	f.beforeUpdate = fn
	f.mu.Unlock()
}

func (f *faultyKV) onCreate(fn func(key string) error) {
	f.mu.Lock()
	f.beforeCreate = fn
	f.mu.Unlock()
}

func (f *faultyKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	f.mu.Lock()
	hook := f.beforeUpdate
	f.updates++
	f.mu.Unlock()
	if hook != nil {
		if err := hook(key, rev); err != nil {
			return 0, err
		}
	}
	return f.KeyValue.Update(ctx, key, value, rev)
}

func (f *faultyKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	f.mu.Lock()
	hook := f.beforeCreate
	f.mu.Unlock()
	if hook != nil {
		if err := hook(key); err != nil {
			return 0, err
		}
	}
	return f.KeyValue.Create(ctx, key, value, opts...)
}

// publisher counts the publishes Deliver makes, and can fail or block
// them.
type publisher struct {
	mu   sync.Mutex
	got  []Decision
	fail error
	// hook runs inside Publish, before it counts.
	hook func(d Decision)
}

func (p *publisher) Publish(_ context.Context, d Decision) (Ack, error) {
	p.mu.Lock()
	hook := p.hook
	p.mu.Unlock()
	if hook != nil {
		hook(d)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail != nil {
		return Ack{}, p.fail
	}
	p.got = append(p.got, d)
	return Ack{Seq: uint64(len(p.got))}, nil
}

func (p *publisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.got)
}

func (p *publisher) delivery() Delivery { return Delivery{Publish: p.Publish} }

func mustJSON(t *testing.T, e v1.RequestEntry) []byte {
	t.Helper()
	b, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
