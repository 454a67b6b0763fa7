package worker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// RequestIndexKey is the ledger key of a tenant's request id. Request ids
// may hold ':' which KV keys may not, so the key is a hash; the tenant is
// part of it, so tenants' ids never meet.
func RequestIndexKey(tenant, requestID string) string {
	sum := sha256.Sum256([]byte(tenant + "\n" + requestID))
	return hex.EncodeToString(sum[:20])
}

var buildKeyRe = regexp.MustCompile(`^[a-f0-9]{64}$`)

// IsBuildKey reports whether s looks like a build key (64 hex digits).
func IsBuildKey(s string) bool { return buildKeyRe.MatchString(s) }

func ensureRequestsBucket(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.KeyValue, error) {
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      v1.RequestsBucket,
		Description: "buildq request ledger: tenant and request id → build key, state and decided result",
		History:     1,
		TTL:         cfg.ResultsMaxAge,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
	})
	if err != nil {
		return nil, fmt.Errorf("create key-value bucket %s: %w", v1.RequestsBucket, err)
	}
	return kv, nil
}

// ledgerEntry is an entry and its revision.
type ledgerEntry struct {
	e   v1.RequestEntry
	rev uint64
}

// errDuplicateID: another message already holds this request id.
var errDuplicateID = errors.New("duplicate request id")

// openEntry finds or creates the ledger entry of a request message. fresh
// is true when this call created it (the first time any worker handled the
// message). A different message holding the id gives errDuplicateID.
func (w *Worker) openEntry(ctx context.Context, tenant, name, id, key string, seq uint64, at time.Time) (le *ledgerEntry, fresh bool, err error) {
	k := RequestIndexKey(tenant, id)
	for range 10 {
		// Create first: a request is almost always new, and this is one
		// round trip where reading first was two.
		e := v1.RequestEntry{RequestID: id, Tenant: tenant, Name: name, Key: key, State: v1.RequestStateBuilding,
			Seq: seq, MsgTime: at.UTC(), Worker: w.cfg.ID, UpdatedAt: w.cfg.Now().UTC()}
		b, _ := json.Marshal(e)
		rev, err := w.requests.Create(ctx, k, b)
		if err == nil {
			return &ledgerEntry{e: e, rev: rev}, true, nil
		}
		if !isWrongRevision(err) {
			return nil, false, fmt.Errorf("request ledger: %w", err)
		}
		got, err := w.requests.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue // deleted since: create it
		}
		if err != nil {
			return nil, false, fmt.Errorf("request ledger: %w", err)
		}
		var cur v1.RequestEntry
		if err := json.Unmarshal(got.Value(), &cur); err != nil {
			return nil, false, fmt.Errorf("request ledger: unreadable entry for %s: %w", id, err)
		}
		if cur.Seq != seq || !cur.MsgTime.Equal(at.UTC()) {
			return nil, false, errDuplicateID
		}
		return &ledgerEntry{e: cur, rev: got.Revision()}, false, nil
	}
	return nil, false, errors.New("request ledger: entry keeps changing")
}

// record stores v as the request's decision, unless another handler of the
// same message decided first: then that decision is returned and stands.
func (w *Worker) record(ctx context.Context, le *ledgerEntry, v verdict) (verdict, error) {
	k := RequestIndexKey(le.e.Tenant, le.e.RequestID)
	for range 10 {
		if le.e.Result != nil {
			return verdictOf(le.e), nil
		}
		if le.e.Canceled && v.data.Status != v1.StatusCanceled {
			// The cancel's reply said so; the decision follows it.
			v = canceledVerdict(v)
		}
		e := le.e
		d := v.data
		e.Key, e.State, e.Origin, e.Digest, e.Reason = d.Key, string(d.Status), d.Origin, d.Digest, d.Reason
		e.Result, e.Term, e.CleanupKey, e.CleanupRun = &d, v.term, v.cleanupKey, v.cleanupRun
		e.Worker, e.UpdatedAt = w.cfg.ID, w.cfg.Now().UTC()
		b, _ := json.Marshal(e)
		rev, err := w.requests.Update(ctx, k, b, le.rev)
		if err == nil {
			le.e, le.rev = e, rev
			return v, nil
		}
		if !isWrongRevision(err) {
			return v, fmt.Errorf("request ledger: %w", err)
		}
		got, err := w.requests.Get(ctx, k)
		if err != nil {
			return v, fmt.Errorf("request ledger: %w", err)
		}
		var cur v1.RequestEntry
		if err := json.Unmarshal(got.Value(), &cur); err != nil {
			return v, fmt.Errorf("request ledger: %w", err)
		}
		le.e, le.rev = cur, got.Revision()
	}
	return v, errors.New("request ledger: entry keeps changing")
}

// keyLocks lets one goroutine at a time hold a key, without waiting.
type keyLocks struct{ m sync.Map }

// acquire takes k and returns its release, or ok false when k is held.
func (l *keyLocks) acquire(k string) (release func(), ok bool) {
	if _, held := l.m.LoadOrStore(k, struct{}{}); held {
		return nil, false
	}
	var once sync.Once
	return func() { once.Do(func() { l.m.Delete(k) }) }, true
}

// unmarkedWatch remembers, per ledger key, the revision of a decision
// another worker recorded and had not marked published, and when this
// worker first saw that revision.
type unmarkedWatch struct {
	mu sync.Mutex
	m  map[string]unmarkedSeen
}

