// Package v1 holds buildq's wire contract: the build request that producers
// publish, the result event (CloudEvents 1.0, structured mode) that workers
// publish once per request, the progress events, and the NATS names they travel
// on.
//
// It is deliberately small and depends only on the standard library and
// go-containerregistry's reference parser, so that producers and third-party
// subscribers can import it without pulling Kubernetes or the worker into their
// build.
package v1

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// APIVersion is the only request version this package understands.
const APIVersion = "buildq.dev/v1"

// NATS names shared by producers, workers and subscribers (DESIGN §3).
const (
	RequestsStream  = "BUILDQ_REQUESTS"
	ResultsStream   = "BUILDQ_RESULTS"
	WorkersConsumer = "buildq-workers"
	BuildsBucket    = "buildq-builds"

	RequestsPrefix = "buildq.requests"
	ResultsPrefix  = "buildq.results"
	EventsPrefix   = "buildq.events"
	CancelPrefix   = "buildq.cancel"
	// APIStatusPrefix and APICancelPrefix are the tenant API's request/reply
	// subjects: buildq.api.status.<tenant> and buildq.api.cancel.<tenant>,
	// payload a request id or a build key, reply JSON.
	APIStatusPrefix  = "buildq.api.status"
	APICancelPrefix  = "buildq.api.cancel"
	DeadLetterPrefix = "buildq.deadletter"

	// MsgIDHeader is the JetStream de-duplication header; buildq sets it to
	// MsgID(tenant, requestId) on both requests and results.
	MsgIDHeader = "Nats-Msg-Id"
)

// MsgID is the Nats-Msg-Id of a tenant's request and of its result:
// "<tenant>/<requestId>". JetStream dedupes on it stream-wide, so the
// tenant is part of it: two tenants' requests with the same id never
// meet. A request whose header is the bare requestId (the first version of
// the contract) is still accepted, without that protection.
func MsgID(tenant, requestID string) string { return tenant + "/" + requestID }

// RequestMsgID is the Nats-Msg-Id a producer sets on a request:
// MsgID(tenant, requestID) + "/" + nonce. JetStream dedupes on the header
// stream-wide and NATS permissions guard subjects, not headers, so a
// header another tenant can predict could be published first and make
// JetStream drop the real request. The nonce — random per producer and
// stable across its retries of one request — makes the header
// unpredictable; the publisher SDK sets it.
func RequestMsgID(tenant, requestID, nonce string) string {
	return MsgID(tenant, requestID) + "/" + nonce
}

// MsgIDMatches reports whether a request's Nats-Msg-Id header belongs to
// its body's tenant and request id: RequestMsgID's form, MsgID's, or the
// bare request id of the first version of the contract.
func MsgIDMatches(header, tenant, requestID string) bool {
	scoped := MsgID(tenant, requestID)
	return header == requestID || header == scoped || strings.HasPrefix(header, scoped+"/")
}

// RequestIDOfMsgID returns the request id a request's Nats-Msg-Id header
// names for tenant, in any of the accepted forms: RequestMsgID's
// "<tenant>/<requestId>/<nonce>", MsgID's "<tenant>/<requestId>", or the
// bare "<requestId>" (a request id holds no '/'). It is "" for an empty
// header.
func RequestIDOfMsgID(header, tenant string) string {
	id := strings.TrimPrefix(header, tenant+"/")
	id, _, _ = strings.Cut(id, "/")
	return id
}

// APIStatusSubject and APICancelSubject are a tenant's status and cancel
// services.
func APIStatusSubject(tenant string) string { return APIStatusPrefix + "." + tenant }

// APICancelSubject is where a tenant cancels its requests.
func APICancelSubject(tenant string) string { return APICancelPrefix + "." + tenant }

// RequestSubject is where a tenant's requests are published.
func RequestSubject(tenant string) string { return RequestsPrefix + "." + tenant }

// ResultSubject is where the results of tenant/name are published.
func ResultSubject(tenant, name string) string { return ResultsPrefix + "." + tenant + "." + name }

// EventSubject is where progress events of tenant/name are published (core NATS).
func EventSubject(tenant, name string) string { return EventsPrefix + "." + tenant + "." + name }

