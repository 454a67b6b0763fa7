// Package ledger owns the buildq-requests bucket: one entry per request
// (tenant and request id → build key, state, the recorded decision, the
// retry budget spent, the requeue token), and the waiter index of the
// requests waiting on each build key.
//
// Nothing else reads or writes the bucket. Every change of an entry is a
// compare-and-swap on its revision (change), so racing handlers of one
// request — a redelivery, a parked request's answer, a cancel — agree on
// one decision; Deliver records, publishes and marks that decision, once
// per request in this worker.
package ledger

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// Key is the ledger key of a tenant's request id. Request ids may hold
// ':' which KV keys may not, so the key is a hash; the tenant is part of
// it, so tenants' ids never meet.
func Key(tenant, requestID string) string {
	sum := sha256.Sum256([]byte(tenant + "\n" + requestID))
	return hex.EncodeToString(sum[:20])
}

// BucketConfig is how the bucket is kept on the server.
type BucketConfig struct {
	TTL      time.Duration // the results' max age: an entry lives as long as its result
	Storage  jetstream.StorageType
	Replicas int
}

// EnsureBucket creates or updates the bucket.
func EnsureBucket(ctx context.Context, js jetstream.JetStream, cfg BucketConfig) (jetstream.KeyValue, error) {
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      v1.RequestsBucket,
		Description: "buildq request ledger: tenant and request id → build key, state and decided result",
		History:     1,
		TTL:         cfg.TTL,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
	})
	if err != nil {
		return nil, fmt.Errorf("create key-value bucket %s: %w", v1.RequestsBucket, err)
	}
	return kv, nil
}

// Entry is a request's entry and the revision it was read at.
type Entry struct {
	E   v1.RequestEntry
	Rev uint64
}

// Key is the entry's ledger key.
func (le *Entry) Key() string { return Key(le.E.Tenant, le.E.RequestID) }

// Errors of the ledger.
var (
	// ErrDuplicateID means another message already holds this request id.
	ErrDuplicateID = errors.New("duplicate request id")
	// ErrCanceled: the request was canceled before its source was
	// recorded (SetSource); it is not to be built.
	ErrCanceled = errors.New("request ledger: the request is canceled")
	// errGone: the entry was removed (aged out) while it was being changed.
	errGone = errors.New("request ledger: the entry is gone")
	// errConflict: the entry changed at every try.
	errConflict = errors.New("request ledger: entry keeps changing")
)

// Config is a ledger's identity and clock.
type Config struct {
	// Worker is this worker's id, written into the entries it decides.
	Worker string
	// Now is the clock (tests and the simulation set their own).
	Now func() time.Time
	// PublishGrace is how long another worker's recorded decision may
	// stay unmarked before this worker publishes it (see Deliver).
	PublishGrace time.Duration
	// Results reads the results stream (Deliver adopts a result stored
	// first); nil: publishes are taken as the decision recorded.
	Results Results
	// Young reports whether a request whose message the server stored
	// at msgTime is young enough that any result stored for it is still
	// inside the results stream's duplicate window, with room to spare:
	// its result may be published before it is recorded
	// (Delivery.First), and a publish of an older one looks for a result
	// stored for it first. It must judge by the server's clock, never
	// the worker's. Nil: never published first, and nothing looked for.
	Young func(msgTime time.Time) bool
	Log   *zap.Logger
}

// Ledger is a worker's handle on the bucket.
type Ledger struct {
	cfg Config
	kv  atomic.Pointer[jetstream.KeyValue]
	// stream is the bucket's stream, for purges (dropWaiter); nil: none.
	stream atomic.Pointer[jetstream.Stream]
	// publishing: the requests whose decision a goroutine of this worker
	// is delivering; unmarked: decisions of other workers seen recorded
	// and not marked published (deliver.go).
	publishing keyLocks
	unmarked   unmarkedWatch
}

// New returns a ledger on no bucket yet (UseBucket).
func New(cfg Config) *Ledger {
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	return &Ledger{cfg: cfg}
}

// UseBucket sets the bucket: the worker's, once set up; the tests wrap it
// to inject faults.
func (l *Ledger) UseBucket(kv jetstream.KeyValue) { l.kv.Store(&kv) }

// UseStream sets the bucket's stream (BucketStream), through which
// entries that must leave no delete marker are removed.
func (l *Ledger) UseStream(st jetstream.Stream) { l.stream.Store(&st) }

// BucketStream is the stream that holds the bucket.
func BucketStream(ctx context.Context, js jetstream.JetStream) (jetstream.Stream, error) {
	st, err := js.Stream(ctx, "KV_"+v1.RequestsBucket)
	if err != nil {
		return nil, fmt.Errorf("stream of key-value bucket %s: %w", v1.RequestsBucket, err)
	}
	return st, nil
}