type unmarkedSeen struct {
	rev   uint64
	since time.Time
}

// lapsed reports whether k has been seen at rev for at least grace, on
// this worker's clock; it starts the watch when k is new or changed.
func (u *unmarkedWatch) lapsed(k string, rev uint64, now time.Time, grace time.Duration) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.m == nil {
		u.m = map[string]unmarkedSeen{}
	}
	s, ok := u.m[k]
	if !ok || s.rev != rev {
		if len(u.m) >= 4096 {
			for k, s := range u.m {
				if now.Sub(s.since) > 4*grace {
					delete(u.m, k)
				}
			}
		}
		u.m[k] = unmarkedSeen{rev: rev, since: now}
		return false
	}
	if now.Sub(s.since) < grace {
		return false
	}
	delete(u.m, k)
	return true
}

// publishGrace is how long a decision another worker recorded may stay
// unmarked before this worker takes its publish over: the decider
// publishes right after recording and marks right after the PubAck, so a
// decision left unmarked this long is taken to be a dead decider's.
func (w *Worker) publishGrace() time.Duration { return 2 * w.cfg.Lease }

// publishRight is what mayPublishDecision allows.
type publishRight int

const (
	publishNow   publishRight = iota // publish it
	publishDone                      // it is marked published: nothing to publish
	publishLater                     // not yet: look again later
)

// mayPublishDecision says whether the caller may publish le's decision,
// which was recorded before it and was not marked published when the
// caller read it. The caller holds the request in w.publishing, and the
// entry is read again under it: a read from before may predate the mark
// of another handler of this worker that held it. A decision this worker
// recorded is its own to publish again (its publish failed, or its mark
// was lost). Another worker's is published only once it has stayed
// unchanged for publishGrace on this worker's clock, and then only by the
// one taker whose compare-and-swap names it the decision's worker: a
// decider that is only slow publishes it itself, and is not joined by a
// second publish.
func (w *Worker) mayPublishDecision(ctx context.Context, le *ledgerEntry) (publishRight, error) {
	cur, err := w.ledgerGet(ctx, le.e.Tenant, le.e.RequestID)
	switch {
	case err != nil:
		return publishLater, err
	case cur == nil || cur.e.Published:
		// Marked meanwhile; or aged out, and its result with it.
		return publishDone, nil
	case cur.e.Result == nil:
		return publishLater, errors.New("request ledger: the decision read before is not there")
	}
	*le = *cur
	if le.e.Worker == w.cfg.ID {
		return publishNow, nil
	}
	k := RequestIndexKey(le.e.Tenant, le.e.RequestID)
	now := w.cfg.Now()
	if !w.unmarked.lapsed(k, le.rev, now, w.publishGrace()) && !mutant("publish-unmarked-at-once") {
		return publishLater, nil
	}
	e := le.e
	e.Worker, e.UpdatedAt = w.cfg.ID, now.UTC()
	b, _ := json.Marshal(e)
	rev, err := w.requests.Update(ctx, k, b, le.rev)
	if err != nil {
		if isWrongRevision(err) {
			return publishLater, nil // changed meanwhile: marked, or taken over
		}
		return publishLater, fmt.Errorf("request ledger: %w", err)
	}
	w.log.Info("publishing a result another worker recorded and left unpublished",
		zap.String("requestId", e.RequestID), zap.String("decidedBy", le.e.Worker))
	le.e, le.rev = e, rev
	return publishNow, nil
}

// published marks the entry's result as stored (best effort: without it a
// redelivery publishes the same result again, which the results stream's
// duplicate window drops). Another write may have come between the
// decision and the mark (a retry's count, a take-over): the decision
// itself never changes once recorded, so the mark is written again on
// the entry as it is now.
func (w *Worker) published(ctx context.Context, le *ledgerEntry) {
	k := RequestIndexKey(le.e.Tenant, le.e.RequestID)
	for range 5 {
		if le.e.Published || le.e.Result == nil {
			return
		}
		e := le.e
		e.Published, e.UpdatedAt = true, w.cfg.Now().UTC()
		b, _ := json.Marshal(e)
		rev, err := w.requests.Update(ctx, k, b, le.rev)
		if err == nil {
			le.e, le.rev = e, rev
			return
		}
		if isWrongRevision(err) {
			if cur, gerr := w.ledgerGet(ctx, le.e.Tenant, le.e.RequestID); gerr == nil && cur != nil {
				*le = *cur
				continue
			}
		}
		w.log.Debug("request ledger: marking published failed", zap.String("requestId", e.RequestID), zap.Error(err))
		return
	}
}

// canceledVerdict turns v into the "canceled" result of a request its
// tenant canceled.
func canceledVerdict(v verdict) verdict {
	v.data.Status, v.data.Reason, v.data.Message = v1.StatusCanceled, v1.ReasonCanceled, "canceled on request"
	v.data.Digest, v.data.Image, v.data.ImageRef, v.data.LogTail = "", "", "", ""
	v.term = false
	return v
}

// verdictOf is the recorded decision of an entry.
func verdictOf(e v1.RequestEntry) verdict {
	return verdict{tenant: e.Tenant, name: e.Name, data: *e.Result, term: e.Term,
		cleanupKey: e.CleanupKey, cleanupRun: e.CleanupRun, recorded: true, publishedBefore: e.Published}
}
