package worker

import (
	"context"
	"errors"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
)

// Build is one run of a build key: the request it runs for, the key, the
// run's id and the references to push.
type Build struct {
	Request *v1.Request
	Key     string
	// Repository is the run's repository (its claimer's); Destinations
	// are tags in it.
	Repository   string
	Destinations []string
	// Run identifies the attempt (claim.go). A backend adopts only a build
	// of the same run; anything of another run of the key is stale and is
	// replaced — but only while Current says this run is still the key's
	// current one (a run that ended meanwhile must not remove the Job of
	// the run that replaced it).
	Run string
	// Current reports whether Run is still the key's current run (nil:
	// always).
	Current func(ctx context.Context) bool
	// Log is the run's log, for the backend to write the build's output
	// into as it goes (nil: not captured).
	Log LogWriter
	// Progress, when set, is told of a new attempt inside the build (a
	// Job that runs its Pod again) and why, for the request's progress
	// events and the run's log.
	Progress func(msg string)
	// KeepFirstTag: the build must not push over its first destination
	// if that holds an image when the build starts. A backend that can
	// check it there (the kube backend's fetch-context init container)
	// does, and ends such a build with Outcome.Reason
	// v1.ReasonTagTaken, having built nothing. Set for every build but a
	// platform's of an image index, whose tag is buildq's own.
	KeepFirstTag bool
}

// TagChecker is a backend whose build checks its first tag itself
// before building (Build.KeepFirstTag), for req: the kube backend with
// fetch-context, for a context in the object store. The worker may then
// start such a build without waiting for its own preflight HEAD of the
// tag, which it sends once the build's Job is created (build.go,
// checksTagBeside; own.go): whatever the HEAD finds, the build's own
// check finds too, and the run answers nobody. Such a backend calls
// Started once its Job exists: that sends the HEAD.
type TagChecker interface {
	ChecksFirstTag(req *v1.Request) bool
}

// Preparer is a backend that can do a build's start-up work — what Run
// computes before it creates anything — ahead of the build, while its
// claim is still in flight (intakeclaim.go, prepareClaimed). Run uses
// what was prepared only for a build equal in everything it was made of.
type Preparer interface {
	Prepare(ctx context.Context, b Build)
}

// errNotCurrent: the run ended while its build was being started.
var errNotCurrent = errors.New("the build run is no longer the key's current run")

func (b Build) current(ctx context.Context) bool { return b.Current == nil || b.Current(ctx) }

// Outcome is the end of a build as a backend reports it.
type Outcome struct {
	Succeeded bool
	Digest    string
	// Platforms maps each platform of an image index to its image's
	// digest (a multi-platform run; on failure, the platforms built).
	Platforms map[string]string
	Reason    string
	Message   string
	LogTail   string
	Job       string
	// JobUID is the Job's UID.
	JobUID string
	// Run is the run the outcome belongs to (reconciliation).
	Run        string
	StartedAt  time.Time
	FinishedAt time.Time
	// What the build used, for its provenance (attest.go): the base
	// images it pulled, the Dockerfile's digest when the backend read it,
	// and the executor that ran it.
	Bases            []BaseImage
	DockerfileDigest string
	Executor         attest.Dependency
}

// Started tells the worker that a build is running: created is false when
// the backend adopted a build that already existed, creator names the
// request that started it.
type Started func(job string, created bool, creator string)

// StartDescriber is a Backend whose builds are not Kubernetes Jobs: it
// says what it started (or joined), for the progress event and the run's
// log, instead of "created job …".
type StartDescriber interface {
	DescribeStart(job string, created bool) string
}

// Backend runs builds. The worker holds the build key's claim around Run.
type Backend interface {
	// Identity names the executor in build keys.
	Identity() string
	// Run starts the build, or adopts the one already running for its key,
	// and waits for its outcome. It returns ctx.Err() when ctx ends first;
	// a *TransientError for trouble worth retrying; any other error is
	// terminal for the request.
	Run(ctx context.Context, b Build, started Started) (Outcome, error)
	// Cleanup removes what a run of key left behind once its results are
	// stored, or stops it (cancel). Only that run's build is touched,
	// never a newer run's.
	Cleanup(ctx context.Context, key, run string) error
}

// TransientError is trouble worth retrying later (the API server, the
// registry or storage unavailable).
type TransientError struct{ Err error }

func (e *TransientError) Error() string { return e.Err.Error() }

// Unwrap returns the cause.
func (e *TransientError) Unwrap() error { return e.Err }

// Transient wraps err as a *TransientError.
func Transient(err error) error { return &TransientError{Err: err} }

// IsTransient reports whether err is worth retrying.
func IsTransient(err error) bool {
	var t *TransientError
	return errors.As(err, &t)
}

// Reconciler is a backend with reconciliation to run beside the worker.
type Reconciler interface {
	// Reconcile hands finished builds to finish until ctx ends; finish
	// returns when to hand the same build again (0: never).
	Reconcile(ctx context.Context, finish func(ctx context.Context, key string, out Outcome) time.Duration)
}
