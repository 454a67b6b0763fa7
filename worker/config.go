package worker

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker/internal/fairq"
)

// Config is the worker's validated configuration. Zero fields take the
// defaults documented on each field (see WithDefaults).
type Config struct {
	// ID names this worker in claims, events and logs (default: hostname
	// and pid).
	ID string
	// MaxInFlight is how many requests this worker holds at once; it fetches
	// only as many messages as it has free slots (default 4).
	MaxInFlight int
	// AckWait of the shared consumer (default 30s). Heartbeats are sent
	// every AckWait/3 while a request is held.
	AckWait time.Duration
	// MaxDeliver is a request's budget of transient failures (default 5),
	// counted in its ledger entry: a request that fails transiently that
	// many times gets a failed result. Hand-backs and crashes do not count.
	MaxDeliver int
	// ResultsMaxAge is how long results are kept (default 7 days).
	ResultsMaxAge time.Duration
	// IndexTTL is how long a build record (claim or index entry) is kept
	// after its last write (default 30 days; at least 1h and 3 leases).
	IndexTTL time.Duration
	// DuplicateWindow of both streams (default 10m, the contract's minimum).
	DuplicateWindow time.Duration
	// FirstAge: a finished build's result is published before its
	// decision is recorded when its request is younger than this, and a
	// publish of an older request's result first looks for one stored
	// for it (docs/design.md §4). Default half the duplicate window, at
	// most that; negative: never published first (tests). Publishing first
	// needs a connection that keeps no reconnect buffer
	// (nats.ReconnectBufSize(-1)): New refuses one that does.
	FirstAge time.Duration
	// RecordFirst: every handler records its decision before publishing
	// it, as versions before publish-first did, while cancels and the
	// status service still go by what the stream stored. For upgrading a
	// fleet from such a version (docs/design.md §2 step 6): roll it out
	// with this set, then again without.
	RecordFirst bool
	// Storage of streams and the KV bucket (default file).
	Storage jetstream.StorageType
	// Replicas of streams and the KV bucket (default 1).
	Replicas int
	// Lease is how long a build claim stays valid without renewal (default
	// 30s); a claim whose owner stops renewing is taken over after it.
	Lease time.Duration
	// ShutdownTimeout bounds the hand-back of in-flight requests (default 10s).
	ShutdownTimeout time.Duration
	// TagCheckBeside bounds the preflight HEAD of a build whose Pod checks
	// its tag (own's tagCheck, sent once the build's Job is created;
	// default 1s): an image it finds stops the build only if it answered
	// within this of the build's start, before its Job's create, and it is
	// not sent at all past that. It must be shorter than
	// the least time from a Job's creation to its push (a Pod started, its
	// context fetched and its tag checked, kaniko run): an answer later
	// than that may be the build's own image. A HEAD slower than this is
	// left to the Pod's own check.
	TagCheckBeside time.Duration
	// Naming decides the repository of requests that name none.
	Naming naming.Policy
	// Registry checks and tags images (nil: the index is trusted as is and
	// requests for other repositories than the build's fail).
	Registry Registry
	// RegistryFor, when set, gives the registry client of a tenant's own
	// credentials: the preflight and the copies into the tenant's
	// repositories use it (reading another tenant's image for a copy still
	// goes through Registry). An error refuses the tenant's requests as
	// InvalidRequest before anything is created.
	RegistryFor func(tenant string) (Registry, error)
	// Attestor signs and attaches the provenance of every image the
	// worker builds (nil: none).
	Attestor Attestor
	// SBOM makes the signed SBOMs that requests ask for (nil: requests
	// that ask for one are refused as InvalidRequest).
	SBOM SBOMMaker
	// QueueTTL bounds how long a request may wait in the queue: a request
	// first taken more than QueueTTL after the server stored it gets a
	// failed result with reason Expired and is terminated without a build.
	// Redeliveries of a request already taken are not expired. 0 (the
	// default) means no limit.
	QueueTTL time.Duration
	// HoldAtIntake is how long intake holds a request whose key is being
	// built for another request of its tenant, or is queued to be built
	// by one at its priority or higher, before it admits it to the queue
	// (intakehold.go). 0: 2 minutes; negative: never held.
	HoldAtIntake time.Duration
	// ContextPrefix is where a request's S3 context must live, {tenant}
	// standing for its tenant (the CLI and SDK upload under
	// contexts/{tenant}/). Empty: anywhere (a worker whose producers keep
	// their own layout).
	ContextPrefix string
	// ContextBucket, when set, is the only bucket a request's S3 context
	// may be in.
	ContextBucket string
	// Contexts reads tenants' S3 context objects. With it, a request is
	// answered from a build another tenant's request claimed (a cache hit,
	// a join, a take-over) only once its tenant's own context object was
	// shown to hold the bytes of its contextDigest (possession.go); nil:
	// nothing is checked (one trusted tenant).
	Contexts ContextSource
	// GitSources packs requests' git sources into S3 contexts of their
	// tenants (source.go); nil: a request with a git source fails with
	// reason InvalidRequest, saying git sources are not enabled.
	GitSources GitSources
	// MaxContextBytes bounds the content of a context read to check it
	// (default contexttar.DefaultMaxBytes).
	MaxContextBytes int64
	// Fair holds the fair-queueing rules: tenant weights, concurrency and
	// queue-length limits (docs/design.md §2d).
	Fair FairConfig
	// KeepJobs leaves finished Jobs for their ttlSecondsAfterFinished
	// instead of deleting them after the results are stored (default false).
	KeepJobs bool
	// AnyReply answers tenant API requests (status, cancel) on any reply
	// subject. Off (the default), the worker answers only on a service
	// import's reply (_R_.…) or the tenant's own inbox (_INBOX_<tenant>.…)
	// and drops the rest: NATS does not check the reply subject a client
	// names. Only for a server whose every client is trusted (buildq dev,
	// which has no NATS authentication at all).
	AnyReply bool
	// Logs: build logs captured into BUILDQ_LOGS and archived (logs.go).
	Logs LogsConfig
	// Metrics, when not nil, records Prometheus metrics.
	Metrics *Metrics
	// Logger (default: a no-op logger).
	Logger *zap.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time

	// lookupWait, when set (tests), replaces intakeLookupTimeout: a test
	// of what intake answers must not see the request go to the queue
	// because a loaded machine made a lookup slow.
	lookupWait time.Duration
}

