package worker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// The build record and its state machine.
//
// One record per build key lives in the buildq-builds bucket. It is the
// claim while a build runs and the key → digest index once it succeeded.
// Every write is a compare-and-swap on the record's revision, so each
// transition below is taken by exactly one party even when many race:
//
//	from                   to                      who
//	absent                 building(new run)       any worker (create)
//	failed                 building(new run)       any worker (a retry)
//	succeeded, image gone  building(new run)       any worker (a rebuild)
//	building(run r, X)     building(run r, X)      X only (lease renewal)
//	building(run r, X)     building(run r, -)      X only (release: shutdown, trouble)
//	building(run r, -)     building(run r, Y)      any worker (take-over)
//	building(run r, X)     building(run r, Y)      any worker that watched the
//	                                               record unchanged for X's lease
//	building(run r)        succeeded|failed(run r) the holder of run r, or
//	                                               anyone holding the outcome of
//	                                               the Job of run r (reconcile)
//	building(run r)        failed/Canceled(run r)  the cancel service
//	any                    absent                  the bucket's TTL
//
// A run is one attempt to build the key. Its id is new for every fresh
// claim and kept by a take-over; the Job of a run carries the id
// (kaniko.AnnotationRun), so only the Job of the record's current run is
// ever adopted, and only its outcome can end the run. A Job of any other
// run is stale by construction (its run ended when the record left it) and
// is deleted, by UID, before a new Job of the key is created.
//
// Leases are judged on the reader's own clock, never by comparing the
// writer's timestamp with the reader's: a claim is lapsed when its reader
// watched it unchanged for the owner's lease (v1.BuildRecord.LeaseMs) plus slack.
// The owner renews every lease/3, and every renewal is a new revision.

// newRunID returns a fresh run id.
func newRunID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// errSuperseded: the record moved on to another run while this one was
// finishing; its outcome no longer describes the key's claim.
var errSuperseded = errors.New("the build record moved on to another run")

// claims wraps the KV bucket with compare-and-swap helpers.
type claims struct {
	kv jetstream.KeyValue
}

// get returns the record and its revision; (nil, 0, nil) when absent.
func (c claims) get(ctx context.Context, key string) (*v1.BuildRecord, uint64, error) {
	e, err := c.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read claim %s: %w", key, err)
	}
	return decodeRecord(key, e.Value()), e.Revision(), nil
}

// decodeRecord reads a stored record. A record that cannot be read counts
// as a failed build, so the next claim replaces it rather than blocking
// the key forever.
func decodeRecord(key string, b []byte) *v1.BuildRecord {
	var r v1.BuildRecord
	if err := json.Unmarshal(b, &r); err != nil || r.State == "" {
		return &v1.BuildRecord{Key: key, State: v1.StateFailed, Message: "unreadable record"}
	}
	return &r
}

// create stores r if the key is absent. ok is false when another worker got
// there first.
func (c claims) create(ctx context.Context, r *v1.BuildRecord) (rev uint64, ok bool, err error) {
	b, _ := json.Marshal(r)
	rev, err = c.kv.Create(ctx, r.Key, b)
	if errors.Is(err, jetstream.ErrKeyExists) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("claim %s: %w", r.Key, err)
	}
	return rev, true, nil
}

// update replaces the record at revision rev. ok is false when the record
// changed in between.
func (c claims) update(ctx context.Context, r *v1.BuildRecord, rev uint64) (uint64, bool, error) {
	b, _ := json.Marshal(r)
	nrev, err := c.kv.Update(ctx, r.Key, b, rev)
	if isWrongRevision(err) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("update claim %s: %w", r.Key, err)
	}
	return nrev, true, nil
}

// finish ends run final.Run with final, starting from revision rev (the
// last one this party wrote or read). It never touches another run: when
// the record has moved to another run it returns errSuperseded, and when
// someone else already ended this run (a cancel, the reconciler) it
// returns their record, which stands.
func (c claims) finish(ctx context.Context, final *v1.BuildRecord, rev uint64) (*v1.BuildRecord, error) {
	if mutant("end-run-put") {
		b, _ := json.Marshal(final)
		if _, err := c.kv.Put(ctx, final.Key, b); err != nil {
			return nil, err
		}
		return final, nil
	}
	for {
		if _, ok, err := c.update(ctx, final, rev); err != nil {
			return nil, err
		} else if ok {
			return final, nil
		}
		cur, crev, err := c.get(ctx, final.Key)
		if err != nil {
			return nil, err
		}
		switch {
		case cur == nil:
			// Gone (the bucket's TTL, an operator): nothing to race with.
			if _, ok, err := c.create(ctx, final); err != nil {
				return nil, err
			} else if ok {
				return final, nil
			}
			continue
		case cur.Run != final.Run:
			return nil, errSuperseded
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

func isWrongRevision(err error) bool {
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists)
}
