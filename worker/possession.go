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

	"go.uber.org/zap"
	"golang.org/x/sync/singleflight"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker/internal/mutant"
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
// held and the digest of each object version read, and lets concurrent
// checks of one request's object share a single read.
type possessions struct {
	mu sync.Mutex
	// known: possession keys shown held.
	known map[string]bool
	// digests: "bucket/key@version" → the digest of that version's bytes,
	// "" when they are no context archive at all. A refusal is remembered
	// as well as a proof, so naming one object again costs a HEAD, not a
	// read of the whole object (a small gzip can inflate to the context
	// limit).
	digests map[string]string
	reads   singleflight.Group
}

// maxKnownPossessions bounds each of the worker's memories; past it that
// memory starts over (the ledger still holds every proof).
const maxKnownPossessions = 1 << 16

// possessionReadTimeout bounds a shared read of a context object: it runs
// apart from any one request's context, so a request canceled or handed
// back does not fail the others waiting on the same read.
const possessionReadTimeout = 10 * time.Minute

// ContextVersions is implemented by a ContextSource that can tell an
// object's version without reading it (s3store.Store.Version): equal
// versions hold equal bytes.
type ContextVersions interface {
	Version(ctx context.Context, bucket, key string) (string, error)
}

// foreignRun reports whether rec is a run another tenant's request claimed
// and that would answer req: succeeded (a cache hit) or building (a join,
// a park, a take-over).
func foreignRun(rec *v1.BuildRecord, req *v1.Request) bool {
	return rec != nil && rec.Tenant != req.Tenant && (rec.State == v1.StateSucceeded || rec.State == v1.StateBuilding)
}

// possessionPanic carries a panic of a shared read to each of its callers,
// whose handlers turn it into one failed result (safeProcess).
type possessionPanic struct{ v any }

func (p possessionPanic) Error() string { return fmt.Sprintf("panic in a context check: %v", p.v) }

