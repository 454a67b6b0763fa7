package tenantapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

// The stored-results service (buildq.api.results.<tenant>): the results
// of the subject's tenant that BUILDQ_RESULTS holds after a stream
// sequence or a time, for a `buildq watch` that was disconnected.
// Tenants may not read the stream; the worker reads it for them with
// the JetStream message-get API, filtered to buildq.results.<tenant>.*
// (or one name of it) — the tenant is the subject's, never the body's,
// and every message read is checked to be that tenant's before it is
// sent.

// jsMsgGetErrNotFound is JetStream's error code for "no message found".
const jsMsgGetErrNotFound = 10037

// msgGetRequest is the JetStream API's message-get request (the fields
// used here: the first message at or after Seq, or stored at or after
// StartTime, whose subject matches NextFor).
type msgGetRequest struct {
	Seq       uint64     `json:"seq,omitempty"`
	NextFor   string     `json:"next_by_subj,omitempty"`
	StartTime *time.Time `json:"start_time,omitempty"`
}

type msgGetResponse struct {
	Error *struct {
		Code        int    `json:"code"`
		ErrCode     int    `json:"err_code"`
		Description string `json:"description"`
	} `json:"error,omitempty"`
	Message *struct {
		Subject string    `json:"subject"`
		Seq     uint64    `json:"seq"`
		Data    []byte    `json:"data"`
		Time    time.Time `json:"time"`
	} `json:"message,omitempty"`
}

type streamState struct {
	State struct {
		FirstSeq uint64 `json:"first_seq"`
		LastSeq  uint64 `json:"last_seq"`
	} `json:"state"`
	Error *struct {
		Description string `json:"description"`
	} `json:"error,omitempty"`
}

// parseResultsRequest reads a JSON ResultsRequest (an empty body: every
// stored result).
func parseResultsRequest(data []byte) (v1.ResultsRequest, error) {
	var r v1.ResultsRequest
	if data = bytes.TrimSpace(data); len(data) > 0 {
		if err := json.Unmarshal(data, &r); err != nil {
			return r, fmt.Errorf("the results request is not valid JSON: %w", err)
		}
	}
	if r.Name != "" {
		if p := v1.DNSLabelProblem(r.Name); p != "" {
			return r, fmt.Errorf("name %s", p)
		}
	}
	if r.Max <= 0 || r.Max > v1.MaxResultsPage {
		r.Max = v1.MaxResultsPage
	}
	return r, nil
}

// results answers one stored-results request of tenant.
// resultsPerTenant bounds one tenant's stored-results requests in
// progress on a worker: they share the service's handlers with status
// and cancel, and past it a request is answered at once (the client asks
// again after a pause), so one tenant's flood cannot queue every other
// tenant's requests behind it.
const resultsPerTenant = 4

// ErrResultsBusy is the reply's error past resultsPerTenant, or when half
// of the service's handlers read stored results.
const ErrResultsBusy = "busy: too many stored-results requests at once; ask again shortly"

