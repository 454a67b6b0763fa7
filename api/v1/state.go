package v1

import "time"

// The workers' own JetStream resources and what they store, and the tenant
// API's replies. Producers need only the replies (a producer waiting on a
// result asks the status service); operators, the CLI's status and cancel,
// and tools reading the buckets (the NATS CLI) read the rest. Workers own
// every write.

const (
	// QueueStream holds admitted requests until they are finished, one
	// subject per tenant and priority (Limits retention: a finished
	// request's message is deleted by the worker that finished it).
	QueueStream = "BUILDQ_QUEUE"
	// QueuePrefix is the subject prefix of QueueStream:
	// buildq.queue.<tenant>.<high|normal|low>.
	QueuePrefix = "buildq.queue"
	// QueuedConsumer is never pulled: its pending count is the number of
	// admitted requests not finished yet (waiting or running), the second
	// autoscaling signal next to buildq-workers' pending count.
	QueuedConsumer = "buildq-queued"
	// SlotsBucket holds one entry per running request of a tenant with a
	// concurrency limit: <tenant>.<n>, n below the limit. An entry whose
	// holder stops renewing it lapses after 1.5 of the holder's leases,
	// watched by other workers, and is freed then unless the request it
	// names may still have a build running.
	SlotsBucket = "buildq-slots"
	// DeadLetterStream stores copies of requests that exhausted MaxDeliver.
	DeadLetterStream = "BUILDQ_DEADLETTER"
	// ResultsIngestPrefix is where workers publish results: ResultsStream
	// takes them from buildq.internal.results.<tenant>.<name> and stores
	// and publishes them as buildq.results.<tenant>.<name> (ResultSubject).
	ResultsIngestPrefix = "buildq.internal.results"
)

// RequestsBucket is the request ledger: one entry per tenant and request
// id, holding the request's build key and state and, once decided, the
// exact result it gets. A redelivered request finds its decision there and
// publishes that again instead of deciding anew, so a request never gets
// two different answers. It also serves `buildq status` and `buildq
// cancel`. Entries expire with the results.
const RequestsBucket = "buildq-requests"

// RequestEntry is what the ledger knows of one request.
type RequestEntry struct {
	RequestID string    `json:"requestId"`
	Tenant    string    `json:"tenant"`
	Name      string    `json:"name"`
	Key       string    `json:"key"`
	State     string    `json:"state"` // building, then the result's status
	Origin    Origin    `json:"origin,omitempty"`
	Digest    string    `json:"digest,omitempty"`
	Reason    string    `json:"reason,omitempty"`
	Worker    string    `json:"worker,omitempty"`
	UpdatedAt time.Time `json:"updatedAt"`
	// Seq and MsgTime name the request message that holds the id: another
	// message with the same id is a duplicate, not this request.
	Seq     uint64    `json:"seq,omitempty"`
	MsgTime time.Time `json:"msgTime,omitzero"`
	// Result is the decided result, exactly as it is published; Term says
	// the message is terminated rather than acked.
	Result *ResultData `json:"result,omitempty"`
	Term   bool        `json:"term,omitempty"`
	// Published is set once the result's PubAck came back.
	Published bool `json:"published,omitempty"`
	// Final: the decision was recorded as the entry was created (a cache
	// hit): no other result can have been stored for the request, marked
	// published or not. Any other decision not marked published may give
	// way to a result stored before it.
	Final bool `json:"final,omitempty"`
	// TransientFailures counts the request's retries for transient
	// trouble (bounded by --max-deliver).
	TransientFailures int `json:"transientFailures,omitempty"`
	// Canceled: the tenant canceled the request before it was decided;
	// its decision is "canceled".
	Canceled bool `json:"canceled,omitempty"`
	// CleanupKey and CleanupRun name the run this request ended, whose Job
	// it removes after publishing.
	CleanupKey string `json:"cleanupKey,omitempty"`
	CleanupRun string `json:"cleanupRun,omitempty"`
	// RequeueToken is written when the request parks; a requeued message
	// must carry it (never shown to tenants).
	RequeueToken string `json:"requeueToken,omitempty"`
	// Source is set once a git source is resolved and packed: the commit
	// and the context object every later delivery of the request builds
	// (a ref that moves meanwhile does not change what it asked for).
	Source *ResolvedSource `json:"source,omitempty"`
}

// ResolvedSource is a git source packed into an S3 context: what the
// request asked for and resolved to, and where its context is.
type ResolvedSource struct {
	SourceInfo
	S3 S3Source `json:"s3"`
}

// RequestStateBuilding is a ledger entry's state before its decision.
const RequestStateBuilding = "building"

// BuildRecord states in the buildq-builds bucket.
const (
	StateBuilding  = "building"
	StateSucceeded = "succeeded"
	StateFailed    = "failed"
)

