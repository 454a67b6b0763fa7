package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// processRequest decides a request's result, with the request's ledger
// entry (nil for input too broken to have one). An error means no result
// yet: the caller retries (transient), hands back (shutdown) or fails the
// request.
func (w *Worker) processRequest(ctx context.Context, h *handling) (verdict, *ledger.Entry, error) {
	if v, le, ok := w.answerQueuedHit(ctx, h); ok {
		return v, le, nil
	}
	msg, meta := h.in.Msg, h.meta
	started := w.cfg.Now().UTC()
	seq, at := meta.Sequence.Stream, meta.Timestamp
	timings := v1.Timings{QueuedAt: at.UTC(), StartedAt: started, QueueWaitMs: started.Sub(at).Milliseconds()}
	req, err := w.decode(msg)
	if err != nil {
		return w.invalidEntry(ctx, msg, req, err, timings, meta)
	}
	// A claim intake sent for this message and the walk did not take
	// (the request answered, canceled or refused first) is withdrawn
	// (intakeclaim.go).
	defer w.builds.dropClaim(req, seq)
	v := verdict{Decision: ledger.Decision{Tenant: req.Tenant, Name: req.Name, Data: v1.ResultData{
		RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Attempts: int(meta.NumDelivered), Timings: timings,
	}}}
	// A git source's key is its packed content's, known once it is
	// packed (prepareSource, below).
	var key string
	if req.Source.Git == nil {
		key = w.builds.keyOf(req)
	}
	v.Data.Key = key
	h.known = v
	// While the entry's create and the key's claim intake sent are in
	// flight, the claim's Job is made ready (intakeclaim.go).
	w.builds.prepareClaimed(ctx, req, seq)
	le, fresh, openSent, openDone, err := w.openEntry(ctx, req, key, seq, at, h.cancel)
	defer openDone()
	if errors.Is(err, ledger.ErrDuplicateID) {
		// A parked request published again carries the token its
		// ledger entry holds: it is that request, not a duplicate. A
		// failed read (KV trouble, or the worker stopping) decides
		// nothing: the message is retried or handed back, never
		// terminated as a duplicate (its waiter entry is gone).
		rq, rerr := w.ledger.ByRequeueToken(ctx, req.Tenant, req.RequestID, msg.Headers().Get(ledger.RequeueTokenHeader))
		if rerr != nil {
			return v, nil, Transient(rerr)
		}
		if rq != nil {
			le, fresh, err = rq, false, nil
			seq, at = rq.E.Seq, rq.E.MsgTime
			v.Data.Timings = v1.Timings{QueuedAt: at.UTC(), StartedAt: started, QueueWaitMs: started.Sub(at).Milliseconds()}
		}
	}
	if err == nil && le.E.Source != nil {
		v.Data.Source = &le.E.Source.SourceInfo
	}
	switch {
	case errors.Is(err, ledger.ErrDuplicateID):
		v.duplicate = true
		return v, nil, nil
	case err != nil:
		return v, nil, Transient(err)
	case le.E.Result != nil && !mutant.On("ignore-recorded-decision"):
		return verdictOf(le.E), le, nil // decided before: publish that again
	case le.E.Canceled:
		return v.canceled(), le, nil // canceled while it was not held
	}
	if r := h.in.Refused; r != nil {
		v.Data.Status, v.Data.Reason, v.Data.Message = v1.StatusFailed, r.Reason, r.Message
		return v, le, nil
	}
	h.knownLE = le
	defer w.api.Hold(ledger.Key(req.Tenant, req.RequestID), h.cancel)()
	// An image index builds its platforms side by side on more of the
	// tenant's slots, when it has them free (platforms.go).
	ctx = withExtraSlots(ctx, h.in.Extra.Take)
	if fresh { // only its first handler: a redelivery is never expired
		if message, ok := w.expired(ctx, meta, le); ok {
			return expiredVerdict(v, message), le, nil
		}
	}
	taken := fmt.Sprintf("taken by %s after %s in the queue", w.cfg.ID, time.Duration(timings.QueueWaitMs)*time.Millisecond)
	switch {
	case le.E.TransientFailures > 0:
		taken += fmt.Sprintf(" (retry after transient failure %d of at most %d)", le.E.TransientFailures, w.cfg.MaxDeliver)
	case meta.NumDelivered > 1:
		taken += fmt.Sprintf(" (delivery %d)", meta.NumDelivered)
	}
	w.event(req.Tenant, req.Name, v1.Event{RequestID: req.RequestID, Key: key, Phase: v1.PhaseQueued, Message: taken})
	if req.Source.Git != nil {
		defer w.sourceInfo.drop(req.Tenant, req.RequestID)
		info, reason, message, err := w.prepareSource(ctx, req, le)
		if errors.Is(err, ledger.ErrCanceled) {
			return v.canceled(), le, nil
		}
		if err != nil {
			return v, le, err
		}
		if reason != "" {
			v.Data.Status, v.Data.Reason, v.Data.Message = v1.StatusFailed, reason, message
			v.Term = true
			return v, le, nil
		}
		key = w.builds.keyOf(req) // req builds the packed context now
		v.Data.Key, v.Data.Source = key, info
		h.known = v
	}
	repo, err := w.cfg.Naming.Repository(req)
	if err == nil {
		// Every destination is in one repository: the tenant must be
		// allowed to push there. Checked before anything is created
		// (no claim, no Job, no copy, no Harbor project).
		err = w.cfg.Naming.CheckDestination(req.Tenant, repo)
	}
	if err == nil && w.cfg.RegistryFor != nil {
		_, err = w.cfg.RegistryFor(req.Tenant)
	}
	if err != nil {
		v.Data.Status, v.Data.Reason, v.Data.Message = v1.StatusFailed, v1.ReasonInvalidRequest, err.Error()
		v.Term = true
		return v, le, nil
	}
	if req.SBOM && w.cfg.SBOM == nil {
		// Refused before anything is built: nothing would answer it.
		return sbomRefused(v), le, nil
	}
	dests := naming.Destinations(repo, key, req.Tags)

	var created time.Time
	if fresh {
		created = openSent
	}
	wr := &waiterReg{le: le, created: created, park: &ledger.Waiter{Tenant: req.Tenant, RequestID: req.RequestID, Subject: msg.Subject(),
		MsgID: msg.Headers().Get(v1.MsgIDHeader), Seq: seq, MsgTime: at.UTC(), Body: msg.Data()}}
	ea := &endAhead{req: req}
	rec, origin, owned, err := w.builds.build(withEndAhead(ctx, ea), req, key, repo, dests, seq, wr)
	v.waiter = wr.added
	v.end = ea
	if errors.Is(err, errParked) {
		v.parked, v.waiter = true, false
		return v, le, nil
	}
	if errors.Is(err, errAnswered) {
		if cur, gerr := w.ledger.Get(ctx, req.Tenant, req.RequestID); gerr == nil && cur != nil && cur.E.Result != nil {
			return verdictOf(cur.E), cur, nil // publish that answer again, and ack
		}
		err = Transient(err) // the ledger could not be read back: try again
	}
	if nh := (*notHeldError)(nil); errors.As(err, &nh) {
		// Its tenant does not hold the content another tenant's build
		// was made of: refused, nothing of that build given.
		v.Data.Status, v.Data.Reason, v.Data.Message = v1.StatusFailed, nh.reason, nh.message
		v.Term = true
		return v, le, nil
	}
	if err != nil {
		return v, le, err
	}
	v, err = w.resultVerdict(ctx, v, req, rec, origin, owned, repo, dests)
	return v, le, err
}