// bucketSubjectPrefix is the subject prefix of the bucket's entries.
const bucketSubjectPrefix = "$KV." + v1.RequestsBucket + "."

// Bucket is the bucket in use; nil before UseBucket.
func (l *Ledger) Bucket() jetstream.KeyValue {
	if p := l.kv.Load(); p != nil {
		return *p
	}
	return nil
}

// Ready reports whether the ledger has its bucket.
func (l *Ledger) Ready() bool { return l.Bucket() != nil }

// Get reads tenant's request id; nil when unknown.
func (l *Ledger) Get(ctx context.Context, tenant, id string) (*Entry, error) {
	return l.GetKey(ctx, Key(tenant, id))
}

// GetKey reads the request whose ledger key (Key) is k; nil when unknown.
func (l *Ledger) GetKey(ctx context.Context, k string) (*Entry, error) {
	got, err := l.Bucket().Get(ctx, k)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("request ledger: %w", err)
	}
	var e v1.RequestEntry
	if err := json.Unmarshal(got.Value(), &e); err != nil {
		return nil, fmt.Errorf("request ledger: unreadable entry %s: %w", k, err)
	}
	return &Entry{E: e, Rev: got.Revision()}, nil
}

// Open finds or creates the entry of a request message. fresh is true
// when this call created it (the first time any worker handled the
// message). A different message holding the id gives ErrDuplicateID.
func (l *Ledger) Open(ctx context.Context, tenant, name, id, key string, seq uint64, at time.Time) (le *Entry, fresh bool, err error) {
	k := Key(tenant, id)
	for range 10 {
		// Create first: a request is almost always new, and this is one
		// round trip where reading first was two.
		e := v1.RequestEntry{RequestID: id, Tenant: tenant, Name: name, Key: key, State: v1.RequestStateBuilding,
			Seq: seq, MsgTime: at.UTC(), Worker: l.cfg.Worker, UpdatedAt: l.cfg.Now().UTC()}
		b, _ := json.Marshal(e)
		rev, err := l.Bucket().Create(ctx, k, b)
		if err == nil {
			return &Entry{E: e, Rev: rev}, true, nil
		}
		if !IsWrongRevision(err) {
			return nil, false, fmt.Errorf("request ledger: %w", err)
		}
		cur, err := l.Get(ctx, tenant, id)
		if err != nil {
			return nil, false, err
		}
		if cur == nil {
			continue // deleted since: create it
		}
		if cur.E.Seq != seq || !cur.E.MsgTime.Equal(at.UTC()) {
			return nil, false, ErrDuplicateID
		}
		return cur, false, nil
	}
	return nil, false, errConflict
}

// CreateDecided creates the entry of a request message with its decision
// in it: one write where Open and Record are two, for a request decided
// before anything was written for it (a cache hit answered at intake).
// ok is false, and nothing is written, when any entry of the request id
// exists (another message's, a cancel's mark, or this message's own from
// a write whose reply was lost): the caller leaves the request to the
// queue's handler, which opens the entry as it is. The returned decision
// has RecordedNow set: Deliver publishes it without reading it back.
func (l *Ledger) CreateDecided(ctx context.Context, key string, seq uint64, at time.Time, d Decision) (le *Entry, _ Decision, ok bool, err error) {
	r := d.Data
	now := l.cfg.Now().UTC()
	if r.Timings.FinishedAt.IsZero() {
		r.Timings.FinishedAt = now
	}
	e := v1.RequestEntry{RequestID: r.RequestID, Tenant: d.Tenant, Name: d.Name, Key: key, State: string(r.Status),
		Seq: seq, MsgTime: at.UTC(), Worker: l.cfg.Worker, UpdatedAt: now,
		Origin: r.Origin, Digest: r.Digest, Reason: r.Reason, Result: &r, Term: d.Term, Final: true}
	b, _ := json.Marshal(e)
	rev, err := l.Bucket().Create(ctx, Key(d.Tenant, r.RequestID), b)
	switch {
	case IsWrongRevision(err):
		return nil, d, false, nil
	case err != nil:
		return nil, d, false, fmt.Errorf("request ledger: %w", err)
	}
	d.Data, d.RecordedNow = r, true
	return &Entry{E: e, Rev: rev}, d, true, nil
}