// CancelSubject is where cancel requests for tenant/name are sent (core NATS request).
func CancelSubject(tenant, name string) string { return CancelPrefix + "." + tenant + "." + name }

// DeadLetterSubject receives copies of requests that exhausted their deliveries.
func DeadLetterSubject(tenant string) string { return DeadLetterPrefix + "." + tenant }

// InboxPrefix is tenant's own reply-subject prefix, "_INBOX_<tenant>".
// The SDK and the CLI send the tenant API's requests (status, cancel) with
// replies under it, and a worker answers a tenant API request only on a
// reply under it or on the reply a service import gives (the account per
// tenant of deploy/nats): no client can have the worker answer on a
// subject of someone else's.
func InboxPrefix(tenant string) string { return "_INBOX_" + tenant }

// Request is a build request, published as JSON on RequestSubject(Tenant)
// with the header Nats-Msg-Id set to RequestID.
type Request struct {
	APIVersion string `json:"apiVersion"`
	// RequestID is unique per submission; it is the JetStream message id of
	// the request and of its result.
	RequestID string `json:"requestId"`
	// Tenant and Name are DNS-1123 labels; they become subject tokens.
	Tenant string `json:"tenant"`
	Name   string `json:"name"`
	Source Source `json:"source"`
	// ContextDigest is "sha256:<hex>" of the normalized context tar; required
	// for S3 sources.
	ContextDigest string `json:"contextDigest,omitempty"`
	// Dockerfile is the path of the Dockerfile inside the context
	// (default "Dockerfile").
	Dockerfile string            `json:"dockerfile,omitempty"`
	BuildArgs  map[string]string `json:"buildArgs,omitempty"`
	// SecretBuildArgs names the build arguments whose values are secret:
	// they are masked ("***") in the build's log as it is captured. It
	// does not change the image (not in the build key).
	SecretBuildArgs []string `json:"secretBuildArgs,omitempty"`
	Target          string   `json:"target,omitempty"`
	Platforms       []string `json:"platforms,omitempty"`
	// Image is the destination repository, without tag or digest. Empty means
	// the worker's naming policy decides.
	Image string `json:"image,omitempty"`
	// Tags are extra tags; the build key's first 12 hex digits are always one.
	Tags []string `json:"tags,omitempty"`
	// Timeout bounds the build (the Job's activeDeadlineSeconds); zero means
	// the worker's default.
	Timeout Duration          `json:"timeout,omitzero"`
	Labels  map[string]string `json:"labels,omitempty"`
	// Priority orders a tenant's own queued requests: "high" before
	// "normal" before "low" (empty means normal). It never moves a request
	// ahead of another tenant's share, and it is not part of the build key.
	Priority string `json:"priority,omitempty"`
	// SBOM asks for an SPDX SBOM of the image, signed and attached to it
	// as an OCI referrer beside its provenance. The deployment must make
	// SBOMs (workers run with --sbom-scanner); it is not part of the
	// build key: a build answers requests that ask and that do not.
	SBOM bool `json:"sbom,omitempty"`
	// SubmittedAt is set by the producer; it is informational.
	SubmittedAt time.Time `json:"submittedAt,omitzero"`
}

// Source says where the build context comes from: exactly one of S3 or Git.
type Source struct {
	S3  *S3Source  `json:"s3,omitempty"`
	Git *GitSource `json:"git,omitempty"`
}

// S3Source is a normalized context tar.gz in an S3 bucket.
type S3Source struct {
	Bucket string `json:"bucket"`
	Key    string `json:"key"`
}

// GitSource is a commit of a git repository. The worker (never the build
// Pod) resolves Ref to a commit, fetches exactly that commit, and packs the
// SubPath tree (with its .dockerignore applied) into a content-addressed
// context in S3, the same as an upload: the build key is that context's
// digest, so identical trees from two commits, refs or repositories are
// built once.
type GitSource struct {
	// URL is https://, http:// (only for hosts the worker is told to
	// reach without TLS) or ssh://.
	URL string `json:"url"`
	// Ref is a branch, a tag or a full ref (refs/heads/main). With Ref,
	// Commit is optional: given, it must be reachable from Ref.
	Ref string `json:"ref,omitempty"`
	// Commit is a full commit hash; required without Ref.
	Commit  string `json:"commit,omitempty"`
	SubPath string `json:"subPath,omitempty"`
	// Submodules fetches the commit's submodules into the context.
	Submodules bool `json:"submodules,omitempty"`
}

