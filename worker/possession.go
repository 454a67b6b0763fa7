package worker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/s3store"
)

// Possession, not knowledge. A request whose build key another tenant's
// request claimed would be answered from that tenant's build: a cache hit,
// a join of the run in flight, a take-over of it. The key is made of the
// build's inputs, the context digest among them, and a digest travels (in
// results, logs, provenance): knowing one is not holding the content. So
// before a request is handled at all, the worker reads its tenant's own
// context object (the one the request names, under its tenant's prefix)
// and checks that it hashes to the request's contextDigest — whether or
// not anyone built the key: were it checked only when another tenant's
// build exists, the refusal itself would tell that such a build exists
// (found by an adversarial review). The proof is recorded in the ledger
// bucket (possessionKey: one entry per tenant and digest, kept for the
// ledger's TTL) and remembered by the worker, so the object is read once
// per tenant and digest, not at every request. A tenant whose object is
// missing gets ContextMissing, one whose object holds other bytes
// ContextMismatch, before any claim, Job, event of a build or copy.
//
// A git source has no object the worker reads: its key is its tenant's
// own (KeyIdentity), so it is never answered from another tenant's build.
// A failed run of another tenant's request answers no one
// (sharedFailure): it built with its claimer's credentials.

// notHeldError refuses a request its tenant cannot show the content of.
type notHeldError struct {
	reason, message string
}

func (e *notHeldError) Error() string { return e.reason + ": " + e.message }

// possessionKey is the ledger bucket key of tenant's proof of holding
// digest.
func possessionKey(tenant, digest string) string {
	sum := sha256.Sum256([]byte(tenant + "\n" + digest))
	return "p." + hex.EncodeToString(sum[:20])
}

// possessionProof is the value of a possessionKey entry.
type possessionProof struct {
	Tenant string `json:"tenant"`
	Digest string `json:"digest"`
	// Object is the context object whose bytes were read.
	Object     string    `json:"object"`
	Worker     string    `json:"worker"`
	VerifiedAt time.Time `json:"verifiedAt"`
}

// possessions remembers, per worker, the tenants and digests already shown
// held, and lets concurrent checks of one share a single read.
type possessions struct {
	mu       sync.Mutex
	known    map[string]bool
	inFlight map[string]*possessionCall
}

type possessionCall struct {
	done chan struct{}
	err  error
}

// maxKnownPossessions bounds the worker's memory of proofs; past it the
// memory starts over (the ledger still holds every proof).
const maxKnownPossessions = 1 << 16

// foreignRun reports whether rec is a run another tenant's request claimed
// and that would answer req: succeeded (a cache hit) or building (a join,
// a park, a take-over).
func foreignRun(rec *Record, req *v1.Request) bool {
	return rec != nil && rec.Tenant != req.Tenant && (rec.State == StateSucceeded || rec.State == StateBuilding)
}

// checkPossession returns nil when req's tenant holds the content of
// req.ContextDigest (shown before, or now by reading its own context
// object), a *notHeldError when it does not, and a transient error when
// that cannot be told now. Without Config.Contexts (a worker of one
// trusted tenant, --single-tenant without S3 keys) nothing is checked.
func (w *Worker) checkPossession(ctx context.Context, req *v1.Request) error {
	if w.cfg.Contexts == nil {
		return nil
	}
	s3 := req.Source.S3
	if s3 == nil || req.ContextDigest == "" {
		return &notHeldError{v1.ReasonContextMismatch,
			"this build key was built from another tenant's request; only an S3 context whose bytes the worker can read shows that a tenant holds the content"}
	}
	pk := possessionKey(req.Tenant, req.ContextDigest)
	p := &w.possessed
	p.mu.Lock()
	if p.known[pk] {
		p.mu.Unlock()
		return nil
	}
	if c, ok := p.inFlight[pk]; ok {
		p.mu.Unlock()
		select {
		case <-c.done:
			return c.err
		case <-ctx.Done():
			return Transient(ctx.Err())
		}
	}
	c := &possessionCall{done: make(chan struct{})}
	if p.inFlight == nil {
		p.inFlight, p.known = map[string]*possessionCall{}, map[string]bool{}
	}
	p.inFlight[pk] = c
	p.mu.Unlock()

	c.err = w.provePossession(ctx, req, pk)
	p.mu.Lock()
	delete(p.inFlight, pk)
	if c.err == nil {
		if len(p.known) >= maxKnownPossessions {
			p.known = map[string]bool{}
		}
		p.known[pk] = true
	}
	p.mu.Unlock()
	close(c.done)
	return c.err
}