// resultVerdict completes v with the final record rec that answers req.
func (w *Worker) resultVerdict(ctx context.Context, v verdict, req *v1.Request, rec *v1.BuildRecord, origin v1.Origin, owned bool, repo string, dests []string) (verdict, error) {
	if refusedRun(rec) {
		// A run its build Pod refused answers nobody (the walk looks
		// again past it): reaching here is a path that did not, and the
		// request is tried again rather than answered with that end.
		return v, Transient(fmt.Errorf("the run %s of %s was refused by its build Pod (%s): nothing was built; looking again", rec.Run, rec.Key, v1.ReasonTagTaken))
	}
	v.Data.Origin = origin
	v.Data.Job = rec.Job
	if owned {
		v.CleanupKey, v.CleanupRun = rec.Key, rec.Run
	}
	if origin != v1.OriginCache {
		v.Data.Timings.BuildMs = max(rec.FinishedAt.Sub(rec.StartedAt).Milliseconds(), 0)
	}
	v.Data.Logs = rec.Logs
	v.Data.Platforms = rec.Platforms
	if rec.State == v1.StateSucceeded {
		if err := w.ensureTags(ctx, req.Tenant, rec, dests); err != nil {
			return v, err
		}
		v.Data.Status = v1.StatusSucceeded
		v.Data.Image = dests[0]
		v.Data.Digest = rec.Digest
		v.Data.ImageRef = repo + "@" + rec.Digest
		att, err := w.answerAttestation(ctx, req, rec, repo)
		if err != nil {
			return v, err
		}
		v.Data.Attestation = att
		return w.answerSBOM(ctx, v, req, rec, repo)
	}
	v.Data.Status = v1.StatusFailed
	if rec.Reason == v1.ReasonCanceled {
		v.Data.Status = v1.StatusCanceled
	}
	v.Data.Reason, v.Data.Message, v.Data.LogTail = rec.Reason, rec.Message, rec.LogTail
	return v, nil
}

