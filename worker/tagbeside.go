package worker

// The worker's own check of a build's first tag, beside the build's start
// rather than before its claim, where the build Pod checks the tag too
// (docs/design.md, "The dedupe index"; P1 in docs/benchmarks.md).

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// checksTagBeside reports whether req's build may be claimed and started
// without waiting for its preflight HEAD, sent once the build's Job is
// created (own.go; P1 in docs/benchmarks.md: the HEAD leaves the path
// from the publish to the Job). Only where the build's Pod checks the tag itself before it builds
// (TagChecker): a worker killed before the HEAD's answer leaves a Job
// that refuses to push over an image found there, and its run answers
// nobody (v1.ReasonTagTaken), as one whose tag was taken after the HEAD.
// Not for an image index or its platforms (their Pods check no tag), nor
// where the preflight must create a Harbor project before the build can
// push.
func (w *builder) checksTagBeside(ctx context.Context, req *v1.Request, repo string) bool {
	if isPlatformPart(ctx) || multiPlatform(req) {
		return false
	}
	if _, harbor := w.cfg.Naming.HarborProject(req.Tenant, repo); harbor && w.registry != nil {
		return false
	}
	tc, ok := w.backend.(TagChecker)
	return (ok && tc.ChecksFirstTag(req)) || mutant.On("tag-check-beside-any-backend")
}

// errTagFoundBeside stops a build whose first tag the preflight sent
// once its Job was created found holding an image (own's tagCheck).
var errTagFoundBeside = errors.New("the build's first tag holds an image already")

// endFoundBeside ends held's run, whose build was stopped because the
// preflight sent once its Job was created found an image at its first tag: the
// run ends refused (v1.ReasonTagTaken, as the build Pod's own check ends
// it), so it answers nobody and every request waiting on it looks again;
// its Job goes; and the image found answers req, origin cache, exactly as
// a preflight made before the claim would have. A run ended from outside
// first (a cancel, the reconciler) answers as own's end would, save one
// ended as refused by its own Pod, which found the tag taken too: the
// image found answers then as well; a run
// another worker took over, or a newer run, is not touched: the request
// follows the record.
func (w *builder) endFoundBeside(ctx context.Context, req *v1.Request, held *v1.BuildRecord, rev uint64, found *v1.BuildRecord, lw *buildlog.Writer, origin v1.Origin, repo string, dests []string, seq uint64) (*v1.BuildRecord, v1.Origin, bool, error) {
	tag := firstOf(held.Destinations)
	w.log.Info("the build's first tag held an image when the worker checked it beside the build's start; stopped the build, nothing is built",
		zap.String("key", held.Key), zap.String("run", held.Run), zap.String("tag", tag), zap.String("digest", found.Digest))
	final := finalRecord(held, Outcome{Job: held.Job, JobUID: held.JobUID, Reason: v1.ReasonTagTaken,
		Message: fmt.Sprintf("tag taken: %s holds %s already; the build would push over it", tag, found.Digest)}, w.cfg.Now())
	if lw != nil && !lw.Ended() {
		_ = lw.Own(ctx, "the first tag "+tag+" holds an image already ("+found.Digest+"): nothing is built, and the requests of this build look again")
	}
	final.Logs = w.logs.finish(ctx, lw, final)
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	// One compare-and-swap at the revision this handler last wrote: the
	// refusal is this worker's verdict, not the Job's outcome, so it ends
	// the run only as this handler held it — never a run another worker
	// took over meanwhile (its Job is that worker's now), nor one a cancel
	// or the reconciler ended.
	for tries := 0; ; tries++ {
		ok, err := w.runs.EndAt(fctx, final, rev)
		if err != nil {
			w.releaseClaim(ctx, held, rev, v1.ReasonInfrastructureError+": storing the end of a run whose tag was found taken failed: "+err.Error())
			return nil, "", false, Transient(err)
		}
		if ok {
			break
		}
		cur, crev, gerr := w.runs.Get(fctx, held.Key)
		switch {
		case gerr != nil:
			w.releaseClaim(ctx, held, rev, v1.ReasonInfrastructureError+": reading a run whose tag was found taken failed: "+gerr.Error())
			return nil, "", false, Transient(gerr)
		case cur != nil && cur.Run == held.Run && cur.Final() && !mutant.On("found-beside-end-overwrites"):
			// Ended from outside first (a cancel, the reconciler): that
			// end stands and answers, as own's would; its Job goes
			// before the slot is given back.
			w.jobGone(fctx, held.Key, held.Run)
			if refusedRun(cur) {
				// As refused by its own Pod, which found the tag taken
				// as this check did: the image found answers now, as
				// had this handler's end been stored first, rather than
				// through a retry that looks again.
				return found, v1.OriginCache, false, nil
			}
			return cur, origin, true, nil
		case cur != nil && cur.Run == held.Run && (!cur.Final() && cur.Owner == w.cfg.ID && cur.Holder == held.Holder || mutant.On("found-beside-end-overwrites")) && tries < 3:
			// Still this worker's, at a revision it wrote without
			// seeing the reply (a renewal's lost ack): end it there.
			rev = crev
			continue
		}
		w.log.Info("the build run changed while its tag was found taken; following the record", zap.String("key", held.Key), zap.String("run", held.Run))
		return w.build(ctx, req, held.Key, repo, dests, seq, nil)
	}
	w.jobGone(fctx, held.Key, held.Run)
	return found, v1.OriginCache, false, nil
}
