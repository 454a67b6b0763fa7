package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Pending marks: "p.<build key>" in the same bucket names the request
// whose queued message is to build a key that has no record yet, so that
// intake may hold the key's later requests until that build ends
// (docs/design.md §2d, "Held at intake"). A mark is a hint, never a
// claim: a held request is answered only by the record's own state, and
// released to the queue when the record fails, goes, or does not come. A
// mark older than its freshness, on the reader's clock against the
// server's time of its write, is taken over by the next request to find
// it: skewed clocks only shift when that happens.

// PendingKey is the bucket key of key's pending mark.
func PendingKey(key string) string { return "p." + key }

// Pending is the value of a pending mark: the request that builds the key.
type Pending struct {
	Tenant    string `json:"tenant"`
	RequestID string `json:"requestId"`
	Priority  string `json:"priority"`
}

// MarkPending names p as the request whose queued message builds key,
// unless a mark written within fresh names another: mine reports which,
// and cur is the mark that stands (p when mine). A mark that could not be
// read or taken over leaves mine false and cur empty.
func (l *Ledger) MarkPending(ctx context.Context, key string, p Pending, fresh time.Duration) (mine bool, cur Pending, err error) {
	kv := l.Bucket()
	if kv == nil {
		return false, Pending{}, errors.New("the request ledger is not open")
	}
	b, _ := json.Marshal(p)
	k := PendingKey(key)
	// Read first: most requests that find a mark are the key's later
	// requests, and a failed create costs a read besides (the client
	// looks for a delete marker to write over).
	e, err := kv.Get(ctx, k)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		if _, err := kv.Create(ctx, k, b); err != nil {
			if IsWrongRevision(err) {
				return false, Pending{}, nil // marked by another request just now
			}
			return false, Pending{}, fmt.Errorf("pending mark: %w", err)
		}
		return true, p, nil
	}
	if err != nil {
		return false, Pending{}, fmt.Errorf("pending mark: %w", err)
	}
	if json.Unmarshal(e.Value(), &cur) == nil && cur.Tenant != "" && time.Since(e.Created()) < fresh {
		return false, cur, nil
	}
	if _, err := kv.Update(ctx, k, b, e.Revision()); err != nil {
		if IsWrongRevision(err) {
			return false, Pending{}, nil // taken over by another request just now
		}
		return false, Pending{}, fmt.Errorf("pending mark: %w", err)
	}
	return true, p, nil
}
