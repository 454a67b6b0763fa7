package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"sort"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// accepted is the answer to a stored CloudEvent.
type accepted struct {
	RequestID string `json:"requestId"`
	Tenant    string `json:"tenant"`
	// Duplicate: JetStream had stored this request already (a redelivery).
	Duplicate bool `json:"duplicate,omitempty"`
}

// handleEvent takes a CloudEvent of type RequestedType (binary or
// structured mode), checks who sends it and its request, publishes the
// request and answers 202 once it is stored.
func (s *Server) handleEvent(w http.ResponseWriter, r *http.Request) {
	refuse := func(tenant, outcome string, code int, p problem) {
		s.answer(w, r, routeEvents, tenant, outcome, code, p)
	}
	authTenant, err := s.authenticate(r)
	if err != nil || (authTenant == "" && !s.opts.Open) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="buildq"`)
		msg := "authentication required: a bearer token (Authorization: Bearer ...) or a client certificate of a tenant"
		if err != nil {
			msg = "the credentials name no tenant"
		}
		refuse("", outcomeUnauthorized, http.StatusUnauthorized, problem{Error: msg})
		return
	}

	if r.ContentLength > s.opts.MaxEventBytes {
		// Announced too large: refused unread.
		refuse(authTenant, outcomeTooLarge, http.StatusRequestEntityTooLarge, problem{Error: fmt.Sprintf("the body is larger than %d bytes", s.opts.MaxEventBytes)})
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, s.opts.MaxEventBytes)
	msg := cehttp.NewMessageFromHttpRequest(r)
	switch msg.ReadEncoding() {
	case binding.EncodingBinary, binding.EncodingStructured:
	case binding.EncodingBatch:
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{Error: "batched CloudEvents are not accepted: send one event per request"})
		return
	default:
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{
			Error:        "not a CloudEvent: send binary mode (ce-specversion, ce-id, ce-source, ce-type headers, the request as body) or structured mode (Content-Type: application/cloudevents+json)",
			AcceptedType: RequestedType,
		})
		return
	}
	ev, err := binding.ToEvent(r.Context(), msg)
	if err != nil {
		if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
			refuse(authTenant, outcomeTooLarge, http.StatusRequestEntityTooLarge, problem{Error: fmt.Sprintf("the body is larger than %d bytes", mbe.Limit)})
			return
		}
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{Error: "undecodable CloudEvent: " + err.Error()})
		return
	}
	if err := ev.Validate(); err != nil {
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{Error: "invalid CloudEvent: " + eventProblems(err)})
		return
	}
	if ev.Type() != RequestedType {
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{
			Error:        fmt.Sprintf("CloudEvents type %q is not accepted: the gateway takes %q", truncate(ev.Type(), 100), RequestedType),
			AcceptedType: RequestedType,
		})
		return
	}
	if ct := ev.DataContentType(); ct != "" && !isJSON(ct) {
		refuse(authTenant, outcomeInvalid, http.StatusUnsupportedMediaType, problem{Error: fmt.Sprintf("datacontenttype %q: the data must be JSON (application/json)", truncate(ct, 100))})
		return
	}
	if len(ev.Data()) == 0 {
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{Error: "the event has no data: its data is the build request (api/v1.Request JSON)"})
		return
	}
	req, err := decodeRequest(ev.Data())
	if err != nil {
		refuse(authTenant, outcomeInvalid, http.StatusBadRequest, problem{Error: "undecodable build request: " + err.Error()})
		return
	}

	// The tenant: the credentials' (a body may omit it), or in open mode
	// the body's own.
	switch {
	case req.Tenant == "" && authTenant != "":
		req.Tenant = authTenant
	case authTenant != "" && req.Tenant != authTenant:
		refuse(authTenant, outcomeForbidden, http.StatusForbidden, problem{
			Error: fmt.Sprintf("the request names tenant %q; these credentials are tenant %q's", truncate(req.Tenant, 63), authTenant)})
		return
	}
	if req.APIVersion == "" {
		req.APIVersion = v1.APIVersion
	}
	if req.RequestID == "" {
		req.RequestID = EventRequestID(req.Tenant, ev.Source(), ev.ID())
	}
	if req.SubmittedAt.IsZero() {
		req.SubmittedAt = ev.Time().UTC()
		if ev.Time().IsZero() {
			req.SubmittedAt = s.opts.Now().UTC()
		}
	}
	var ve *v1.ValidationError
	err = req.Validate()
	if p := reservedIDPrefix(req.RequestID); p != "" || errors.As(err, &ve) {
		refuse(authTenant, outcomeInvalid, http.StatusUnprocessableEntity, requestProblem(ve, p))
		return
	}
	if s.link(req.Tenant) == nil {
		refuse(authTenant, outcomeForbidden, http.StatusForbidden, problem{Error: fmt.Sprintf("tenant %q is not served by this gateway", req.Tenant)})
		return
	}

	ids := []zap.Field{zap.String("requestId", req.RequestID), zap.String("name", req.Name),
		zap.String("eventSource", truncate(ev.Source(), 200)), zap.String("eventId", truncate(ev.ID(), 200))}
	dup, err := s.publishRequest(r.Context(), req)
	if err != nil {
		s.publishFailure(w, r, routeEvents, req.Tenant, err, ids...)
		return
	}
	outcome := outcomeAccepted
	if dup {
		outcome = outcomeDuplicate
	}
	s.answer(w, r, routeEvents, req.Tenant, outcome, http.StatusAccepted,
		accepted{RequestID: req.RequestID, Tenant: req.Tenant, Duplicate: dup}, ids...)
}

// requestProblem is the 422 answer to a request that fails validation
// (ve, may be nil) or names a requestId with a reserved prefix (reserved,
// may be "").
func requestProblem(ve *v1.ValidationError, reserved string) problem {
	p := problem{Error: "invalid build request"}
	if ve != nil {
		for _, f := range ve.Fields {
			p.Fields = append(p.Fields, fieldProblem{Field: f.Field, Detail: f.Detail})
		}
	}
	if reserved != "" {
		p.Error = fmt.Sprintf("invalid build request: requestId prefix %q is reserved for webhook pushes", reserved)
		p.Fields = append(p.Fields, fieldProblem{Field: "requestId", Detail: fmt.Sprintf(
			"request ids starting with %q are reserved for the gateway's webhook pushes (gh- GitHub, gl- GitLab): choose another requestId, or leave it out and the gateway derives one (ce-...) from the event's source and id", reserved)})
	}
	return p
}

// decodeRequest parses a request as strictly as v1.DecodeRequest (unknown
// fields refused, no trailing data) without validating it: the gateway
// fills the tenant, the id and the version first.
func decodeRequest(data []byte) (*v1.Request, error) {
	if len(data) > v1.MaxRequestBytes {
		return nil, &v1.DecodeError{Err: fmt.Errorf("request is %d bytes, more than the %d allowed", len(data), v1.MaxRequestBytes)}
	}
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, &v1.DecodeError{Err: errors.New("the data is not a JSON object")}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var r v1.Request
	if err := dec.Decode(&r); err != nil {
		return nil, &v1.DecodeError{Err: err}
	}
	if dec.More() {
		return nil, &v1.DecodeError{Err: errors.New("trailing data after the JSON object")}
	}
	return &r, nil
}

// eventProblems lists an event's validation errors in a stable order.
func eventProblems(err error) string {
	var ve event.ValidationError
	if !errors.As(err, &ve) {
		return err.Error()
	}
	parts := make([]string, 0, len(ve))
	for k, e := range ve {
		parts = append(parts, k+": "+e.Error())
	}
	sort.Strings(parts)
	return strings.Join(parts, "; ")
}

// isJSON reports whether a media type is JSON (application/json,
// text/json, anything+json).
func isJSON(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	if err != nil {
		return false
	}
	return mt == "application/json" || mt == "text/json" || strings.HasSuffix(mt, "+json")
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
