package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// Record states in the buildq-builds bucket.
const (
	StateBuilding  = "building"
	StateSucceeded = "succeeded"
	StateFailed    = "failed"
)

// Record is the value stored under a build key: the claim while a build
// runs, then the hash → digest index entry.
type Record struct {
	Key   string `json:"key"`
	State string `json:"state"`
	// Owner is the worker that holds the claim; LeaseUntil is when the claim
	// lapses unless renewed. A zero lease means the owner let it go.
	Owner      string    `json:"owner,omitempty"`
	LeaseUntil time.Time `json:"leaseUntil,omitzero"`
	// Tenant and Name of the request that claimed the key.
	Tenant string `json:"tenant,omitempty"`
	Name   string `json:"name,omitempty"`
	// RequestID is the request whose build this is.
	RequestID string `json:"requestId,omitempty"`
	// Seq is the stream sequence of that request's message.
	Seq uint64 `json:"seq,omitempty"`
	Job string `json:"job,omitempty"`
	// JobUID names the run (the Job's UID) the outcome came from.
	JobUID     string `json:"jobUid,omitempty"`
	Repository string `json:"repository,omitempty"`
	Image      string `json:"image,omitempty"`
	// Pushed lists every repo:tag known to point at Digest.
	Pushed     []string  `json:"pushed,omitempty"`
	Digest     string    `json:"digest,omitempty"`
	Reason     string    `json:"reason,omitempty"`
	Message    string    `json:"message,omitempty"`
	LogTail    string    `json:"logTail,omitempty"`
	StartedAt  time.Time `json:"startedAt,omitzero"`
	FinishedAt time.Time `json:"finishedAt,omitzero"`
}

// Final reports whether the record holds a finished build.
func (r *Record) Final() bool { return r.State == StateSucceeded || r.State == StateFailed }

// claims wraps the KV bucket with compare-and-swap helpers.
type claims struct {
	kv jetstream.KeyValue
}

// get returns the record and its revision; (nil, 0, nil) when absent.
func (c claims) get(ctx context.Context, key string) (*Record, uint64, error) {
	e, err := c.kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read claim %s: %w", key, err)
	}
	var r Record
	if err := json.Unmarshal(e.Value(), &r); err != nil {
		// A record we cannot read is treated as absent and overwritten by
		// the next claim, rather than blocking the key forever.
		return &Record{Key: key, State: StateFailed, Message: "unreadable record"}, e.Revision(), nil
	}
	return &r, e.Revision(), nil
}

// create stores r if the key is absent. ok is false when another worker got
// there first.
func (c claims) create(ctx context.Context, r *Record) (rev uint64, ok bool, err error) {
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
func (c claims) update(ctx context.Context, r *Record, rev uint64) (uint64, bool, error) {
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

// finalize stores a final record unless the key already has one, and
// returns the record that is final in the end (ours or the earlier one).
func (c claims) finalize(ctx context.Context, final *Record) (*Record, error) {
	for {
		cur, rev, err := c.get(ctx, final.Key)
		if err != nil {
			return nil, err
		}
		// A cancel of this very build wins over the outcome the cancel
		// caused (its Job deleted), even when the claim did not name the
		// Job yet.
		if cur != nil && cur.Final() && cur.RequestID == final.RequestID && (cur.Job == final.Job || cur.Reason == v1.ReasonCanceled) {
			return cur, nil
		}
		if cur == nil {
			if _, ok, err := c.create(ctx, final); err != nil {
				return nil, err
			} else if ok {
				return final, nil
			}
			continue
		}
		if cur.State == StateSucceeded {
			// Someone already recorded a success for this key; keep it.
			return cur, nil
		}
		if _, ok, err := c.update(ctx, final, rev); err != nil {
			return nil, err
		} else if ok {
			return final, nil
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
}

func isWrongRevision(err error) bool {
	return errors.Is(err, jetstream.ErrKeyRevisionMismatch) || errors.Is(err, jetstream.ErrKeyExists)
}