// provePossession looks the proof up in the ledger bucket, and without one
// reads the tenant's context object and records the proof.
func (w *Worker) provePossession(ctx context.Context, req *v1.Request, pk string) error {
	if w.requests != nil {
		if _, err := w.requests.Get(ctx, pk); err == nil {
			return nil
		} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
			return Transient(fmt.Errorf("read the possession proof: %w", err))
		}
	}
	s3 := req.Source.S3
	object := s3.Bucket + "/" + s3.Key
	body, err := w.cfg.Contexts.Open(ctx, s3.Bucket, s3.Key)
	if errors.Is(err, s3store.ErrNotFound) {
		return &notHeldError{v1.ReasonContextMissing, fmt.Sprintf("the context object %s does not exist", object)}
	}
	if err != nil {
		return Transient(fmt.Errorf("read the context object %s: %w", object, err))
	}
	defer body.Close()
	err = contexttar.VerifyArchive(ctx, body, w.cfg.MaxContextBytes, req.ContextDigest)
	if errors.Is(err, contexttar.ErrDigestMismatch) {
		w.log.Warn("a request named a context digest its tenant's object does not hold; refused",
			zap.String("tenant", req.Tenant), zap.String("requestId", req.RequestID), zap.String("object", object))
		return &notHeldError{v1.ReasonContextMismatch, fmt.Sprintf(
			"the context object %s does not hold the bytes of %s (the contextDigest): it was replaced, or the request names a digest of other content", object, req.ContextDigest)}
	}
	if err != nil {
		return Transient(fmt.Errorf("read the context object %s: %w", object, err))
	}
	if w.requests != nil {
		b, _ := json.Marshal(possessionProof{Tenant: req.Tenant, Digest: req.ContextDigest, Object: object,
			Worker: w.cfg.ID, VerifiedAt: w.cfg.Now().UTC()})
		// Another worker may have recorded the same proof meanwhile.
		if _, err := w.requests.Create(ctx, pk, b); err != nil && !errors.Is(err, jetstream.ErrKeyExists) {
			w.log.Debug("recording a possession proof failed; it is read again next time", zap.Error(err))
		}
	}
	w.log.Info("tenant shown to hold a context another tenant's build was made of",
		zap.String("tenant", req.Tenant), zap.String("digest", req.ContextDigest), zap.String("object", object))
	return nil
}

// KeyIdentity is the executor identity a request's build key is made
// with (v1.BuildKey): the backend's, and the request's tenant too when the
// image a build makes, or the right to be answered from it, depends on its
// tenant, so that no other tenant's request shares the key:
//   - perTenantCache: a run reads kaniko's layer cache from its claimer's
//     tenant's own cache repository, which that tenant can push into; a
//     RUN step's layer may come from there instead of the step, so the
//     image is that tenant's (an adversarial review had one tenant's
//     planted layer answer another's request through the index);
//   - checked (possession is checked, Config.Contexts) and a git source:
//     no object the worker reads shows that another tenant holds it.
//
// buildq render computes keys with it too.
func KeyIdentity(executor string, req *v1.Request, perTenantCache, checked bool) string {
	if perTenantCache || (checked && req.Source.Git != nil) {
		return executor + "+tenant=" + req.Tenant
	}
	return executor
}

// keyOf is req's build key on this worker.
func (w *Worker) keyOf(req *v1.Request) string {
	pt, _ := w.backend.(interface{ PerTenantCache() bool })
	return v1.BuildKey(req, KeyIdentity(w.backend.Identity(), req, pt != nil && pt.PerTenantCache(), w.cfg.Contexts != nil))
}