// change is the one read–mutate–compare-and-swap loop of the ledger. It
// applies fn to a copy of le's entry and writes it at le's revision; on a
// conflict it reads the entry again and applies fn again, at most tries
// times. fn returns false when there is nothing to write (the entry says
// so already, or may no longer change that way): change then returns
// false. On success le holds the written entry; after a conflict it holds
// the entry as read. The errors: errGone, errConflict, or the bucket's.
func (l *Ledger) change(ctx context.Context, le *Entry, tries int, fn func(e *v1.RequestEntry) bool) (bool, error) {
	k := le.Key()
	for i := range tries {
		e := le.E
		if !fn(&e) {
			return false, nil
		}
		b, _ := json.Marshal(e)
		rev, err := l.Bucket().Update(ctx, k, b, le.Rev)
		if err == nil {
			le.E, le.Rev = e, rev
			return true, nil
		}
		if !IsWrongRevision(err) {
			return false, fmt.Errorf("request ledger: %w", err)
		}
		if i == tries-1 {
			break
		}
		cur, err := l.Get(ctx, le.E.Tenant, le.E.RequestID)
		if err != nil {
			return false, err
		}
		if cur == nil {
			return false, errGone
		}
		*le = *cur
	}
	return false, errConflict
}

// Record stores d as the request's decision, unless another handler of
// the same message decided first: then that decision is returned (with
// Recorded set) and stands. A request its tenant canceled is decided
// "canceled" whatever d.
func (l *Ledger) Record(ctx context.Context, le *Entry, d Decision) (Decision, error) {
	var stood *Decision
	_, err := l.change(ctx, le, 10, func(e *v1.RequestEntry) bool {
		if e.Result != nil {
			v := DecisionOf(*e)
			stood = &v
			return false
		}
		if e.Canceled && d.Data.Status != v1.StatusCanceled {
			// The cancel's reply said so; the decision follows it.
			d = d.Canceled()
		}
		r := d.Data
		e.Key, e.State, e.Origin, e.Digest, e.Reason = r.Key, string(r.Status), r.Origin, r.Digest, r.Reason
		e.Result, e.Term, e.CleanupKey, e.CleanupRun = &r, d.Term, d.CleanupKey, d.CleanupRun
		e.Worker, e.UpdatedAt = l.cfg.Worker, l.cfg.Now().UTC()
		return true
	})
	switch {
	case stood != nil:
		return *stood, nil
	case err != nil:
		return d, err
	}
	return d, nil
}

// MarkCanceled sets the Canceled mark of an undecided entry. ok is false
// when it was decided (or canceled, or removed) meanwhile.
func (l *Ledger) MarkCanceled(ctx context.Context, le *Entry) (bool, error) {
	ok, err := l.change(ctx, le, 10, func(e *v1.RequestEntry) bool {
		if e.Result != nil || e.Canceled {
			return false
		}
		e.Canceled, e.UpdatedAt = true, l.cfg.Now().UTC()
		return true
	})
	if errors.Is(err, errGone) {
		return false, nil
	}
	return ok, err
}

// SetSource records the packed git source of le's request and the build
// key it gives, once: every later delivery of the request builds that
// context (a ref that moved meanwhile does not change what the request
// asked for). A source recorded first by another handler stands, and is
// returned; so is the entry's when it was decided meanwhile.
func (l *Ledger) SetSource(ctx context.Context, le *Entry, src *v1.ResolvedSource, key string) (*v1.ResolvedSource, error) {
	canceled := false
	_, err := l.change(ctx, le, 10, func(e *v1.RequestEntry) bool {
		honorCancel := e.Canceled && !mutant.On("source-ignores-cancel")
		canceled = honorCancel && e.Source == nil
		if e.Source != nil || e.Result != nil || honorCancel {
			return false
		}
		e.Source, e.Key, e.UpdatedAt = src, key, l.cfg.Now().UTC()
		return true
	})
	switch {
	case err != nil:
		return nil, err
	case canceled:
		return nil, ErrCanceled
	case le.E.Source == nil:
		return src, nil // decided meanwhile: the decision stands anyway
	}
	return le.E.Source, nil
}

// MarkCanceledUnkeyed marks le's request canceled while it has no build
// key yet (its git source is being packed), and reports keyed when it has
// one by now: SetSource and this are one compare-and-swap apart, so
// either the source is never recorded (SetSource sees the cancel) or the
// cancel is of a keyed request, to be made as such.
func (l *Ledger) MarkCanceledUnkeyed(ctx context.Context, le *Entry) (ok, keyed bool, err error) {
	ok, err = l.change(ctx, le, 10, func(e *v1.RequestEntry) bool {
		keyed = e.Key != "" && !mutant.On("cancel-unkeyed-blind")
		if keyed || e.Result != nil || e.Canceled {
			return false
		}
		e.Canceled, e.UpdatedAt = true, l.cfg.Now().UTC()
		return true
	})
	if errors.Is(err, errGone) {
		return false, false, nil
	}
	return ok, keyed, err
}

