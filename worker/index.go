package worker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// RequestsBucket indexes requests by id, so `buildq status` and `buildq
// cancel` can find a request's build key. Entries expire with the results.
const RequestsBucket = "buildq-requests"

// RequestEntry is what the index knows of one request.
type RequestEntry struct {
	RequestID string    `json:"requestId"`
	Tenant    string    `json:"tenant"`
	Name      string    `json:"name"`
	Key       string    `json:"key"`
	State     string    `json:"state"` // building, then the result's status
	Origin    v1.Origin `json:"origin,omitempty"`
	Digest    string    `json:"digest,omitempty"`
	Reason    string    `json:"reason,omitempty"`
	Worker    string    `json:"worker,omitempty"`
	UpdatedAt time.Time `json:"updatedAt"`
}

// RequestIndexKey is the KV key of a request id. Request ids may hold ':'
// which KV keys may not, so the key is a hash.
func RequestIndexKey(requestID string) string {
	sum := sha256.Sum256([]byte(requestID))
	return hex.EncodeToString(sum[:20])
}

var buildKeyRe = regexp.MustCompile(`^[a-f0-9]{64}$`)

// IsBuildKey reports whether s looks like a build key (64 hex digits).
func IsBuildKey(s string) bool { return buildKeyRe.MatchString(s) }

func ensureRequestsBucket(ctx context.Context, js jetstream.JetStream, cfg Config) (jetstream.KeyValue, error) {
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      RequestsBucket,
		Description: "buildq request id → build key and state",
		History:     1,
		TTL:         cfg.ResultsMaxAge,
		Storage:     cfg.Storage,
		Replicas:    cfg.Replicas,
	})
	if err != nil {
		return nil, fmt.Errorf("create key-value bucket %s: %w", RequestsBucket, err)
	}
	return kv, nil
}

// index records a request's state; the index serves status and cancel and
// is best effort: a failure is logged, never fails the request.
func (w *Worker) index(ctx context.Context, e RequestEntry) {
	if w.requests == nil || e.RequestID == "" {
		return
	}
	e.Worker, e.UpdatedAt = w.cfg.ID, w.cfg.Now().UTC()
	b, _ := json.Marshal(e)
	if _, err := w.requests.Put(ctx, RequestIndexKey(e.RequestID), b); err != nil {
		w.log.Debug("request index update failed", zap.String("requestId", e.RequestID), zap.Error(err))
	}
}

// CancelReply answers a cancel request.
type CancelReply struct {
	Key      string `json:"key,omitempty"`
	Canceled bool   `json:"canceled"`
	Message  string `json:"message"`
}

// serveCancel answers cancel requests on buildq.cancel.<tenant>.<name>
// (one worker of the queue group answers each).
func (w *Worker) serveCancel(ctx context.Context) (*nats.Subscription, error) {
	return w.nc.QueueSubscribe(v1.CancelPrefix+".>", "buildq-cancel", func(m *nats.Msg) {
		cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		tenant := ""
		if parts := strings.Split(m.Subject, "."); len(parts) == 4 {
			tenant = parts[2]
		}
		rep := w.cancel(cctx, tenant, string(m.Data))
		b, _ := json.Marshal(rep)
		_ = m.Respond(b)
	})
}

// cancel ends the build of a key (or of a request's key): the claim becomes
// a final Canceled record, which every waiting request turns into its
// "canceled" result, and the build itself is stopped. Only the tenant
// whose request claimed the build may cancel it: the cancel subject's
// tenant must match, so NATS permissions on buildq.cancel.<tenant>.> are
// what guards a tenant's builds.
func (w *Worker) cancel(ctx context.Context, tenant, target string) CancelReply {
	key := target
	if !IsBuildKey(target) {
		e, err := w.requests.Get(ctx, RequestIndexKey(target))
		if err != nil {
			return CancelReply{Message: fmt.Sprintf("no request %q is known", target)}
		}
		var re RequestEntry
		if err := json.Unmarshal(e.Value(), &re); err != nil || re.Key == "" {
			return CancelReply{Message: fmt.Sprintf("request %q has no build yet", target)}
		}
		if re.Tenant != tenant {
			return CancelReply{Message: fmt.Sprintf("request %q belongs to tenant %q: send the cancel on %s", target, re.Tenant, v1.CancelSubject(re.Tenant, re.Name))}
		}
		key = re.Key
	}
	for {
		cur, rev, err := w.claims.get(ctx, key)
		if err != nil {
			return CancelReply{Key: key, Message: err.Error()}
		}
		if cur == nil {
			return CancelReply{Key: key, Message: "no build is known for key " + key}
		}
		if cur.Final() {
			return CancelReply{Key: key, Message: "the build already finished: " + cur.State}
		}
		if cur.Tenant != "" && cur.Tenant != tenant {
			return CancelReply{Key: key, Message: fmt.Sprintf("the build of key %s belongs to tenant %q: send the cancel on %s", key, cur.Tenant, v1.CancelSubject(cur.Tenant, cur.Name))}
		}
		final := *cur
		final.State, final.Reason, final.Message = StateFailed, v1.ReasonCanceled, "canceled on request"
		final.Owner, final.LeaseUntil, final.FinishedAt = "", time.Time{}, w.cfg.Now().UTC()
		_, ok, err := w.claims.update(ctx, &final, rev)
		if err != nil {
			return CancelReply{Key: key, Message: err.Error()}
		}
		if !ok {
			continue
		}
		// The owner notices the lost claim at its next renewal; stop the
		// build now so nothing is pushed after the cancel.
		if err := w.backend.Cleanup(ctx, key, ""); err != nil && !errors.Is(err, context.Canceled) {
			w.log.Warn("cancel: stopping the build failed", zap.String("key", key), zap.Error(err))
		}
		w.log.Info("build canceled", zap.String("key", key))
		return CancelReply{Key: key, Canceled: true, Message: "canceled"}
	}
}
