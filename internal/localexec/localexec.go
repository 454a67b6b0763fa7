// Package localexec is buildq's daemonless, in-process image builder.
//
// It exists so that laptops and CI can build images from a Dockerfile without
// a Docker daemon, BuildKit or a Kubernetes cluster. It never runs a
// container: it parses the Dockerfile with BuildKit's own parser (so syntax,
// quoting and variable expansion match `docker build`), turns every COPY/ADD
// into a layer assembled in memory, records every other instruction in the
// image config, and stacks the result on base images pulled with
// go-containerregistry. Dockerfiles that need to execute something (RUN) are
// refused with ErrRunNotSupported so that callers can route them to the
// kaniko executor instead.
//
// Output is reproducible: the same Dockerfile, context, build args and base
// image digests always produce the same image digest, because every timestamp
// is pinned to the Unix epoch, tar entries are sorted, ownership is explicit
// and nothing about the host (hostname, clock, umask of created directories)
// leaks into the result.
//
// Deliberate differences from `docker build`, each because there is no
// container or because the docker behaviour would hurt reproducibility:
//
//   - RUN, and RUN triggers inherited through ONBUILD, fail with
//     ErrRunNotSupported. Declaring ONBUILD RUN is fine: it is only recorded.
//   - ADD of URLs and git repositories, and of xz-compressed archives, is
//     refused; COPY --parents and symbolic --chmod (u+x) are not supported.
//     COPY --link is accepted and has no effect.
//   - ARG values are not written to the image history (docker leaks them).
//   - BUILDPLATFORM equals the target platform: nothing runs on the host.
//   - COPY --from=<word> where <word> is not a stage is an error, not a pull
//     of docker.io/library/<word>; use a reference with a tag or digest.
//   - --chown=<name> that is not in the stage's /etc/passwd or /etc/group is
//     an error (BuildKit silently uses root).
//   - Hard links in copied trees and archives become independent files.
//   - HEALTHCHECK --start-interval is dropped (go-containerregistry's config
//     type has no field for it).
//
// File modes of context files are taken from disk, as docker does, so two
// checkouts with different umasks can still produce different digests.
package localexec

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

// Identity names this executor in build keys; bump the version when output for the same input changes.
//
// It is also written into the history of every image this package produces,
// so a published image tells which executor (and which version of its
// reproducibility rules) made it.
const Identity = "buildq-local/v1"

// defaultPlatform is what `docker build` assumes on the machines buildq
// targets; an explicit Options.Platform overrides it.
const defaultPlatform = "linux/amd64"

// epoch is the only timestamp this package ever writes (config, history and
// every tar entry), which is what makes builds byte-for-byte reproducible.
var epoch = time.Unix(0, 0).UTC()

// Options describes one build.
type Options struct {
	// ContextDir is the extracted build context on disk. COPY and ADD read
	// from it; it is never modified.
	ContextDir string
	// Dockerfile is the Dockerfile path relative to ContextDir; empty means
	// "Dockerfile".
	Dockerfile string
	// BuildArgs are --build-arg values. As with docker, they only take effect
	// for names declared with ARG; unused ones are ignored.
	BuildArgs map[string]string
	// Target is the stage to build; empty means the last stage.
	Target string
	// Platform is "os/arch[/variant]" and defaults to "linux/amd64". It picks
	// the image out of multi-platform base images and is written into the
	// config of images built FROM scratch.
	Platform string
	// Labels are extra labels added to the final image config, overriding
	// LABEL instructions with the same key.
	Labels map[string]string
	// Remote is passed to go-containerregistry when pulling base images
	// (auth, transport, context). The build's own context and platform are
	// appended after these options, so they take precedence.
	Remote []remote.Option
	// LayerDir, when set, is where the new layers are written (gzip tar
	// files) instead of memory; the returned image reads them from there,
	// so the caller removes LayerDir only after pushing it.
	LayerDir string
	// Limits bound what one build may take; zero fields take the defaults
	// (DefaultLimits).
	Limits Limits
	// AllowedRegistries, when not empty, are the only registries
	// (host[:port]) base images may come from; a FROM or COPY --from of
	// any other is a build error, and nothing is sent to it.
	AllowedRegistries []string
	// Pulled, when set, is told each base image pulled: the reference
	// as the Dockerfile resolved it and the digest of the image manifest
	// fetched (for the build's provenance).
	Pulled func(ref, digest string)
	// Log, when set, receives one line per step as the build goes
	// (without a trailing newline), in the order the steps happen.
	// Instructions are echoed as written, never with build-arg values
	// expanded; Build calls Log from its own goroutine. The formats are
	// listed in steplog.go.
	Log func(line string)
}

