package worker

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/localexec"
	"github.com/buildq/buildq/internal/s3store"
)

// ContextSource reads build contexts from object storage.
type ContextSource interface {
	// Open returns the object's body, or an error matching
	// s3store.ErrNotFound.
	Open(ctx context.Context, bucket, key string) (io.ReadCloser, error)
}

// ImagePusher pushes built images and gives pull options for base images.
type ImagePusher interface {
	Push(ctx context.Context, img ggcrv1.Image, refs []string) (string, error)
	RemoteOptions(ctx context.Context) []remote.Option
}

// LocalBackend builds in-process with the local executor: no cluster, no
// container runtime. It is what `buildq dev` runs; Dockerfiles with RUN
// need the kaniko backend.
type LocalBackend struct {
	contexts   ContextSource
	pusher     ImagePusher
	workDir    string
	maxContext int64
	// registries, when not empty, are the only ones base images may come
	// from (WithAllowedRegistries).
	registries []string

	mu      sync.Mutex
	running map[string]*localRun
}

type localRun struct {
	run     string
	cancel  context.CancelFunc
	creator string
	done    chan struct{}
	out     Outcome
	err     error
}

// NewLocalBackend builds contexts read from contexts and pushes with
// pusher. workDir holds extracted contexts while they build (default: the
// system temp dir); maxContext caps an extracted context (default
// contexttar.DefaultMaxBytes).
func NewLocalBackend(contexts ContextSource, pusher ImagePusher, workDir string, maxContext int64) *LocalBackend {
	return &LocalBackend{contexts: contexts, pusher: pusher, workDir: workDir, maxContext: maxContext, running: map[string]*localRun{}}
}

// Identity implements Backend.
func (l *LocalBackend) Identity() string { return localexec.Identity }

// Executor implements ExecutorDescriber: the in-process executor is the
// worker's own binary, named by its digest.
func (l *LocalBackend) Executor() attest.Dependency {
	executorOnce.Do(func() {
		exe, err := os.Executable()
		if err != nil {
			return
		}
		f, err := os.Open(exe)
		if err != nil {
			return
		}
		defer f.Close()
		h := sha256.New()
		if _, err := io.Copy(h, f); err == nil {
			executorDep = attest.Dependency{URI: "buildq:" + localexec.Identity, Digest: fmt.Sprintf("sha256:%x", h.Sum(nil)), Name: "executor"}
		}
	})
	return executorDep
}

var (
	executorOnce sync.Once
	executorDep  attest.Dependency
)

// Run implements Backend. Calls for the same run of a key in this process
// share one build; a call for another run stops the stale one first.
func (l *LocalBackend) Run(ctx context.Context, b Build, started Started) (Outcome, error) {
	name := "local-" + v1.DefaultTag(b.Key)
	for {
		l.mu.Lock()
		r, ok := l.running[b.Key]
		if !ok {
			break // still locked: start our own below
		}
		l.mu.Unlock()
		if r.run == b.Run {
			started(name, false, r.creator)
		} else {
			if !b.current(ctx) {
				return Outcome{}, errNotCurrent
			}
			r.cancel() // a run the record has left
		}
		select {
		case <-r.done:
			// A shared build that ended with its own context (its
			// caller lost the claim or stopped) is not this caller's
			// outcome: run the build again.
			if r.run == b.Run && !isContextErr(r.err) {
				return r.out, r.err
			}
		case <-ctx.Done():
			return Outcome{}, ctx.Err()
		}
	}
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r := &localRun{run: b.Run, cancel: cancel, creator: b.Request.RequestID, done: make(chan struct{})}
	l.running[b.Key] = r
	l.mu.Unlock()
	defer func() {
		// Also when the build panics: a run left in the map would hold
		// every later request of the key forever.
		if p := recover(); p != nil {
			r.err = fmt.Errorf("local build panicked: %v", p)
			l.finish(b.Key, r)
			panic(p)
		}
		l.finish(b.Key, r)
	}()
	started(name, true, b.Request.RequestID)

	r.out, r.err = l.buildWithin(bctx, b)
	r.out.Job, r.out.JobUID, r.out.Run = name, b.Run, b.Run
	return r.out, r.err
}

// DescribeStart implements StartDescriber: a local build is no Job, it
// runs in the worker's own process.
func (l *LocalBackend) DescribeStart(_ string, created bool) string {
	if created {
		return "building locally (in-process executor, no Job)"
	}
	return "joined the local build of this key already running in this process"
}