// minIndexTTLLeases is how many leases a build record must outlive its
// last write by (Validate).
const minIndexTTLLeases = 3

// Registry is what the worker needs of the OCI registry; internal/registry
// implements it with go-containerregistry.
type Registry interface {
	// Head returns the digest of ref, or an error matching
	// registry.ErrNotFound when it does not exist.
	Head(ctx context.Context, ref string) (string, error)
	// Copy makes dst refer to the image at src.
	Copy(ctx context.Context, src, dst string) (string, error)
	// EnsureHarborProject creates a Harbor project if it is missing.
	EnsureHarborProject(ctx context.Context, registry, project string) error
	// PushIndex writes the image index of children (each already in the
	// repository of refs) under every ref and returns its digest.
	PushIndex(ctx context.Context, children []registry.IndexChild, refs []string) (string, error)
}

// WithDefaults returns c with unset fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.ID == "" {
		h, _ := os.Hostname()
		if h == "" {
			h = "worker"
		}
		c.ID = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 4
	}
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = 5
	}
	if c.ResultsMaxAge == 0 {
		c.ResultsMaxAge = 7 * 24 * time.Hour
	}
	if c.IndexTTL == 0 {
		c.IndexTTL = 30 * 24 * time.Hour
	}
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = 10 * time.Minute
	}
	if c.FirstAge == 0 {
		c.FirstAge = c.DuplicateWindow / 2
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.Lease == 0 {
		c.Lease = 30 * time.Second
	}
	if c.TagCheckBeside == 0 {
		c.TagCheckBeside = time.Second
	}
	if c.HoldAtIntake == 0 {
		c.HoldAtIntake = 2 * time.Minute
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Validate reports every invalid setting.
func (c Config) Validate() error {
	var errs []error
	if c.MaxInFlight < 1 {
		errs = append(errs, fmt.Errorf("max in flight must be at least 1, got %d", c.MaxInFlight))
	}
	if c.AckWait < time.Second {
		errs = append(errs, fmt.Errorf("ack wait must be at least 1s, got %s", c.AckWait))
	}
	if c.MaxDeliver < 1 {
		errs = append(errs, fmt.Errorf("max deliver must be at least 1, got %d", c.MaxDeliver))
	}
	if c.DuplicateWindow < 10*time.Minute {
		errs = append(errs, fmt.Errorf("duplicate window must be at least 10m, got %s", c.DuplicateWindow))
	}
	if c.FirstAge > c.DuplicateWindow/2 {
		errs = append(errs, fmt.Errorf("first-publish age must be at most half the duplicate window (%s), got %s", c.DuplicateWindow/2, c.FirstAge))
	}
	if c.Lease < time.Second {
		errs = append(errs, fmt.Errorf("lease must be at least 1s, got %s", c.Lease))
	}
	if c.IndexTTL < time.Hour {
		errs = append(errs, fmt.Errorf("index TTL must be at least 1h, got %s", c.IndexTTL))
	} else if c.Lease >= time.Second && c.IndexTTL < minIndexTTLLeases*c.Lease {
		// A record ages out IndexTTL after its last write. A running
		// build's record is written every lease/3, and a dead owner's is
		// taken over only once a reader watched it unchanged for 1.5
		// leases (first seen up to a lease after its last write): a
		// shorter TTL drops a running build's record (its key claimed
		// again, its Job replaced) or a dead owner's before it is taken
		// over.
		errs = append(errs, fmt.Errorf("index TTL must be at least %d times the lease (%s), got %s",
			minIndexTTLLeases, minIndexTTLLeases*c.Lease, c.IndexTTL))
	}
	if c.QueueTTL < 0 {
		errs = append(errs, fmt.Errorf("queue TTL must not be negative (0 means no limit), got %s", c.QueueTTL))
	}
	if _, ok := c.Registry.(RemoteRegistry); c.Attestor != nil && c.Registry != nil && !ok {
		errs = append(errs, fmt.Errorf("a worker that attests images needs a registry client it can attach them with, not %T", c.Registry))
	}
	if _, ok := c.Registry.(RemoteRegistry); c.SBOM != nil && c.Registry != nil && !ok {
		errs = append(errs, fmt.Errorf("a worker that makes SBOMs needs a registry client it can attach them with, not %T", c.Registry))
	}
	if c.ContextPrefix == "" && c.Contexts != nil {
		// Possession is shown with the request's own object: without a
		// prefix of its tenant's, a request could name another tenant's
		// object as its proof (and its build would read it).
		errs = append(errs, errors.New("a worker that checks possession of contexts (Contexts set) needs a context prefix with {tenant}/, e.g. contexts/{tenant}/"))
	}
	if c.ContextPrefix != "" && !strings.Contains(c.ContextPrefix, "{tenant}/") {
		// "contexts/{tenant}" would let tenant acme name contexts/acme-corp/….
		errs = append(errs, fmt.Errorf("context prefix %q must contain {tenant}/ ({tenant} as a whole path segment), e.g. contexts/{tenant}/", c.ContextPrefix))
	}
	if err := c.Fair.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Naming.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// FairConfig holds the fair-queueing rules (see internal/fairq).
type FairConfig = fairq.Config

// QueueState is where the requests are (see internal/fairq).
type QueueState = fairq.QueueState

// ReadQueueState reads the queue's state from the server (for tests,
// benchmarks and operators' tools).
func ReadQueueState(ctx context.Context, js jetstream.JetStream) (QueueState, error) {
	return fairq.ReadQueueState(ctx, js)
}
