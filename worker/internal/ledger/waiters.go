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
	if err := l.dropWaiter(ctx, WaiterKey(key, tenant, id), 0); err != nil {
		l.cfg.Log.Debug("waiter index: delete failed", zap.String("key", key), zap.Error(err))
	}
}

// DropWaiterAt removes the waiter entry it at the revision it was read:
// a waiter written again since (parked anew) stays.
func (l *Ledger) DropWaiterAt(ctx context.Context, it WaiterItem) {
	if err := l.dropWaiter(ctx, it.K, it.Rev); err != nil && !IsWrongRevision(err) {
		l.cfg.Log.Debug("waiter index: delete failed", zap.String("entry", it.K), zap.Error(err))
	}
}

// dropWaiter removes the waiter entry k, at revision rev or any (rev 0),
// leaving nothing behind: the stream's messages of the entry up to rev
// are purged, where a key-value delete would leave a delete marker until
// the bucket's max age. The sweep lists every waiter subject the bucket
// holds (parking's sweepWaiters, every half lease on every worker), so
// markers of every build of the last days would be listed again and
// again. A write since rev (parked anew) has a later sequence and stays.
// Without the bucket's stream (UseStream) the entry is deleted as a
// key-value entry.
func (l *Ledger) dropWaiter(ctx context.Context, k string, rev uint64) error {
	st := l.stream.Load()
	if st == nil {
		var opts []jetstream.KVDeleteOpt
		if rev != 0 {
			opts = append(opts, jetstream.LastRevision(rev))
		}
		return l.Bucket().Delete(ctx, k, opts...)
	}
	opts := []jetstream.StreamPurgeOpt{jetstream.WithPurgeSubject(bucketSubjectPrefix + k)}
	if rev != 0 {
		opts = append(opts, jetstream.WithPurgeSequence(rev+1))
	}
	return (*st).Purge(ctx, opts...)
}

// ListWaiters reads the waiter entries of one build key (key) or of all
// (key ""), by build key. With the bucket's stream (UseStream) the
// entries' subjects come from the stream's leader (a stream info with a
// subject filter); each entry is then read. Without it, a key listing
// (an ordered consumer) names them: a consumer created and deleted per
// listing, which on a cluster is two changes of the meta group's state
// for every build's end.
func (l *Ledger) ListWaiters(ctx context.Context, key string) (map[string][]WaiterItem, error) {
	filter := "w.>"
	if key != "" {
		filter = "w." + key + ".*"
	}
	keys, err := l.waiterKeys(ctx, filter)
	if err != nil {
		return nil, fmt.Errorf("waiter index: %w", err)
	}
	kv := l.Bucket()
	out := map[string][]WaiterItem{}
	for _, k := range keys {
		parts := strings.Split(k, ".")
		if len(parts) != 3 {
			continue
		}
		got, err := kv.Get(ctx, k)
		if err != nil {
			continue // gone meanwhile (or a delete marker)
		}
		v, ok := ParseWaiter(got.Value())
		if !ok {
			continue
		}
		out[parts[1]] = append(out[parts[1]], WaiterItem{K: k, Rev: got.Revision(), V: v})
	}
	return out, nil
}

// waiterKeys names the bucket's keys that match filter, each once.
func (l *Ledger) waiterKeys(ctx context.Context, filter string) ([]string, error) {
	if st := l.stream.Load(); st != nil {
		info, err := (*st).Info(ctx, jetstream.WithSubjectFilter(bucketSubjectPrefix+filter))
		if err != nil {
			return nil, err
		}
		keys := make([]string, 0, len(info.State.Subjects))
		for subj := range info.State.Subjects {
			if k, ok := strings.CutPrefix(subj, bucketSubjectPrefix); ok {
				keys = append(keys, k)
			}
		}
		return keys, nil
	}
	lister, err := l.Bucket().ListKeysFiltered(ctx, filter)
	if err != nil {
		if errors.Is(err, jetstream.ErrNoKeysFound) {
			return nil, nil
		}
		return nil, err
	}
	defer func() { _ = lister.Stop() }()
	var keys []string
	seen := map[string]bool{}
	for k := range lister.Keys() {
		if !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
	}
	return keys, nil
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