// LocalDefaultTimeout is the build timeout of requests without one, as the
// kaniko backend's --default-timeout.
const LocalDefaultTimeout = 30 * time.Minute

// errBuildTimeout ends a local build that ran past its request's timeout.
var errBuildTimeout = errors.New("build timeout")

// buildWithin runs build under the request's timeout: past it the build
// fails with DeadlineExceeded, as a kaniko Job's activeDeadlineSeconds.
func (l *LocalBackend) buildWithin(ctx context.Context, b Build) (Outcome, error) {
	timeout := b.Request.Timeout.Duration
	if timeout <= 0 {
		timeout = LocalDefaultTimeout
	}
	start := time.Now().UTC()
	tctx, cancel := context.WithTimeoutCause(ctx, timeout, errBuildTimeout)
	defer cancel()
	out, err := l.build(tctx, b)
	if err != nil && ctx.Err() == nil && errors.Is(context.Cause(tctx), errBuildTimeout) {
		msg := fmt.Sprintf("the build ran longer than its timeout of %s", timeout)
		return Outcome{Reason: v1.ReasonDeadlineExceeded, Message: msg, LogTail: msg, StartedAt: start, FinishedAt: time.Now().UTC()}, nil
	}
	return out, err
}

// finish removes a run from the map and wakes the calls sharing it.
func (l *LocalBackend) finish(key string, r *localRun) {
	l.mu.Lock()
	if l.running[key] == r {
		delete(l.running, key)
	}
	l.mu.Unlock()
	close(r.done)
}

func isContextErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

func (l *LocalBackend) build(ctx context.Context, b Build) (Outcome, error) {
	req := b.Request
	start := time.Now().UTC()
	// The executor's steps go to the run's log as its own output; what
	// the backend does around them as buildq's lines.
	step := func(line string) {
		if b.Log != nil {
			_ = b.Log.Line(ctx, "", v1.LogStreamLocal, 1, time.Now().UTC(), []byte(line))
		}
	}
	own := func(format string, args ...any) {
		if b.Log != nil {
			_ = b.Log.Own(ctx, fmt.Sprintf(format, args...))
		}
	}
	fail := func(reason, msg string) (Outcome, error) {
		step("error: " + msg)
		return Outcome{Reason: reason, Message: msg, LogTail: msg, StartedAt: start, FinishedAt: time.Now().UTC()}, nil
	}
	if req.Source.S3 == nil {
		return fail(v1.ReasonBuildFailed, "the local executor builds S3 contexts only; git sources need the kaniko executor (buildq worker, or buildq dev --kubeconfig)")
	}
	if len(req.Platforms) > 1 {
		// The worker builds an image index one platform at a time
		// (platforms.go): a backend never gets more than one.
		return Outcome{}, fmt.Errorf("local executor: a build of %d platforms reached the backend; each platform is a build of its own", len(req.Platforms))
	}
	own("fetching context s3://%s/%s (%s)", req.Source.S3.Bucket, req.Source.S3.Key, req.ContextDigest)
	rc, err := l.contexts.Open(ctx, req.Source.S3.Bucket, req.Source.S3.Key)
	if errors.Is(err, s3store.ErrNotFound) {
		return fail(v1.ReasonContextMissing, fmt.Sprintf("context s3://%s/%s does not exist", req.Source.S3.Bucket, req.Source.S3.Key))
	}
	if err != nil {
		return Outcome{}, Transient(fmt.Errorf("open context: %w", err))
	}
	defer rc.Close()
	dir, err := os.MkdirTemp(l.workDir, "buildq-context-")
	if err != nil {
		return Outcome{}, fmt.Errorf("context work dir: %w", err)
	}
	defer os.RemoveAll(dir)
	if err := contexttar.ExtractVerified(ctx, rc, dir, l.maxContext, req.ContextDigest); err != nil {
		if ctx.Err() != nil {
			return Outcome{}, ctx.Err()
		}
		if errors.Is(err, contexttar.ErrDigestMismatch) {
			// Someone else's bytes under this name: never built.
			// The message names no digest of the object's bytes: it
			// would tell a prober what someone else's object holds.
			return fail(v1.ReasonContextMismatch, fmt.Sprintf("context refused: s3://%s/%s does not hold the bytes of %s", req.Source.S3.Bucket, req.Source.S3.Key, req.ContextDigest))
		}
		if errors.Is(err, contexttar.ErrBadContext) || errors.Is(err, contexttar.ErrUnsafePath) || errors.Is(err, contexttar.ErrTooLarge) {
			return fail(v1.ReasonBuildFailed, "context refused: "+err.Error())
		}
		return Outcome{}, Transient(fmt.Errorf("read context: %w", err))
	}
	platform := ""
	if len(req.Platforms) == 1 {
		platform = req.Platforms[0]
	}
	// The new layers go to disk, not memory, until pushed.
	layers, err := os.MkdirTemp(l.workDir, "buildq-layers-")
	if err != nil {
		return Outcome{}, fmt.Errorf("layer work dir: %w", err)
	}
	defer os.RemoveAll(layers)
	var (
		basesMu sync.Mutex
		bases   []BaseImage
	)
	img, err := localexec.Build(ctx, localexec.Options{
		Pulled: func(ref, digest string) {
			basesMu.Lock()
			defer basesMu.Unlock()
			bases = append(bases, BaseImage{Ref: ref, Digest: digest})
		},
		ContextDir: dir,
		LayerDir:   layers,
		Dockerfile: req.DockerfileOrDefault(),
		BuildArgs:  req.BuildArgs,
		Target:     req.Target,
		Platform:   platform,
		Labels:     req.Labels,
		Remote:     l.pusher.RemoteOptions(ctx),
		Log:        step,

		AllowedRegistries: l.registries,
	})
	if err != nil {
		if ctx.Err() != nil {
			return Outcome{}, ctx.Err()
		}
		var be *localexec.BuildError
		if errors.As(err, &be) {
			return fail(v1.ReasonBuildFailed, err.Error())
		}
		if reason, msg := baseImageFailure(err); reason != "" {
			return fail(reason, msg)
		}
		if unreachable(err) {
			return Outcome{}, Transient(fmt.Errorf("a base image's registry could not be reached from the worker: %w", err))
		}
		return Outcome{}, Transient(err)
	}
	own("pushing to %s", strings.Join(b.Destinations, ", "))
	digest, err := l.pusher.Push(ctx, img, b.Destinations)
	if err != nil {
		if ctx.Err() != nil {
			return Outcome{}, ctx.Err()
		}
		return fail(v1.ReasonPushFailed, "push: "+err.Error())
	}
	own("pushed %s", digest)
	basesMu.Lock()
	out := Outcome{Succeeded: true, Digest: digest, StartedAt: start, FinishedAt: time.Now().UTC(), Bases: slices.Clone(bases)}
	basesMu.Unlock()
	if df, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(req.DockerfileOrDefault()))); err == nil {
		out.DockerfileDigest = fmt.Sprintf("sha256:%x", sha256.Sum256(df))
	}
	return out, nil
}