// SpendRetry counts one transient failure of a request in its entry and
// reports whether its budget (maxFailures) still allows a retry: the
// budget bounds transient failures, not deliveries, so hand-backs at
// shutdown and crashes (which also redeliver) never use it up. Without
// an entry, or with the ledger unreachable, the message's deliveries are
// counted instead.
func (l *Ledger) SpendRetry(ctx context.Context, le *Entry, delivered uint64, maxFailures int) (retry bool) {
	if le == nil {
		return int(delivered) < maxFailures
	}
	ok, _ := l.change(ctx, le, 5, func(e *v1.RequestEntry) bool {
		e.TransientFailures++
		return true
	})
	if !ok {
		return int(delivered) < maxFailures
	}
	return le.E.TransientFailures < maxFailures
}

// RetryDelay is the delay before a request's next try: by the transient
// failures its entry counts (SpendRetry), or without an entry by its
// deliveries (which also count hand-backs and waits).
func RetryDelay(le *Entry, delivered uint64) time.Duration {
	n := delivered
	if le != nil {
		n = uint64(max(le.E.TransientFailures, 1))
	}
	return min(time.Second<<min(n, 6), time.Minute)
}

// RequeueTokenHeader carries a requeued request's token: a random value
// written into the request's entry when it parked. Only a message that
// carries it is taken for the request's first message (a tenant can read
// neither bucket, so it cannot forge one).
const RequeueTokenHeader = "Buildq-Requeue-Token"

// RequeueToken gives the entry its requeue token, once, and returns it:
// the token stays the request's for good, so every message that carries
// it — a requeue, and every redelivery of one, even after the request
// parked and unparked again — stands for the request.
func (l *Ledger) RequeueToken(ctx context.Context, le *Entry) (string, error) {
	if le == nil {
		return "", errors.New("request ledger: no entry to park")
	}
	var raw [16]byte
	_, _ = rand.Read(raw[:])
	tok := hex.EncodeToString(raw[:])
	_, err := l.change(ctx, le, 10, func(e *v1.RequestEntry) bool {
		if e.RequeueToken != "" {
			return false
		}
		e.RequeueToken, e.UpdatedAt = tok, l.cfg.Now().UTC()
		return true
	})
	if errors.Is(err, errGone) {
		return "", fmt.Errorf("request ledger: entry gone while parking: %w", err)
	}
	if err != nil {
		return "", err
	}
	return le.E.RequeueToken, nil
}

// ByRequeueToken returns the entry a requeued message stands for: the
// entry of tenant's id whose requeue token is tok; nil when tok is empty
// or not the entry's. An error means the entry could not be read, and so
// nothing is known: the caller must not take the message for a duplicate
// (or for a new request) on it — a requeue's waiter entry is gone, so the
// requeued message is all that is left of the request.
func (l *Ledger) ByRequeueToken(ctx context.Context, tenant, id, tok string) (*Entry, error) {
	if tok == "" {
		return nil, nil
	}
	le, err := l.Get(ctx, tenant, id)
	if err != nil {
		return nil, err
	}
	if le == nil || le.E.RequeueToken == "" ||
		subtle.ConstantTimeCompare([]byte(le.E.RequeueToken), []byte(tok)) != 1 {
		return nil, nil
	}
	return le, nil
}

// IsWrongRevision reports whether err is a KV compare-and-swap conflict.
func IsWrongRevision(err error) bool {
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists)
}

// WrittenAt is the server's time of le's write (of a later one, when the
// entry was written again meanwhile: that is later still, and as much the
// server's time).
func (l *Ledger) WrittenAt(ctx context.Context, le *Entry) (time.Time, error) {
	kv := l.Bucket()
	e, err := kv.GetRevision(ctx, le.Key(), le.Rev)
	if err != nil {
		e, err = kv.Get(ctx, le.Key())
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("request ledger: %w", err)
	}
	return e.Created(), nil
}

// Possession proofs: a tenant shown to hold a context's bytes is
// remembered under a key of its own in the bucket (the worker's
// possession checks make the key and the value), for as long as results
// are kept.

// HasProof reports whether the proof under key is recorded.
func (l *Ledger) HasProof(ctx context.Context, key string) (bool, error) {
	if !l.Ready() {
		return false, nil
	}
	_, err := l.Bucket().Get(ctx, key)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return false, nil
	}
	return false, fmt.Errorf("request ledger: %w", err)
}

// RecordProof records the proof value under key, unless one is recorded
// already.
func (l *Ledger) RecordProof(ctx context.Context, key string, value []byte) error {
	if !l.Ready() {
		return nil
	}
	if _, err := l.Bucket().Create(ctx, key, value); err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
		return fmt.Errorf("request ledger: %w", err)
	}
	return nil
}