// decode reads and validates a request message. The body's tenant must be
// the subject's, and its requestId the Nats-Msg-Id header's: the subject is
// what NATS permissions guard, and the header is what JetStream dedupes
// on, so a body may not speak for another tenant or another id.
func (w *Worker) decode(msg jetstream.Msg) (*v1.Request, error) {
	if len(bytes.TrimSpace(msg.Data())) == 0 {
		return nil, &v1.DecodeError{Err: errors.New("the request body is empty")}
	}
	req, err := v1.DecodeRequest(msg.Data())
	if err != nil {
		return req, err
	}
	var fields []v1.FieldError
	if msg.Subject() != v1.RequestSubject(req.Tenant) {
		fields = append(fields, v1.FieldError{Field: "tenant", Detail: fmt.Sprintf(
			"%q does not match the subject %s; a request of tenant %q goes on %s",
			req.Tenant, msg.Subject(), req.Tenant, v1.RequestSubject(req.Tenant))})
	}
	if h := msg.Headers().Get(v1.MsgIDHeader); !v1.MsgIDMatches(h, req.Tenant, req.RequestID) {
		if len(h) > 2*v1.MaxRequestIDLen {
			h = h[:2*v1.MaxRequestIDLen] + "…"
		}
		detail := fmt.Sprintf("the %s header is %q but the body says tenant %q, requestId %q; the header must be %q (JetStream dedupes on it)",
			v1.MsgIDHeader, h, req.Tenant, req.RequestID, v1.MsgID(req.Tenant, req.RequestID))
		if h == "" {
			detail = fmt.Sprintf("the %s header is missing; set it to %q", v1.MsgIDHeader, v1.MsgID(req.Tenant, req.RequestID))
		}
		fields = append(fields, v1.FieldError{Field: "requestId", Detail: detail})
	}
	if s3 := req.Source.S3; s3 != nil && w.cfg.ContextPrefix != "" {
		// A request names only its own tenant's contexts: another
		// tenant's object is neither built nor probed.
		if prefix := strings.ReplaceAll(w.cfg.ContextPrefix, "{tenant}", req.Tenant); !strings.HasPrefix(s3.Key, prefix) || strings.Contains(s3.Key, "..") {
			fields = append(fields, v1.FieldError{Field: "source.s3.key", Detail: fmt.Sprintf(
				"a context of tenant %q must be under %s (the CLI and SDK upload there)", req.Tenant, prefix)})
		}
	}
	if s3 := req.Source.S3; s3 != nil && w.cfg.ContextBucket != "" && s3.Bucket != w.cfg.ContextBucket {
		fields = append(fields, v1.FieldError{Field: "source.s3.bucket", Detail: fmt.Sprintf(
			"contexts must be in bucket %q, not %q", w.cfg.ContextBucket, s3.Bucket)})
	}
	if len(fields) > 0 {
		return req, &v1.ValidationError{Fields: fields}
	}
	return req, nil
}