// SourceInfo says what a request's context was built from: for a git
// source, the repository, the ref asked for, the commit it resolved to;
// for every source, the context digest. Results and progress events of
// the request carry it, also when answered from the cache.
type SourceInfo struct {
	GitURL        string `json:"gitUrl,omitempty"`
	Ref           string `json:"ref,omitempty"`
	Commit        string `json:"commit,omitempty"`
	SubPath       string `json:"subPath,omitempty"`
	ContextDigest string `json:"contextDigest,omitempty"`
}

// Duration is a time.Duration that travels as a Go duration string ("15m").
type Duration struct{ time.Duration }

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// UnmarshalJSON implements json.Unmarshaler; it accepts "90s"-style strings.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration must be a string such as \"15m\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

// IsZero lets encoding/json's omitzero drop an unset timeout.
func (d Duration) IsZero() bool { return d.Duration == 0 }

// Status is the terminal status of a request.
type Status string

// Terminal statuses.
const (
	StatusSucceeded Status = "succeeded"
	StatusFailed    Status = "failed"
	StatusCanceled  Status = "canceled"
)

// Origin says how a successful request got its image.
type Origin string

// Origins.
const (
	// OriginBuild: this request's own build ran.
	OriginBuild Origin = "build"
	// OriginInflight: the request joined a build another request started.
	OriginInflight Origin = "inflight"
	// OriginCache: the image already existed; nothing was built.
	OriginCache Origin = "cache"
)

// Reasons are machine words for why a request did not succeed.
const (
	ReasonInvalidRequest   = "InvalidRequest"
	ReasonBuildFailed      = "BuildFailed"
	ReasonDeadlineExceeded = "DeadlineExceeded"
	ReasonCanceled         = "Canceled"
	ReasonContextMissing   = "ContextMissing"
	// ReasonContextMismatch: the context object's bytes are not the ones
	// its contextDigest names; nothing was built from them.
	ReasonContextMismatch     = "ContextMismatch"
	ReasonPushFailed          = "PushFailed"
	ReasonJobDeleted          = "JobDeleted"
	ReasonExpired             = "Expired"
	ReasonInfrastructureError = "InfrastructureError"
	// ReasonQuotaExceeded: the tenant already had its queue-length limit
	// of requests waiting; the request was refused without a build.
	ReasonQuotaExceeded = "QuotaExceeded"

	// Base images (FROM, COPY --from): each fails the build at once, with
	// the registry's words in the message, and is never retried as an
	// infrastructure error.
	//
	// ReasonBaseImageNotFound: the registry has no such image (404,
	// MANIFEST_UNKNOWN, NAME_UNKNOWN).
	ReasonBaseImageNotFound = "BaseImageNotFound"
	// ReasonBaseImageUnauthorized: the registry refused to serve the image
	// with the tenant's credentials, or without any (401, 403,
	// UNAUTHORIZED, DENIED).
	ReasonBaseImageUnauthorized = "BaseImageUnauthorized"
	// ReasonSBOMFailed: the image was built (and attested), but the SBOM
	// the request asked for could not be made from it; the message says
	// why, in the scanner's words.
	ReasonSBOMFailed = "SBOMFailed"
	// ReasonBaseImageUnreachable: a build Pod could not connect to a base
	// image's registry (connection refused, timeout, no route); most
	// often the build Pods' egress NetworkPolicy does not allow it. The
	// message says so.
	ReasonBaseImageUnreachable = "BaseImageUnreachable"

	// ReasonPlatformUnsupported: a RUN step's program could not execute
	// on the build's node ("exec format error"): the node does not run
	// the requested platform's programs and has no emulation for them.
	// The message quotes kaniko's line.
	ReasonPlatformUnsupported = "PlatformUnsupported"

	// Git sources: each fails at once, with the git server's words in
	// the message, and is never retried as an infrastructure error.
	//
	// ReasonGitHostRefused: the URL's host, an address it resolves to or
	// a redirect is not one the worker may reach (--allowed-git-host).
	ReasonGitHostRefused = "GitHostRefused"
	// ReasonGitRefNotFound: the repository has no such branch, tag or ref.
	ReasonGitRefNotFound = "GitRefNotFound"
	// ReasonGitCommitNotFound: the commit is not in the repository (or
	// not reachable from the ref).
	ReasonGitCommitNotFound = "GitCommitNotFound"
	// ReasonGitAuthFailed: the server refused the tenant's credentials,
	// or asked for some and the tenant has none, or says the repository
	// does not exist (hosts answer so for private ones); or, over SSH,
	// the host key is not a known one.
	ReasonGitAuthFailed = "GitAuthFailed"
	// ReasonGitLFS: a file of the context is a Git LFS pointer; LFS
	// objects are not fetched.
	ReasonGitLFS = "GitLFSPointer"
	// ReasonGitTooLarge: the fetch went over a size limit of the
	// worker's: bytes received, an object's or all objects' inflated
	// size, the packed context's size or entries, submodules.
	ReasonGitTooLarge = "GitTooLarge"
	// ReasonGitTooManyObjects: the fetch received more objects than the
	// worker allows (--git-max-objects).
	ReasonGitTooManyObjects = "GitTooManyObjects"
	// ReasonGitTooDeep: the commit is deeper below its ref's tip than
	// the worker fetches history for (--git-max-depth), or a delta chain
	// is deeper than git makes them.
	ReasonGitTooDeep = "GitTooDeep"
	// ReasonGitTimeout: resolving and fetching took longer than allowed.
	ReasonGitTimeout = "GitTimeout"
	// ReasonGitSubPath: the subPath is not a directory of the commit.
	ReasonGitSubPath = "GitSubPathNotFound"
	// ReasonTagTaken: a build record's reason, never a result's. The
	// run's first tag held an image when its build Pod started, so the
	// Pod refused to build over it; or the run's Job succeeded but its
	// Pod was gone before the worker read the digest it pushed, so the
	// image now at the tag cannot be shown to be the build's. Nothing is
	// recorded as built; every request of the run looks again, and the
	// requests of that tag are answered with the image found there, as
	// when their own check finds it first.
	ReasonTagTaken = "TagTaken"
)

