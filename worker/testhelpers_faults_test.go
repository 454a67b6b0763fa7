package worker

// Faults the tests inject: KV writes lost, or landed with their reply
// lost; KV calls failed or held; Job creates and deletes held on their way
// to the API server; a ledger mark held back; a goroutine paused at a
// chosen function.

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	batchv1client "k8s.io/client-go/kubernetes/typed/batch/v1"
)

// Fates of one KV write in faultyKV.
const (
	writePasses = ""
	// writeLost: the write never reaches the server; the caller sees a
	// timeout.
	writeLost = "lost"
	// writeLanded: the write is stored, but the caller sees a timeout (the
	// reply was lost: a NATS restart, a slow leader).
	writeLanded = "landed"
)

// faultyKV is a KV bucket whose Update calls can be lost or can land and
// still report a timeout.
type faultyKV struct {
	jetstream.KeyValue
	onUpdate func(key string, value []byte) string
}

func (f *faultyKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	switch f.onUpdate(key, value) {
	case writeLost:
		return 0, nats.ErrTimeout
	case writeLanded:
		if _, err := f.KeyValue.Update(ctx, key, value, rev); err != nil {
			return 0, err
		}
		return 0, nats.ErrTimeout
	}
	return f.KeyValue.Update(ctx, key, value, rev)
}

// hookedKV is a KV bucket whose calls a test can fail or hold: each hook,
// when set, sees the call first and returns a non-nil error to fail it.
type hookedKV struct {
	jetstream.KeyValue
	onGet    func(ctx context.Context, key string) error
	onCreate func(key string, value []byte) error
	onUpdate func(key string, value []byte) error
}

func (k *hookedKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.onGet != nil {
		if err := k.onGet(ctx, key); err != nil {
			return nil, err
		}
	}
	return k.KeyValue.Get(ctx, key)
}

func (k *hookedKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	if k.onCreate != nil {
		if err := k.onCreate(key, value); err != nil {
			return 0, err
		}
	}
	return k.KeyValue.Create(ctx, key, value, opts...)
}

func (k *hookedKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if k.onUpdate != nil {
		if err := k.onUpdate(key, value); err != nil {
			return 0, err
		}
	}
	return k.KeyValue.Update(ctx, key, value, rev)
}

// slowMark delays the first write that marks one ledger entry published
// (a slow KV write, a GC pause between the PubAck and the mark): it
// widens the window between "decision recorded" and "marked published"
// in which any other reader of the entry publishes the result again.
type slowMark struct {
	jetstream.KeyValue
	key   string // ledger key
	delay time.Duration
	armed *atomic.Bool // shared between workers: only the first mark waits
}

func (s *slowMark) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if key == s.key && bytes.Contains(value, []byte(`"published":true`)) && s.armed.CompareAndSwap(true, false) {
		time.Sleep(s.delay)
	}
	return s.KeyValue.Update(ctx, key, value, rev)
}

// losePublishedMarks makes w's writes of the ledger entry of tenant's
// request id that mark it published fail while lose reports true: the
// record of a stored result lost, as by a KV fault or a worker killed
// right after its PubAck.
func losePublishedMarks(w *Worker, tenant, id string, lose func() bool) {
	lk := RequestIndexKey(tenant, id)
	w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) error {
		if k == lk && bytes.Contains(value, []byte(`"published":true`)) && lose() {
			return errors.New("write lost (fault injection)")
		}
		return nil
	}})
}

// always is a fault that never heals.
func always() bool { return true }

// slowCreates is an API client whose Job creates can be held: the request
// reached the API server, whose answer comes late. (A reactor cannot
// block: the fake clientset holds its lock while reactors run.)
type slowCreates struct {
	kubernetes.Interface
	hold       func()            // called before each Job create is passed on; nil: none
	holdDelete func(name string) // called before each Job delete is passed on; nil: none
}

func (s slowCreates) BatchV1() batchv1client.BatchV1Interface {
	return slowBatch{BatchV1Interface: s.Interface.BatchV1(), s: s}
}

type slowBatch struct {
	batchv1client.BatchV1Interface
	s slowCreates
}

func (b slowBatch) Jobs(ns string) batchv1client.JobInterface {
	return slowJobs{JobInterface: b.BatchV1Interface.Jobs(ns), s: b.s}
}

type slowJobs struct {
	batchv1client.JobInterface
	s slowCreates
}

func (j slowJobs) Create(ctx context.Context, job *batchv1.Job, opts metav1.CreateOptions) (*batchv1.Job, error) {
	if j.s.hold != nil {
		j.s.hold()
	}
	return j.JobInterface.Create(ctx, job, opts)
}

func (j slowJobs) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	if j.s.holdDelete != nil {
		j.s.holdDelete(name)
	}
	return j.JobInterface.Delete(ctx, name, opts)
}

// stackPause pauses, once, the first goroutine that reads the worker's
// clock from inside a function whose name ends with fn — a handler
// descheduled (a GC pause, a slow KV round trip) at that point.
type stackPause struct {
	fn      string
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (p *stackPause) open() { p.once.Do(func() { close(p.release) }) }

func (p *stackPause) now() time.Time {
	if p.armed.Load() && calledFrom(p.fn) && p.armed.CompareAndSwap(true, false) {
		close(p.entered)
		<-p.release
	}
	return time.Now()
}

func (p *stackPause) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-p.entered:
	case <-time.After(10 * time.Second):
		t.Fatalf("no goroutine reached %s", p.fn)
	}
}

func newStackPause(t *testing.T, fn string) *stackPause {
	p := &stackPause{fn: fn, entered: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(p.open)
	return p
}

// calledFrom reports whether a function whose name ends with suffix is on
// the caller's stack.
func calledFrom(suffix string) bool {
	pcs := make([]uintptr, 48)
	n := runtime.Callers(2, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	for {
		f, more := frames.Next()
		if strings.HasSuffix(f.Function, suffix) {
			return true
		}
		if !more {
			return false
		}
	}
}
