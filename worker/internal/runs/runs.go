// Package runs owns the buildq-builds bucket: one build record per build
// key, the claim while a build runs and the key → digest index once it
// succeeded. Nothing else reads or writes the bucket.
//
// Every write is a compare-and-swap on the record's revision, so each
// transition below is taken by exactly one party even when many race:
//
//	from                   to                      who
//	absent                 building(new run)       any worker (Claim)
//	failed                 building(new run)       any worker (Reclaim: a retry)
//	succeeded, image gone  building(new run)       any worker (Reclaim: a rebuild)
//	building(run r, X)     building(run r, X)      X only (Renew)
//	building(run r, X)     building(run r, -)      X only (Release: shutdown, trouble)
//	building(run r, -)     building(run r, Y)      any worker (TakeOver)
//	building(run r, X)     building(run r, Y)      any worker that watched the
//	                                               record unchanged for X's lease
//	building(run r)        succeeded|failed(run r) the holder of run r (End), or
//	                                               anyone holding the outcome of
//	                                               the Job of run r (EndAt)
//	building(run r)        failed/Canceled(run r)  the cancel service (EndAt)
//	building(run r, X)     absent                  X only, before any Job of
//	                                               run r exists (Withdraw: a
//	                                               claim sent ahead that its
//	                                               request did not take)
//	any                    absent                  the bucket's TTL
//
// A run is one attempt to build the key. Its id is new for every fresh
// claim and kept by a take-over; the Job of a run carries the id, so only
// the Job of the record's current run is ever adopted, and only its
// outcome can end the run.
//
// Every write that ends a run or lets it go (Release, Withdraw, End, EndAt) fires
// the store's "run ended" hook (OnEnded) once it is stored: the worker
// answers the requests parked on the key there, so no caller has to
// remember to.
//
// Leases are judged on the reader's own clock, never by comparing the
// writer's timestamp with the reader's: a claim is lapsed when its reader
// watched it unchanged for the owner's lease (v1.BuildRecord.LapseAfter).
package runs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// ErrSuperseded means the record moved on to another run while this one
// was ending: its outcome no longer describes the key's claim.
var ErrSuperseded = errors.New("the build record moved on to another run")

// Store is a worker's handle on the bucket.
type Store struct {
	kv    atomic.Pointer[jetstream.KeyValue]
	ended func(ctx context.Context, key string)
}

// New returns a store on no bucket yet (UseBucket).
func New() *Store { return &Store{} }

// UseBucket sets the bucket: the worker's, once set up; the tests wrap it
// to inject faults.
func (s *Store) UseBucket(kv jetstream.KeyValue) { s.kv.Store(&kv) }

// Bucket is the bucket in use; nil before UseBucket.
func (s *Store) Bucket() jetstream.KeyValue {
	if p := s.kv.Load(); p != nil {
		return *p
	}
	return nil
}

// OnEnded sets the hook every run-ending or run-releasing write fires.
func (s *Store) OnEnded(fn func(ctx context.Context, key string)) { s.ended = fn }

func (s *Store) fire(ctx context.Context, key string) {
	if s.ended != nil {
		s.ended(ctx, key)
	}
}

// NewRunID returns a fresh run id.
func NewRunID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Get returns the record and its revision; (nil, 0, nil) when absent.
func (s *Store) Get(ctx context.Context, key string) (*v1.BuildRecord, uint64, error) {
	e, err := s.Bucket().Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read claim %s: %w", key, err)
	}
	return Decode(key, e.Value()), e.Revision(), nil
}

// Decode reads a stored record. A record that cannot be read counts as a
// failed build, so the next claim replaces it rather than blocking the
// key forever.
func Decode(key string, b []byte) *v1.BuildRecord {
	var r v1.BuildRecord
	if err := json.Unmarshal(b, &r); err != nil || r.State == "" {
		return &v1.BuildRecord{Key: key, State: v1.StateFailed, Message: "unreadable record"}
	}
	return &r
}

// Watch watches key's record.
func (s *Store) Watch(ctx context.Context, key string) (jetstream.KeyWatcher, error) {
	return s.Bucket().Watch(ctx, key)
}

// Claim stores the new run r if the key is absent. ok is false when
// another worker got there first.
func (s *Store) Claim(ctx context.Context, r *v1.BuildRecord) (rev uint64, ok bool, err error) {
	b, _ := json.Marshal(r)
	rev, err = s.Bucket().Create(ctx, r.Key, b)
	if errors.Is(err, jetstream.ErrKeyExists) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("claim %s: %w", r.Key, err)
	}
	return rev, true, nil
}

// Reclaim replaces a record no run holds (failed, or succeeded with its
// image gone) at revision rev with the new run r.
func (s *Store) Reclaim(ctx context.Context, r *v1.BuildRecord, rev uint64) (uint64, bool, error) {
	return s.update(ctx, r, rev)
}

// Renew writes the holder's renewed lease (Renewed) at rev.
func (s *Store) Renew(ctx context.Context, r *v1.BuildRecord, rev uint64) (uint64, bool, error) {
	return s.update(ctx, r, rev)
}

