package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// The waiter index: "w.<build key>.<ledger key>" in the same bucket says
// that a request waits on a build key, so a cancel lists a key's waiters
// with one filtered listing, and whoever ends a run answers the requests
// parked on it (the worker's parking, park.go).

// WaiterKey is the bucket key of a request waiting on a build key.
func WaiterKey(key, tenant, id string) string {
	return "w." + key + "." + Key(tenant, id)
}

// Waiter is the value of a waiter entry.
type Waiter struct {
	Tenant    string `json:"tenant"`
	RequestID string `json:"requestId"`
	// Parked: no handler holds the request; the build's end answers it.
	Parked bool `json:"parked,omitempty"`
	// Run is the run it was parked on.
	Run string `json:"run,omitempty"`
	// The request message, to answer or requeue it.
	Subject  string    `json:"subject,omitempty"`
	MsgID    string    `json:"msgId,omitempty"`
	Seq      uint64    `json:"seq,omitempty"`
	MsgTime  time.Time `json:"msgTime,omitzero"`
	Body     []byte    `json:"body,omitempty"`
	ParkedAt time.Time `json:"parkedAt,omitzero"`
	// Token is the requeue token written into the ledger entry at park.
	Token string `json:"token,omitempty"`
}

// ParseWaiter reads a waiter entry: JSON, or the first version's
// "tenant/id".
func ParseWaiter(b []byte) (Waiter, bool) {
	var v Waiter
	if len(b) > 0 && b[0] == '{' {
		if json.Unmarshal(b, &v) != nil || v.Tenant == "" || v.RequestID == "" {
			return v, false
		}
		return v, true
	}
	tenant, id, ok := strings.Cut(string(b), "/")
	return Waiter{Tenant: tenant, RequestID: id}, ok
}

// WaiterItem is one waiter entry with its bucket key and revision.
type WaiterItem struct {
	K   string
	Rev uint64
	V   Waiter
}

// AddWaiter records that a request waits on key (best effort: a cancel
// that misses it may stop a build that request still waits on; the
// request, not canceled itself, then builds again — build.go's ownEnd,
// or sharedFailure for a joiner). An entry the request
// has already is kept as it is: a handler of an earlier delivery that
// stalled (a partition) while a later one parked the request must not
// turn the parked entry into a plain one — the later message is acked,
// and the parked entry is all that is left for the sweep to answer.
func (l *Ledger) AddWaiter(ctx context.Context, key, tenant, id string) {
	b, _ := json.Marshal(Waiter{Tenant: tenant, RequestID: id})
	if _, err := l.Bucket().Create(ctx, WaiterKey(key, tenant, id), b); err != nil && !IsWrongRevision(err) {
		l.cfg.Log.Debug("waiter index: create failed", zap.String("key", key), zap.Error(err))
	}
}

// PutWaiter writes v as the waiter entry of its request on key.
func (l *Ledger) PutWaiter(ctx context.Context, key string, v Waiter) error {
	_, err := l.PutWaiterRev(ctx, key, v)
	return err
}

// PutWaiterRev is PutWaiter, returning the entry's revision.
func (l *Ledger) PutWaiterRev(ctx context.Context, key string, v Waiter) (uint64, error) {
	b, _ := json.Marshal(v)
	rev, err := l.Bucket().Put(ctx, WaiterKey(key, v.Tenant, v.RequestID), b)
	if err != nil {
		return 0, fmt.Errorf("waiter index: %w", err)
	}
	return rev, nil
}

// UpdateWaiter writes v as the waiter entry of its request on key only
// if the entry is still at revision rev: an entry written since (parked
// again by another message of the request) or dropped (requeued,
// answered) is left as it is, and the error says so
// (IsWrongRevision).
func (l *Ledger) UpdateWaiter(ctx context.Context, key string, v Waiter, rev uint64) error {
	b, _ := json.Marshal(v)
	if _, err := l.Bucket().Update(ctx, WaiterKey(key, v.Tenant, v.RequestID), b, rev); err != nil {
		return fmt.Errorf("waiter index: %w", err)
	}
	return nil
}

// DropWaiter removes a request's waiter entry on key.
func (l *Ledger) DropWaiter(ctx context.Context, key, tenant, id string) {
	if err := l.Bucket().Delete(ctx, WaiterKey(key, tenant, id)); err != nil {
		l.cfg.Log.Debug("waiter index: delete failed", zap.String("key", key), zap.Error(err))
	}
}

// DropWaiterAt removes the waiter entry it at the revision it was read:
// a waiter written again since (parked anew) stays.
func (l *Ledger) DropWaiterAt(ctx context.Context, it WaiterItem) {
	if err := l.Bucket().Delete(ctx, it.K, jetstream.LastRevision(it.Rev)); err != nil && !IsWrongRevision(err) {
		l.cfg.Log.Debug("waiter index: delete failed", zap.String("entry", it.K), zap.Error(err))
	}
}

// ListWaiters reads the waiter entries of one build key (key) or of all
// (key ""), by build key.
func (l *Ledger) ListWaiters(ctx context.Context, key string) (map[string][]WaiterItem, error) {
	filter := "w.>"
	if key != "" {
		filter = "w." + key + ".*"
	}
	kv := l.Bucket()
	lister, err := kv.ListKeysFiltered(ctx, filter)
	if err != nil {
		if errors.Is(err, jetstream.ErrNoKeysFound) {
			return nil, nil
		}
		return nil, fmt.Errorf("waiter index: %w", err)
	}
	defer func() { _ = lister.Stop() }()
	out := map[string][]WaiterItem{}
	seen := map[string]bool{}
	for k := range lister.Keys() {
		if seen[k] {
			continue
		}
		seen[k] = true
		parts := strings.Split(k, ".")
		if len(parts) != 3 {
			continue
		}
		got, err := kv.Get(ctx, k)
		if err != nil {
			continue // gone meanwhile
		}
		v, ok := ParseWaiter(got.Value())
		if !ok {
			continue
		}
		out[parts[1]] = append(out[parts[1]], WaiterItem{K: k, Rev: got.Revision(), V: v})
	}
	return out, nil
}

// Waiters returns the undecided entries of the requests waiting on key,
// parked or held.
func (l *Ledger) Waiters(ctx context.Context, key string) ([]*Entry, error) {
	items, err := l.ListWaiters(ctx, key)
	if err != nil {
		return nil, err
	}
	var out []*Entry
	for _, it := range items[key] {
		le, err := l.Get(ctx, it.V.Tenant, it.V.RequestID)
		if err != nil {
			return nil, err
		}
		if le != nil && le.E.Result == nil {
			out = append(out, le)
		}
	}
	return out, nil
}