// Priorities of a request (Request.Priority), highest first.
const (
	PriorityHigh   = "high"
	PriorityNormal = "normal"
	PriorityLow    = "low"
)

// Priorities lists the priorities in the order they are served.
var Priorities = []string{PriorityHigh, PriorityNormal, PriorityLow}

// PriorityRank orders priorities as Priorities does, highest first (0);
// an unknown or empty one ranks as normal.
func PriorityRank(p string) int {
	p, _ = PriorityOf(p)
	return slices.Index(Priorities, p)
}

// PriorityOf returns p's canonical priority ("" is normal) and whether p
// is one.
func PriorityOf(p string) (string, bool) {
	switch p {
	case "":
		return PriorityNormal, true
	case PriorityHigh, PriorityNormal, PriorityLow:
		return p, true
	}
	return PriorityNormal, false
}

// CloudEvents constants of the result event.
const (
	CloudEventsSpecVersion = "1.0"
	ResultContentType      = "application/json"
	// CloudEventsContentType is the Content-Type header of a structured-mode event.
	CloudEventsContentType = "application/cloudevents+json"
)

// ResultType is the CloudEvents type for a status, e.g. dev.buildq.build.succeeded.v1.
func ResultType(s Status) string { return "dev.buildq.build." + string(s) + ".v1" }

// Result is the result event, a CloudEvents 1.0 structured-mode envelope
// published on ResultSubject(tenant, name) with Nats-Msg-Id = RequestID.
type Result struct {
	SpecVersion     string     `json:"specversion"`
	Type            string     `json:"type"`
	Source          string     `json:"source"`
	ID              string     `json:"id"`
	Subject         string     `json:"subject"`
	Time            time.Time  `json:"time"`
	DataContentType string     `json:"datacontenttype"`
	Data            ResultData `json:"data"`
}