// BuildRecord is the value stored under a build key in BuildsBucket: the
// claim while a build runs, then the hash → digest index entry.
type BuildRecord struct {
	Key   string `json:"key"`
	State string `json:"state"`
	// Run identifies the current attempt to build the key.
	Run string `json:"run,omitempty"`
	// Owner is the worker that holds the claim; empty when it let it go
	// (anyone may take the run over at once).
	Owner string `json:"owner,omitempty"`
	// LeaseMs is the owner's lease: the claim lapses when it stays
	// unchanged for that long, measured by whoever watches it.
	LeaseMs int64 `json:"leaseMs,omitempty"`
	// LeaseUntil is the owner's own estimate of its lease's end, for
	// people reading `buildq status`; no worker decides anything on it.
	LeaseUntil time.Time `json:"leaseUntil,omitzero"`
	// Tenant and Name of the request that claimed the key.
	Tenant string `json:"tenant,omitempty"`
	Name   string `json:"name,omitempty"`
	// RequestID is the request whose build this is.
	RequestID string `json:"requestId,omitempty"`
	// Seq is the stream sequence of that request's message.
	Seq uint64 `json:"seq,omitempty"`
	// Holder is the ledger key of the request whose handler runs the run
	// now (its claimer's, or a taker's): it never parks on the run.
	Holder string `json:"holder,omitempty"`
	Job    string `json:"job,omitempty"`
	// JobUID is the UID of the Job the outcome came from.
	JobUID     string `json:"jobUid,omitempty"`
	Repository string `json:"repository,omitempty"`
	// Destinations are the references the run pushes to; a take-over
	// keeps them, since the run's Job may already be pushing there.
	Destinations []string `json:"destinations,omitempty"`
	// Source and Timeout are the run's claimer's: a take-over builds
	// from them, not from the taking request's.
	Source  *Source  `json:"source,omitempty"`
	Timeout Duration `json:"timeout,omitzero"`
	// SecretBuildArgs names the build arguments the claimer marked secret
	// (names only): the run's log masks them whoever runs it.
	SecretBuildArgs []string `json:"secretBuildArgs,omitempty"`
	// SourceInfo is where the claimer's context came from (a git url,
	// ref and commit), for the run's provenance.
	SourceInfo *SourceInfo `json:"sourceInfo,omitempty"`
	Image      string      `json:"image,omitempty"`
	// Pushed lists every repo:tag known to point at Digest.
	Pushed []string `json:"pushed,omitempty"`
	Digest string   `json:"digest,omitempty"`
	// Attestation is the digest of the signed provenance attached to the
	// image at Digest (an OCI referrer in Repository).
	Attestation string `json:"attestation,omitempty"`
	// Provenance is what the build used beyond its request's inputs, as
	// its attestation states it: another tenant answered from the build
	// gets a statement of its own from it.
	Provenance *BuildProvenance `json:"provenance,omitempty"`
	// PlatformKeys maps each platform of an image index's run to the
	// build key of that platform's build (a cancel of the index stops
	// them too).
	PlatformKeys map[string]string `json:"platformKeys,omitempty"`
	// Platforms maps each platform of a multi-platform build to its
	// image's digest; Digest is then the image index's.
	Platforms map[string]string `json:"platforms,omitempty"`
	Reason    string            `json:"reason,omitempty"`
	Message   string            `json:"message,omitempty"`
	LogTail   string            `json:"logTail,omitempty"`
	// Logs is the run's log archive, once the run ended.
	Logs       *LogRef   `json:"logs,omitempty"`
	StartedAt  time.Time `json:"startedAt,omitzero"`
	FinishedAt time.Time `json:"finishedAt,omitzero"`
}

// Final reports whether the record holds a finished build.
func (r *BuildRecord) Final() bool { return r.State == StateSucceeded || r.State == StateFailed }

// Lease is the owner's lease (a default for records without one).
func (r *BuildRecord) Lease() time.Duration {
	if r.LeaseMs <= 0 {
		return 30 * time.Second
	}
	return time.Duration(r.LeaseMs) * time.Millisecond
}

// LapseAfter is how long a reader must see the claim unchanged before it
// counts as lapsed: the owner's lease and half again, so a renewal in
// flight or a slow link is not mistaken for a dead owner.
func (r *BuildRecord) LapseAfter() time.Duration { return r.Lease() + r.Lease()/2 }

// The tenant API's replies (APIStatusSubject, APICancelSubject).

// CancelReply answers a cancel request.
type CancelReply struct {
	Key      string `json:"key,omitempty"`
	Canceled bool   `json:"canceled"`
	// Requests is how many of the tenant's requests were canceled.
	Requests int `json:"requests"`
	// Stopped: no other request waited, so the build itself was stopped.
	Stopped bool   `json:"stopped"`
	Message string `json:"message"`
}

// StatusReply answers a status request: the tenant's request (with its
// result once decided) and the build of the key, when the tenant's own
// request claimed it.
type StatusReply struct {
	Key     string        `json:"key,omitempty"`
	Request *RequestEntry `json:"request,omitempty"`
	Build   *BuildRecord  `json:"build,omitempty"`
	Error   string        `json:"error,omitempty"`
}

// BuildProvenance is what a build used, as its attestation names it.
type BuildProvenance struct {
	// Worker ran the build.
	Worker string `json:"worker,omitempty"`
	// DockerfileDigest is "sha256:…" of the Dockerfile built.
	DockerfileDigest string `json:"dockerfileDigest,omitempty"`
	// Bases are the base images pulled, by digest.
	Bases []ImageDigest `json:"bases,omitempty"`
	// Executor is the executor (an image, or the in-process executor) by
	// digest.
	Executor *ImageDigest `json:"executor,omitempty"`
}

// ImageDigest is an image (or a binary) as named, and its digest.
type ImageDigest struct {
	Ref    string `json:"ref"`
	Digest string `json:"digest"`
}