func (w *Service) results(ctx context.Context, tenant string, data []byte) v1.ResultsReply {
	req, err := parseResultsRequest(data)
	if err != nil {
		return v1.ResultsReply{Error: err.Error()}
	}
	if !w.reading.take(tenant) {
		return v1.ResultsReply{Error: ErrResultsBusy}
	}
	defer w.reading.give(tenant)
	name := req.Name
	if name == "" {
		name = "*"
	}
	filter := v1.ResultsPrefix + "." + tenant + "." + name
	mine := v1.ResultsPrefix + "." + tenant + "."

	var st streamState
	if err := w.jsAPI(ctx, "$JS.API.STREAM.INFO."+v1.ResultsStream, nil, &st); err != nil {
		return v1.ResultsReply{Error: "read the results stream: " + err.Error()}
	}
	if st.Error != nil {
		return v1.ResultsReply{Error: "read the results stream: " + st.Error.Description}
	}
	rep := v1.ResultsReply{Next: req.AfterSeq, FirstSeq: st.State.FirstSeq}
	if req.AfterSeq == math.MaxUint64 {
		// Nothing is stored after the last sequence there can be (and
		// AfterSeq+1 would wrap to 0: from the first).
		return rep
	}
	switch {
	case req.AfterSeq > 0:
		rep.Truncated = req.AfterSeq+1 < st.State.FirstSeq
	case !req.Since.IsZero():
		// Sequence 1 still stored: nothing has aged out at all.
		rep.Truncated = st.State.FirstSeq > 1 && w.storedAfter(ctx, req.Since, st.State.FirstSeq)
	}
	get := msgGetRequest{Seq: req.AfterSeq + 1, NextFor: filter}
	if req.AfterSeq == 0 && !req.Since.IsZero() {
		since := req.Since.UTC()
		get = msgGetRequest{StartTime: &since, NextFor: filter}
	}
	size := 0
	for {
		var res msgGetResponse
		if err := w.jsAPI(ctx, "$JS.API.STREAM.MSG.GET."+v1.ResultsStream, get, &res); err != nil {
			return v1.ResultsReply{Error: "read the results stream: " + err.Error()}
		}
		if res.Error != nil {
			if res.Error.ErrCode == jsMsgGetErrNotFound {
				// Read to the end: everything up to the last sequence
				// seen before is covered, whoever's it was.
				rep.Next = max(rep.Next, st.State.LastSeq)
				return rep
			}
			return v1.ResultsReply{Error: "read the results stream: " + res.Error.Description}
		}
		m := res.Message
		if m == nil || m.Seq < get.Seq {
			return v1.ResultsReply{Error: "read the results stream: an answer without its message"}
		}
		// The filter names the tenant; a message of anyone else's is a
		// bug to stop at, never to send.
		if !strings.HasPrefix(m.Subject, mine) || strings.Count(m.Subject, ".") != 3 {
			w.cfg.Log.Error("stored results: the stream answered a filter with another subject; nothing sent")
			return v1.ResultsReply{Error: "read the results stream: an unexpected subject"}
		}
		if len(rep.Results) >= req.Max || (len(rep.Results) > 0 && size+len(m.Data) > v1.MaxResultsBytes) {
			rep.More = true
			return rep
		}
		if !json.Valid(m.Data) {
			// Not ours to judge, nor to send as JSON: skip it.
			rep.Next = m.Seq
			get = msgGetRequest{Seq: m.Seq + 1, NextFor: filter}
			continue
		}
		size += len(m.Data)
		rep.Results = append(rep.Results, v1.StoredResult{Seq: m.Seq, Time: m.Time, Event: json.RawMessage(m.Data)})
		rep.Next = m.Seq
		get = msgGetRequest{Seq: m.Seq + 1, NextFor: filter}
	}
}

// storedAfter reports whether the stream's first message was stored
// after since: what came between has aged out.
func (w *Service) storedAfter(ctx context.Context, since time.Time, first uint64) bool {
	var res msgGetResponse
	if err := w.jsAPI(ctx, "$JS.API.STREAM.MSG.GET."+v1.ResultsStream, msgGetRequest{Seq: first}, &res); err != nil || res.Message == nil {
		return false
	}
	return res.Message.Time.After(since)
}

// jsAPI sends req (nil: no body) to a JetStream API subject on the
// worker's connection and decodes the answer into out.
func (w *Service) jsAPI(ctx context.Context, subject string, req, out any) error {
	var body []byte
	if req != nil {
		b, err := json.Marshal(req)
		if err != nil {
			return err
		}
		body = b
	}
	m, err := w.cfg.NC.RequestWithContext(ctx, subject, body)
	if err != nil {
		return err
	}
	if len(m.Data) == 0 {
		return errors.New("an empty answer (status " + m.Header.Get("Status") + ")")
	}
	return json.Unmarshal(m.Data, out)
}