// ResultData is the payload of a result event.
type ResultData struct {
	RequestID string `json:"requestId"`
	Tenant    string `json:"tenant"`
	Name      string `json:"name"`
	Key       string `json:"key,omitempty"`
	Status    Status `json:"status"`
	Origin    Origin `json:"origin,omitempty"`
	// Image is repo:tag, Digest sha256:…, ImageRef repo@digest.
	Image    string `json:"image,omitempty"`
	Digest   string `json:"digest,omitempty"`
	ImageRef string `json:"imageRef,omitempty"`
	// Platforms maps each platform of a multi-platform request to its
	// image's digest (the image index at Digest references them).
	Platforms map[string]string `json:"platforms,omitempty"`
	// Attestation is the digest of the signed SLSA provenance attached
	// to the image at Digest as an OCI referrer (`buildq verify` and
	// `cosign verify-attestation` check it).
	Attestation string `json:"attestation,omitempty"`
	// SBOM is the digest of the signed SPDX SBOM attached to the image
	// at Digest (a request that asked for one); for an image index,
	// SBOMs maps each platform to the SBOM attached to that platform's
	// image.
	SBOM     string            `json:"sbom,omitempty"`
	SBOMs    map[string]string `json:"sboms,omitempty"`
	Reason   string            `json:"reason,omitempty"`
	Message  string            `json:"message,omitempty"`
	LogTail  string            `json:"logTail,omitempty"`
	Job      string            `json:"job,omitempty"`
	Attempts int               `json:"attempts,omitempty"`
	Timings  Timings           `json:"timings"`
	// Source is what this request's context was built from (git url,
	// ref, resolved commit, context digest); set for git sources.
	Source *SourceInfo `json:"source,omitempty"`
	// Logs is where the log of the build that answered the request is
	// archived (buildq logs reads it through the tenant API).
	Logs *LogRef `json:"logs,omitempty"`
}

// Timings of one request.
type Timings struct {
	QueuedAt    time.Time `json:"queuedAt,omitzero"`
	StartedAt   time.Time `json:"startedAt,omitzero"`
	FinishedAt  time.Time `json:"finishedAt,omitzero"`
	QueueWaitMs int64     `json:"queueWaitMs"`
	BuildMs     int64     `json:"buildMs"`
}

// NewResult wraps data in its CloudEvents envelope. source identifies the
// publisher (a URI reference such as "/buildq/worker/w-1").
func NewResult(source string, data ResultData, now time.Time) Result {
	return Result{
		SpecVersion:     CloudEventsSpecVersion,
		Type:            ResultType(data.Status),
		Source:          source,
		ID:              data.RequestID,
		Subject:         data.Tenant + "/" + data.Name,
		Time:            now.UTC(),
		DataContentType: ResultContentType,
		Data:            data,
	}
}

// Phase is a progress step of a request.
type Phase string

// Progress phases, in the order a request usually passes them.
const (
	PhaseQueued Phase = "queued"
	// PhaseSource: a git source is being resolved, fetched and packed
	// (several events, each saying which step, bytes and objects).
	PhaseSource     Phase = "source"
	PhaseClaimed    Phase = "claimed"
	PhaseWaiting    Phase = "waiting"
	PhaseJobCreated Phase = "job-created"
	PhaseRunning    Phase = "running"
	PhaseFinished   Phase = "finished"
)

// Event is a progress event, published on core NATS (not stored) on
// EventSubject(tenant, name).
type Event struct {
	RequestID string    `json:"requestId"`
	Tenant    string    `json:"tenant"`
	Name      string    `json:"name"`
	Key       string    `json:"key,omitempty"`
	Phase     Phase     `json:"phase"`
	Message   string    `json:"message,omitempty"`
	Job       string    `json:"job,omitempty"`
	Worker    string    `json:"worker,omitempty"`
	Time      time.Time `json:"time"`
	// Source names the git url, ref, resolved commit and context digest
	// once they are known.
	Source *SourceInfo `json:"source,omitempty"`
	// Platform names the platform a multi-platform request's event is
	// about (its build of that platform); empty for the request as a
	// whole.
	Platform string `json:"platform,omitempty"`
}