// Limits bound one build of the local executor, which runs inside the
// worker: a hostile Dockerfile or base image must not exhaust its disk or
// memory. Exceeding one is a BuildError that names the limit.
type Limits struct {
	// SpoolBytes caps the file content held on disk while building (files
	// of base images copied from, archives ADDed, and the new layers).
	SpoolBytes int64
	// BaseImageBytes caps the compressed size of all base images pulled.
	BaseImageBytes int64
	// Entries caps the filesystem entries read from base images and
	// archives.
	Entries int
	// Depth caps the directories in any path read or written.
	Depth int
}

// DefaultLimits are the limits when Options.Limits leaves a field zero.
var DefaultLimits = Limits{SpoolBytes: 8 << 30, BaseImageBytes: 8 << 30, Entries: 1_000_000, Depth: 128}

func (l Limits) withDefaults() Limits {
	if l.SpoolBytes <= 0 {
		l.SpoolBytes = DefaultLimits.SpoolBytes
	}
	if l.BaseImageBytes <= 0 {
		l.BaseImageBytes = DefaultLimits.BaseImageBytes
	}
	if l.Entries <= 0 {
		l.Entries = DefaultLimits.Entries
	}
	if l.Depth <= 0 {
		l.Depth = DefaultLimits.Depth
	}
	return l
}

// ErrLimit matches the error of a build that exceeded one of its Limits.
var ErrLimit = errors.New("local executor limit")

func limitErrorf(format string, args ...any) error {
	return &BuildError{Err: fmt.Errorf("%w: "+format, append([]any{ErrLimit}, args...)...)}
}

// ErrRunNotSupported is returned (wrapped in *BuildError) when the Dockerfile
// has RUN, or its base image carries an ONBUILD RUN trigger: both need a
// container runtime, which this executor deliberately does not have. The
// wrapping BuildError names the line; callers test for it with errors.Is to
// fall back to, or suggest, the kaniko executor.
var ErrRunNotSupported = errors.New("RUN needs a container runtime: the local executor cannot run it; " +
	"build this Dockerfile with the kaniko executor (buildq dev --kubeconfig … or a buildq worker on Kubernetes)")

// BuildError is a problem with the Dockerfile or the build context — a user
// error, not infrastructure: parse errors, an unknown stage or target, a
// missing COPY source, an unsupported instruction. Retrying will not help;
// the user has to change their input. Errors that are not *BuildError (a
// failed pull, an I/O error) may be transient.
type BuildError struct {
	// Line is the 1-based Dockerfile line the problem is on, or 0 when it is
	// not tied to one line (e.g. an unknown target).
	Line int
	// Err is the underlying problem.
	Err error
}

// Error prefixes the problem with its Dockerfile line so the message can be
// shown to the user as is.
func (e *BuildError) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("Dockerfile line %d: %v", e.Line, e.Err)
	}
	return fmt.Sprintf("Dockerfile: %v", e.Err)
}

// Unwrap exposes the cause, so errors.Is(err, ErrRunNotSupported) works.
func (e *BuildError) Unwrap() error { return e.Err }

// userErrorf builds a *BuildError; a helper so call sites stay one line.
func userErrorf(line int, format string, args ...any) error {
	return &BuildError{Line: line, Err: fmt.Errorf(format, args...)}
}