// invalidEntry is the verdict of a request that cannot be decoded or
// validated, with the ledger entry of its id when it has a usable one.
func (w *Worker) invalidEntry(ctx context.Context, msg jetstream.Msg, req *v1.Request, err error, timings v1.Timings, meta *jetstream.MsgMetadata) (verdict, *ledger.Entry, error) {
	v := w.invalid(msg, req, err, timings, meta)
	if !w.ledger.Ready() || !ownsEntry(v) {
		// No entry for an id no request can take (usableID).
		return v, nil, nil
	}
	if msg.Headers().Get(v1.MsgIDHeader) == "" {
		// No header: the refusal goes out under the body's id, so the
		// producer waiting on it gets it. That id gets an entry with the
		// refusal in it, written before the publish, as every result
		// of an id has one: a later message of the id is its duplicate
		// (one result per id, also past the duplicate window), the status
		// service answers with the refusal, and an entry created decided
		// elsewhere (a cache hit's) can trust that nothing was stored
		// before it. An id the ledger already holds belongs to another
		// message, which gets the id's one result; this one gets none.
		le, d, ok, err := w.ledger.CreateDecided(ctx, "", meta.Sequence.Stream, meta.Timestamp, v.Decision)
		if err != nil {
			return v, nil, Transient(err)
		}
		if ok {
			v.Decision = d
			return v, le, nil
		}
		switch le, err := w.ledger.Get(ctx, v.Tenant, v.Data.RequestID); {
		case err != nil:
			return v, nil, Transient(err)
		case le == nil:
			return v, nil, Transient(fmt.Errorf("request ledger: the entry of %s went as it was read", v.Data.RequestID))
		case le.E.Seq == meta.Sequence.Stream && le.E.Result != nil:
			// This message's own, from a create whose reply was lost.
			return verdictOf(le.E), le, nil
		}
		v.duplicate = true
		return v, nil, nil
	}
	le, _, lerr := w.ledger.Open(ctx, v.Tenant, v.Name, v.Data.RequestID, "", meta.Sequence.Stream, meta.Timestamp)
	switch {
	case errors.Is(lerr, ledger.ErrDuplicateID):
		v.duplicate = true
		return v, nil, nil
	case lerr != nil:
		return v, nil, Transient(lerr)
	case le.E.Result != nil:
		return verdictOf(le.E), le, nil
	}
	return v, le, nil
}

// ensureTags makes every destination of a request point at the built
// image: a request for a known key but another repository or tag gets the
// image copied or tagged there, not rebuilt.
func (w *Worker) ensureTags(ctx context.Context, tenant string, rec *v1.BuildRecord, dests []string) error {
	reg, err := w.tenantRegistry(tenant)
	if err != nil {
		return err
	}
	for _, d := range dests {
		if slices.Contains(rec.Pushed, d) || d == rec.Image {
			continue
		}
		if reg == nil {
			return fmt.Errorf("cannot tag %s: the worker has no registry client", d)
		}
		src := rec.Repository + "@" + rec.Digest
		if _, err := reg.Copy(ctx, src, d); err != nil {
			return Transient(fmt.Errorf("copy %s to %s: %w", src, d, err))
		}
		if rec.Attestation != "" && w.cfg.Attestor != nil && !strings.HasPrefix(d, rec.Repository+":") && (rec.Tenant == "" || rec.Tenant == tenant) {
			// The copy carries its provenance along (an index's, its
			// platform images' too): a referrer's subject is the same
			// digest in the new repository.
			atts := []string{rec.Attestation}
			for _, p := range slices.Sorted(maps.Keys(rec.Platforms)) {
				if prec := w.platformRecord(ctx, rec, p); prec.Attestation != "" {
					atts = append(atts, prec.Attestation)
				}
			}
			for _, a := range atts {
				att := rec.Repository + "@" + a
				if err := w.cfg.Attestor.Copy(ctx, reg, att, d); err != nil {
					return Transient(fmt.Errorf("copy the attestation %s to %s: %w", att, d, err))
				}
			}
		}
	}
	return nil
}

