package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// GitSources turns a request's git source into an S3 context of its
// tenant's, the same content-addressed archive an upload makes: the
// worker resolves the ref, fetches exactly that commit and packs the
// subPath tree (its .dockerignore applied), so the build Pod never sees
// git or a credential and the build key is the content's.
type GitSources interface {
	// Pack resolves src for tenant's request, packs it and stores the
	// archive in the tenant's context area. dockerfile is the request's
	// Dockerfile path (kept even when .dockerignore excludes it).
	// progress reports each step ("resolving", "fetching", "packing")
	// in words. A failure that is the request's own (an unknown ref, a
	// refused credential, a host it may not reach, a limit) is a
	// *SourceError; any other error is retried as transient trouble.
	Pack(ctx context.Context, tenant string, src v1.GitSource, dockerfile string, progress func(message string)) (*v1.ResolvedSource, error)
}

// SourceError is a git source that cannot be built, for a reason of the
// request's own (v1.ReasonGit*): it fails at once and is never retried.
type SourceError struct {
	Reason  string
	Message string
}

func (e *SourceError) Error() string { return e.Message }

// errNoGitSources: this worker was not given GitSources.
var errNoGitSources = errors.New("git sources are not enabled on this worker (it has no --allowed-git-host)")

// prepareSource makes req's git source an S3 one: the context recorded
// in its ledger entry by an earlier delivery, or one packed now and
// recorded. It returns the source for the request's result, or a failed
// verdict's reason and message for a source that cannot be built; an
// error is ledger.ErrCanceled (the tenant canceled it before it was
// recorded), transient trouble, or the handler's context ending.
func (w *Worker) prepareSource(ctx context.Context, req *v1.Request, le *ledger.Entry) (info *v1.SourceInfo, failReason, failMessage string, err error) {
	g := req.Source.Git
	rs := le.E.Source
	if mutant.On("repack-on-redelivery") {
		rs = nil
	}
	if rs == nil {
		if w.cfg.GitSources == nil {
			return nil, v1.ReasonInvalidRequest, errNoGitSources.Error(), nil
		}
		progress := func(message string) {
			w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Phase: v1.PhaseSource, Message: message})
		}
		packed, err := w.cfg.GitSources.Pack(ctx, req.Tenant, *g, req.Dockerfile, progress)
		if se := (*SourceError)(nil); errors.As(err, &se) {
			return nil, se.Reason, se.Message, nil
		}
		if err != nil {
			return nil, "", "", Transient(fmt.Errorf("git source: %w", err))
		}
		resolved := *req
		resolved.Source, resolved.ContextDigest = v1.Source{S3: &packed.S3}, packed.ContextDigest
		rs, err = w.ledger.SetSource(ctx, le, packed, w.builds.keyOf(&resolved))
		if errors.Is(err, ledger.ErrCanceled) {
			return nil, "", "", err // canceled while packing: nothing is built
		}
		if err != nil {
			return nil, "", "", Transient(err)
		}
		w.log.Info("git source packed", zap.String("requestId", req.RequestID), zap.String("commit", rs.Commit),
			zap.String("contextDigest", rs.ContextDigest), zap.String("object", rs.S3.Key))
	}
	resolveTo(req, rs)
	info = &rs.SourceInfo
	w.sourceInfo.set(req.Tenant, req.RequestID, info)
	return info, "", "", nil
}

// resolveTo makes req build the packed context rs of its git source.
func resolveTo(req *v1.Request, rs *v1.ResolvedSource) {
	s3 := rs.S3
	req.Source, req.ContextDigest = v1.Source{S3: &s3}, rs.ContextDigest
}

// sourceInfos are the resolved sources of the requests being handled,
// for their progress events.
type sourceInfos struct {
	mu sync.Mutex
	m  map[string]*v1.SourceInfo
}

func (s *sourceInfos) set(tenant, id string, info *v1.SourceInfo) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]*v1.SourceInfo{}
	}
	s.m[ledger.Key(tenant, id)] = info
}

func (s *sourceInfos) drop(tenant, id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, ledger.Key(tenant, id))
}

func (s *sourceInfos) get(tenant, id string) *v1.SourceInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[ledger.Key(tenant, id)]
}