// Build parses and executes the Dockerfile and returns the final image (not pushed).
//
// The returned image keeps its new layers (compressed) in opts.LayerDir, or
// in memory when that is empty, and refers
// to base-image layers in their registry, fetched again with opts.Remote
// when the image is written somewhere. Only the stages the target needs are
// built, as BuildKit does, so a RUN in an unrelated stage is not an error.
func Build(ctx context.Context, opts Options) (v1.Image, error) {
	if opts.ContextDir == "" {
		return nil, errors.New("localexec: Options.ContextDir is required")
	}
	if fi, err := os.Stat(opts.ContextDir); err != nil {
		return nil, fmt.Errorf("localexec: build context: %w", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("localexec: build context %s is not a directory", opts.ContextDir)
	}
	plat, err := parsePlatform(opts.Platform)
	if err != nil {
		return nil, &BuildError{Err: err}
	}

	dockerfile := opts.Dockerfile
	if dockerfile == "" {
		dockerfile = "Dockerfile"
	}
	if !filepath.IsLocal(filepath.FromSlash(dockerfile)) {
		// The Dockerfile comes from the build request; it must not be a way
		// to read files outside the context.
		return nil, &BuildError{Err: fmt.Errorf("path %q must be inside the build context", dockerfile)}
	}
	dfPath := filepath.Join(opts.ContextDir, filepath.FromSlash(dockerfile))
	dt, err := os.ReadFile(dfPath)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, &BuildError{Err: fmt.Errorf("%s not found in the build context", dockerfile)}
		}
		return nil, fmt.Errorf("localexec: read %s: %w", dockerfile, err)
	}

	res, err := parser.Parse(bytes.NewReader(dt))
	if err != nil {
		return nil, dockerfileError(err)
	}
	// A real (empty) linter rather than nil: BuildKit dereferences it when
	// an instruction carries a "# check=" comment.
	stages, metaArgs, err := instructions.Parse(res.AST, linter.New(&linter.Config{}))
	if err != nil {
		return nil, dockerfileError(err)
	}
	if len(stages) == 0 {
		return nil, &BuildError{Err: errors.New("the Dockerfile has no FROM instruction")}
	}

	ignore, err := loadDockerignore(opts.ContextDir, dockerfile)
	if err != nil {
		return nil, err
	}

	tmp, err := os.MkdirTemp("", "buildq-localexec-")
	if err != nil {
		return nil, fmt.Errorf("localexec: %w", err)
	}
	// Everything under tmp (spooled file contents) is only needed while
	// layers are assembled; the returned image holds its layers in
	// opts.LayerDir or in memory.
	defer os.RemoveAll(tmp)

	b := &builder{
		ctx:      ctx,
		opts:     opts,
		platform: plat,
		lex:      shell.NewLex(res.EscapeToken),
		stages:   stages,
		built:    make([]*stageState, len(stages)),
		context:  newContextFS(opts.ContextDir, ignore),
		pulled:   map[string]v1.Image{},
		imageFS:  map[string]*imageFS{},
		limits:   opts.Limits.withDefaults(),
	}
	b.spool = &spool{dir: tmp, b: b}
	defer b.spool.close()
	defer func() {
		for _, p := range b.remotes {
			p.detach()
		}
	}()

	target := len(stages) - 1
	if opts.Target != "" {
		idx, ok := b.stageIndex(opts.Target)
		if !ok {
			return nil, &BuildError{Err: fmt.Errorf("target stage %q not found (stages: %s)", opts.Target, b.stageNames())}
		}
		target = idx
	}
	b.logMetaArgs(metaArgs)
	if err := b.initGlobalArgs(metaArgs, target); err != nil {
		return nil, err
	}
	if err := b.findRun(target); err != nil {
		return nil, err
	}

	st, err := b.buildStage(target)
	if err != nil {
		return nil, err
	}
	img := st.final
	if len(opts.Labels) > 0 {
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, err
		}
		cf = cf.DeepCopy()
		if cf.Config.Labels == nil {
			cf.Config.Labels = map[string]string{}
		}
		for k, v := range opts.Labels {
			cf.Config.Labels[k] = v
		}
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			return nil, err
		}
	}
	// Force the manifest now: a failure here is ours, and callers should get
	// a usable image, not one that fails on first use.
	d, err := img.Digest()
	if err != nil {
		return nil, fmt.Errorf("localexec: compute image digest: %w", err)
	}
	b.logf("built image %s for %s", d, st.platform.String())
	return img, nil
}

// parsePlatform applies the default and insists on os/arch, which scratch
// images need in their config and remote.WithPlatform needs for indexes.
func parsePlatform(s string) (v1.Platform, error) {
	if s == "" {
		s = defaultPlatform
	}
	p, err := v1.ParsePlatform(s)
	if err != nil {
		return v1.Platform{}, fmt.Errorf("invalid platform %q: %w", s, err)
	}
	if p.OS == "" || p.Architecture == "" {
		return v1.Platform{}, fmt.Errorf("invalid platform %q: want os/arch[/variant]", s)
	}
	return *p, nil
}