// invalid builds the failed result of a request that cannot be decoded or
// validated. It is still addressed as well as the input allows: tenant
// from the subject, name "_invalid" when the name itself is bad.
func (w *Worker) invalid(msg jetstream.Msg, req *v1.Request, err error, timings v1.Timings, meta *jetstream.MsgMetadata) verdict {
	name, id := "", ""
	if req != nil {
		name, id = req.Name, req.RequestID
	} else {
		// Not decodable strictly: recover what addressing the input has.
		var loose struct{ RequestID, Name string }
		if json.Unmarshal(msg.Data(), &loose) == nil {
			name, id = loose.Name, loose.RequestID
		}
	}
	// The subject's tenant is the only one: it is the one NATS let the
	// producer publish as, and so the one whose results it reads. A body
	// never picks whose result subject a refusal lands on.
	tenant := "_invalid"
	if parts := strings.Split(msg.Subject(), "."); len(parts) >= 3 && v1.DNSLabelProblem(parts[2]) == "" {
		tenant = parts[2]
	}
	if v1.DNSLabelProblem(name) != "" {
		name = "_invalid"
	}
	// The id is the body's when the header — what JetStream deduped the
	// message on — names it (in any of its forms: the SDK's
	// <tenant>/<id>/<nonce>, <tenant>/<id>, bare), so the producer that
	// waits on its request id gets the refusal. Otherwise it is the id the
	// header names: a broken or forged body must not take (and so block)
	// an id another message of the tenant holds.
	switch h := msg.Headers().Get(v1.MsgIDHeader); {
	case h != "" && usableID(id) && v1.MsgIDMatches(h, tenant, id):
	case h != "" && usableID(v1.RequestIDOfMsgID(h, tenant)):
		id = v1.RequestIDOfMsgID(h, tenant)
	case h == "" && usableID(id):
	default:
		id = fmt.Sprintf("%s%d", v1.GeneratedIDPrefix, meta.Sequence.Stream)
	}
	w.log.Info("invalid request", zap.String("requestId", id), zap.Error(err))
	return verdict{Decision: ledger.Decision{Tenant: tenant, Name: name, Term: true, Data: v1.ResultData{
		RequestID: id, Tenant: tenant, Name: name, Status: v1.StatusFailed, Reason: v1.ReasonInvalidRequest,
		Message: err.Error(), Attempts: int(meta.NumDelivered), Timings: timings,
	}}}
}

// usableID reports whether an id from bad input can still serve as the
// result's message id and CloudEvents id. A generated id's form is not:
// a message that names one gets an id of its own, so no message takes
// (and blocks, or answers) the id another unreadable message was given.
func usableID(id string) bool {
	return id != "" && len(id) <= v1.MaxRequestIDLen && !strings.ContainsAny(id, " \t\r\n\x00") &&
		!strings.HasPrefix(id, v1.GeneratedIDPrefix)
}

// tenantRegistry is the registry client for a tenant's own repositories:
// its own credentials (Config.RegistryFor) or the worker's.
func (w *Worker) tenantRegistry(tenant string) (Registry, error) {
	if w.cfg.RegistryFor == nil {
		return w.registry, nil
	}
	reg, err := w.cfg.RegistryFor(tenant)
	if err != nil {
		// Checked before the request claimed anything; gone since (a
		// Secret removed): try again later.
		return nil, Transient(err)
	}
	return reg, nil
}