// TakeOver writes r, the run taken over (TakenOver), at rev.
func (s *Store) TakeOver(ctx context.Context, r *v1.BuildRecord, rev uint64) (uint64, bool, error) {
	return s.update(ctx, r, rev)
}

// Release lets go of the run of r at rev (Released), so the next worker
// takes it over at once. It fires the "run ended" hook whatever the
// write's outcome: a record changed meanwhile may have ended too.
func (s *Store) Release(ctx context.Context, r *v1.BuildRecord, rev uint64) (bool, error) {
	_, ok, err := s.update(ctx, Released(r), rev)
	s.fire(ctx, r.Key)
	return ok, err
}

// Withdraw removes the claim r at rev, which no Job was ever created for
// (a claim sent ahead of its request's handler that the handler did not
// take: worker/intakeclaim.go). The key is absent again, so the next
// request claims it with its own inputs rather than taking over a run of
// a request that was answered, canceled or never handled. ok is false
// when the record changed in between: someone else's now. It fires the
// "run ended" hook whatever the write's outcome, as Release does: the
// requests parked on the key look again.
func (s *Store) Withdraw(ctx context.Context, r *v1.BuildRecord, rev uint64) (bool, error) {
	err := s.Bucket().Delete(ctx, r.Key, jetstream.LastRevision(rev))
	s.fire(ctx, r.Key)
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("withdraw claim %s: %w", r.Key, err)
	}
	return true, nil
}

// EndAt ends a run with final in one compare-and-swap at rev (a cancel,
// the reconciler's outcome of the run's own Job): a record that changed
// meanwhile is left to whoever changed it. It fires the "run ended" hook.
func (s *Store) EndAt(ctx context.Context, final *v1.BuildRecord, rev uint64) (bool, error) {
	_, ok, err := s.update(ctx, final, rev)
	if ok {
		s.fire(ctx, final.Key)
	}
	return ok, err
}

// End ends run final.Run with final, starting from revision rev (the last
// one the holder wrote or read). It never touches another run: when the
// record has moved to another run it returns ErrSuperseded, and when
// someone else already ended this run (a cancel, the reconciler) it
// returns their record, which stands. It fires the "run ended" hook.
func (s *Store) End(ctx context.Context, final *v1.BuildRecord, rev uint64) (*v1.BuildRecord, error) {
	stored, err := s.end(ctx, final, rev)
	if err == nil {
		s.fire(ctx, final.Key)
	}
	return stored, err
}

func (s *Store) end(ctx context.Context, final *v1.BuildRecord, rev uint64) (*v1.BuildRecord, error) {
	if mutant.On("end-run-put") {
		b, _ := json.Marshal(final)
		if _, err := s.Bucket().Put(ctx, final.Key, b); err != nil {
			return nil, err
		}
		return final, nil
	}
	for {
		if _, ok, err := s.update(ctx, final, rev); err != nil {
			return nil, err
		} else if ok {
			return final, nil
		}
		cur, crev, err := s.Get(ctx, final.Key)
		if err != nil {
			return nil, err
		}
		switch {
		case cur == nil:
			// Gone (the bucket's TTL, an operator): nothing to race with.
			if _, ok, err := s.Claim(ctx, final); err != nil {
				return nil, err
			} else if ok {
				return final, nil
			}
			continue
		case cur.Run != final.Run:
			return nil, ErrSuperseded
		case cur.Final():
			return cur, nil
		}
		// The same run, still building: taken over while this party was
		// slow. The outcome is the run's all the same.
		rev = crev
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
}

// update replaces the record at revision rev. ok is false when the record
// changed in between.
func (s *Store) update(ctx context.Context, r *v1.BuildRecord, rev uint64) (uint64, bool, error) {
	b, _ := json.Marshal(r)
	nrev, err := s.Bucket().Update(ctx, r.Key, b, rev)
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("update claim %s: %w", r.Key, err)
	}
	return nrev, true, nil
}

// The transitions of a record: each returns the record after it, and is
// written with the Store's method of the same name.

// Released is r let go by its owner: no owner, no lease.
func Released(r *v1.BuildRecord) *v1.BuildRecord {
	c := *r
	c.Owner, c.LeaseUntil = "", time.Time{}
	return &c
}

// Renewed is r with its holder's lease renewed from now.
func Renewed(r *v1.BuildRecord, now time.Time, lease time.Duration) *v1.BuildRecord {
	c := *r
	c.LeaseUntil = now.UTC().Add(lease)
	return &c
}

// Canceled is r's run ended by its tenant's cancel.
func Canceled(r *v1.BuildRecord, now time.Time) *v1.BuildRecord {
	c := *r
	c.State, c.Reason, c.Message = v1.StateFailed, v1.ReasonCanceled, "canceled on request"
	c.Owner, c.LeaseUntil, c.FinishedAt = "", time.Time{}, now.UTC()
	c.Digest, c.LogTail = "", ""
	return &c
}