// dockerfileError turns a BuildKit parse error into a *BuildError, pulling
// the line out of BuildKit's location wrapper so the message does not repeat
// it.
func dockerfileError(err error) error {
	line := 0
	inner := err
	var le *parser.LocationError
	if errors.As(err, &le) {
		if len(le.Locations) > 0 && len(le.Locations[0]) > 0 {
			line = le.Locations[0][0].Start.Line
		}
		if u := le.Unwrap(); u != nil {
			inner = u
		}
	}
	return &BuildError{Line: line, Err: inner}
}

// builder holds the state of one Build call. It is used from one goroutine.
type builder struct {
	ctx      context.Context
	opts     Options
	platform v1.Platform
	lex      *shell.Lex
	stages   []instructions.Stage
	built    []*stageState // memoised by stage index
	context  *contextFS
	global   *argEnv             // meta args (ARG before FROM) plus predefined platform args
	pulled   map[string]v1.Image // remote images by reference and platform
	imageFS  map[string]*imageFS // content snapshots of --from images by reference and platform
	remotes  []*pulledImage      // detached from ctx when Build returns
	spool    *spool
	limits   Limits
	// spooled, entries and baseBytes count against limits.
	spooled   int64
	entries   int
	baseBytes int64
}

// stageIndex finds a stage by name (case-insensitively, as BuildKit does) or
// by its decimal index.
func (b *builder) stageIndex(ref string) (int, bool) {
	for i, st := range b.stages {
		if st.Name != "" && strings.EqualFold(st.Name, ref) {
			return i, true
		}
	}
	return -1, false
}

// stageNames lists the named stages for error messages.
func (b *builder) stageNames() string {
	var names []string
	for _, st := range b.stages {
		if st.Name != "" {
			names = append(names, st.Name)
		}
	}
	if len(names) == 0 {
		return "none are named"
	}
	return strings.Join(names, ", ")
}

// pull fetches a remote image for the given platform. Failures are not
// BuildErrors: registries time out, credentials expire, networks flap.
// Only a reference that cannot even be parsed is the user's fault.
func (b *builder) pull(ref string, plat v1.Platform, line int) (v1.Image, error) {
	key := ref + "|" + plat.String()
	if img, ok := b.pulled[key]; ok {
		return img, nil
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		return nil, userErrorf(line, "invalid image reference %q: %v", ref, err)
	}
	if host := r.Context().RegistryStr(); len(b.opts.AllowedRegistries) > 0 && !slices.ContainsFunc(b.opts.AllowedRegistries, func(a string) bool {
		// "docker.io" and "index.docker.io" are one registry.
		if reg, err := name.NewRegistry(a); err == nil {
			a = reg.RegistryStr()
		}
		return strings.EqualFold(a, host)
	}) {
		return nil, userErrorf(line, "base image %s: registry %s is not one this builder may pull from (allowed: %s)", ref, host, strings.Join(b.opts.AllowedRegistries, ", "))
	}
	opts := make([]remote.Option, 0, len(b.opts.Remote)+2)
	opts = append(opts, b.opts.Remote...)
	opts = append(opts, remote.WithContext(b.ctx), remote.WithPlatform(plat))
	desc, err := remote.Image(r, opts...)
	if err != nil {
		return nil, fmt.Errorf("pull base image %s: %w", ref, err)
	}
	if m, err := desc.Manifest(); err == nil {
		for _, l := range m.Layers {
			if l.Size <= 0 {
				return nil, limitErrorf("base image %s names a layer of size %d; its size counts against the limit", ref, l.Size)
			}
			b.baseBytes += l.Size
		}
		if b.baseBytes > b.limits.BaseImageBytes {
			return nil, limitErrorf("base images of more than %d bytes (compressed) in all; %s brings the total to %d", b.limits.BaseImageBytes, ref, b.baseBytes)
		}
	}
	// Fetching manifest and config now makes a broken or unreachable image
	// fail here, labelled as a pull problem, rather than deep in a COPY.
	p, err := newPulledImage(b.ctx, r.Context(), desc, b.opts.Remote)
	if err != nil {
		return nil, fmt.Errorf("pull base image %s: %w", ref, err)
	}
	if b.opts.Pulled != nil {
		if d, err := desc.Digest(); err == nil {
			b.opts.Pulled(ref, d.String())
		}
	}
	b.remotes = append(b.remotes, p)
	img, err := p.image()
	if err != nil {
		return nil, fmt.Errorf("pull base image %s: %w", ref, err)
	}
	b.pulled[key] = img
	return img, nil
}

// checkCtx lets long loops stop promptly when the build is cancelled.
func (b *builder) checkCtx() error {
	return b.ctx.Err()
}