// baseImageFailure classifies a failed pull of a base image by the
// registry's answer (go-containerregistry's transport.Error, which the
// local executor's pull wraps): not there (404, MANIFEST_UNKNOWN,
// NAME_UNKNOWN) or refused (401, 403, UNAUTHORIZED, DENIED). Both fail
// the build at once — the same inputs get the same answer — with the
// registry's words in the message. reason is "" for anything else
// (a 5xx, TOOMANYREQUESTS, a network error: transient).
func baseImageFailure(err error) (reason, message string) {
	var te *transport.Error
	if !errors.As(err, &te) {
		return "", ""
	}
	notFound := te.StatusCode == http.StatusNotFound
	refused := te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden
	for _, d := range te.Errors {
		switch d.Code {
		case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode:
			notFound = true
		case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
			refused = true
		}
	}
	switch {
	case notFound:
		return v1.ReasonBaseImageNotFound, "base image not found: " + err.Error()
	case refused:
		return v1.ReasonBaseImageUnauthorized, "the registry refused the base image to this build's credentials: " + err.Error()
	}
	return "", ""
}

// unreachable reports whether err is a connection that could not be made
// (refused, timed out, no route).
func unreachable(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH)
}

// Cleanup implements Backend: a finished local build leaves nothing behind;
// a running one (a cancel) is stopped — only the named run, so a finished
// build's cleanup never stops the next run of its key.
func (l *LocalBackend) Cleanup(_ context.Context, key, run string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if r, ok := l.running[key]; ok && r.run == run {
		r.cancel()
	}
	return nil
}

// WithAllowedRegistries confines base-image pulls (FROM, COPY --from) to
// these registries (host[:port]); empty: any.
func (l *LocalBackend) WithAllowedRegistries(hosts []string) *LocalBackend {
	l.registries = hosts
	return l
}
