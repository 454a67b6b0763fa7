package v1

import (
	"encoding/json"
	"time"
)

// APIResultsPrefix is the stored-results service's
// (buildq.api.results.<tenant>): the results of one tenant that
// BUILDQ_RESULTS holds after a point — a stream sequence, or a time.
// Tenants may not read the stream itself; a tenant's `buildq watch` asks
// this service for what it missed while its connection was down (the
// Nats-Sequence header of each result it gets says where it stood).
// Workers answer it reading the stream filtered to the subject's tenant
// only.
const APIResultsPrefix = "buildq.api.results"

// APIResultsSubject is tenant's stored-results service (request/reply,
// ResultsRequest → ResultsReply).
func APIResultsSubject(tenant string) string { return APIResultsPrefix + "." + tenant }

// Limits of one stored-results request.
const (
	// MaxResultsPage bounds the results of one reply (also the default).
	MaxResultsPage = 100
	// MaxResultsBytes bounds the events' bytes in one reply, under NATS's
	// default max payload of 1 MiB.
	MaxResultsBytes = 640 << 10
)

// ResultsRequest asks for the tenant's stored results after a point:
// AfterSeq (a stream sequence, as the Nats-Sequence header of a result
// carries it), else Since (a time); neither: from the oldest stored.
type ResultsRequest struct {
	// Name keeps one build name's results only (empty: all of the
	// tenant's names).
	Name     string    `json:"name,omitempty"`
	AfterSeq uint64    `json:"afterSeq,omitempty"`
	Since    time.Time `json:"since,omitzero"`
	// Max bounds the results of the reply (default and cap
	// MaxResultsPage).
	Max int `json:"max,omitempty"`
}

// StoredResult is one stored result: its stream sequence, the time it
// was stored, and the CloudEvent as published (a Result).
type StoredResult struct {
	Seq   uint64          `json:"seq"`
	Time  time.Time       `json:"time"`
	Event json.RawMessage `json:"event"`
}

// ResultsReply is one page of a tenant's stored results, in stream order.
type ResultsReply struct {
	Results []StoredResult `json:"results,omitempty"`
	// Next is where to go on: the AfterSeq of the next request.
	Next uint64 `json:"next"`
	// More: the page was cut short; ask again from Next.
	More bool `json:"more,omitempty"`
	// Truncated: results after the point asked may have aged out of the
	// stream (MaxAge) — it now begins at FirstSeq, later than asked.
	Truncated bool   `json:"truncated,omitempty"`
	FirstSeq  uint64 `json:"firstSeq,omitempty"`
	Error     string `json:"error,omitempty"`
}