// checkPossession returns nil when req's tenant holds the content of
// req.ContextDigest (shown before, or now by reading its own context
// object), a *notHeldError when it does not, and a transient error when
// that cannot be told now. Without Config.Contexts (a worker of one
// trusted tenant, --single-tenant without S3 keys) nothing is checked.
func (w *builder) checkPossession(ctx context.Context, req *v1.Request) error {
	if w.cfg.Contexts == nil || mutant.On("skip-possession") {
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
	held := p.known[pk]
	p.mu.Unlock()
	if held {
		return nil
	}
	// One read per request's object and claim at a time: requests naming
	// the same object for the same digest share it.
	ch := p.reads.DoChan(pk+"\n"+s3.Bucket+"/"+s3.Key, func() (_ any, err error) {
		defer func() {
			if v := recover(); v != nil {
				err = possessionPanic{v}
			}
		}()
		// Apart from the asking request's context (its cancel or hand-back
		// must not fail the others), but not from the worker's: a stopping
		// worker leaves no read behind.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), possessionReadTimeout)
		defer cancel()
		if life := w.life.Load(); life != nil {
			defer context.AfterFunc(*life, cancel)()
		}
		if err := w.provePossession(rctx, req, pk); err != nil {
			return nil, err
		}
		p.mu.Lock()
		if p.known == nil || len(p.known) >= maxKnownPossessions {
			p.known = map[string]bool{}
		}
		p.known[pk] = true
		p.mu.Unlock()
		return nil, nil
	})
	select {
	case r := <-ch:
		if pp, ok := errors.AsType[possessionPanic](r.Err); ok {
			panic(pp.v)
		}
		return r.Err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// has reports whether pk (possessionKey) was shown held on this worker.
func (p *possessions) has(pk string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.known[pk]
}

// objectDigest returns the digest of the bytes of bucket/key: remembered
// for the object's version when the source tells versions, read and hashed
// otherwise. "" with a nil error: the object is no context archive.
func (w *builder) objectDigest(ctx context.Context, bucket, key string) (string, error) {
	p := &w.possessed
	version := ""
	if vs, ok := w.cfg.Contexts.(ContextVersions); ok {
		v, err := vs.Version(ctx, bucket, key)
		if err != nil {
			return "", err
		}
		version = bucket + "/" + key + "@" + v
		p.mu.Lock()
		d, seen := p.digests[version]
		p.mu.Unlock()
		if seen {
			return d, nil
		}
	}
	body, err := w.cfg.Contexts.Open(ctx, bucket, key)
	if err != nil {
		return "", err
	}
	defer body.Close()
	d, err := contexttar.ArchiveDigest(ctx, body, w.cfg.MaxContextBytes)
	if errors.Is(err, contexttar.ErrDigestMismatch) {
		d, err = "", nil
	}
	if err != nil {
		return "", err
	}
	if version != "" {
		// The version read before the bytes: were the object replaced in
		// between, the digest is of bytes its tenant held all the same.
		p.mu.Lock()
		if p.digests == nil || len(p.digests) >= maxKnownPossessions {
			p.digests = map[string]string{}
		}
		p.digests[version] = d
		p.mu.Unlock()
	}
	return d, nil
}

// provePossession looks the proof up in the ledger bucket, and without one
// reads the tenant's context object and records the proof.
func (w *builder) provePossession(ctx context.Context, req *v1.Request, pk string) error {
	if ok, err := w.ledger.HasProof(ctx, pk); err != nil {
		return Transient(fmt.Errorf("read the possession proof: %w", err))
	} else if ok {
		return nil
	}
	s3 := req.Source.S3
	object := s3.Bucket + "/" + s3.Key
	digest, err := w.objectDigest(ctx, s3.Bucket, s3.Key)
	if errors.Is(err, s3store.ErrNotFound) {
		return &notHeldError{v1.ReasonContextMissing, fmt.Sprintf("the context object %s does not exist", object)}
	}
	if err != nil {
		return Transient(fmt.Errorf("read the context object %s: %w", object, err))
	}
	if digest != req.ContextDigest {
		w.log.Warn("a request named a context digest its tenant's object does not hold; refused",
			zap.String("tenant", req.Tenant), zap.String("requestId", req.RequestID), zap.String("object", object))
		return &notHeldError{v1.ReasonContextMismatch, fmt.Sprintf(
			"the context object %s does not hold the bytes of %s (the contextDigest): it was replaced, or the request names a digest of other content", object, req.ContextDigest)}
	}
	b, _ := json.Marshal(possessionProof{Tenant: req.Tenant, Digest: req.ContextDigest, Object: object,
		Worker: w.cfg.ID, VerifiedAt: w.cfg.Now().UTC()})
	// Another worker may have recorded the same proof meanwhile.
	if err := w.ledger.RecordProof(ctx, pk, b); err != nil {
		w.log.Debug("recording a possession proof failed; it is read again next time", zap.Error(err))
	}
	w.log.Info("tenant shown to hold a context",
		zap.String("tenant", req.Tenant), zap.String("digest", req.ContextDigest), zap.String("object", object))
	return nil
}

// KeyIdentity is the executor identity a request's build key is made
// with (v1.BuildKey): the backend's, and the request's tenant too when
// the image a build makes depends on its tenant, so that no other
// tenant's request shares the key: with perTenantCache a run reads
// kaniko's layer cache from its claimer's tenant's own cache repository,
// which that tenant can push into; a RUN step's layer may come from
// there instead of the step, so the image is that tenant's (an
// adversarial review had one tenant's planted layer answer another's
// request through the index).
//
// A git source is keyed only once packed into its tenant's own S3
// context (source.go), like an upload: the possession that object shows
// is what lets another tenant's request share the build.
//
// buildq render computes keys with it too.
func KeyIdentity(executor string, req *v1.Request, perTenantCache bool) string {
	if perTenantCache {
		return executor + "+tenant=" + req.Tenant
	}
	return executor
}

// keyOf is req's build key on this worker.
func (w *builder) keyOf(req *v1.Request) string {
	pt, _ := w.backend.(interface{ PerTenantCache() bool })
	return v1.BuildKey(req, KeyIdentity(w.backend.Identity(), req, pt != nil && pt.PerTenantCache()))
}
