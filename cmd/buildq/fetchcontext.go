package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/spf13/cobra"

	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

func newFetchContextCmd() *cobra.Command {
	var (
		rawURL, digest, dest, absent string
		insecure                     []string
		maxBytes                     int64
		timeout                      time.Duration
	)
	cmd := &cobra.Command{
		Use:   "fetch-context --url URL --digest sha256:HEX --dest DIR",
		Short: "Download a build context and check its digest (the build Pod's init container)",
		Long: `Download a build context archive from a presigned URL, check that its bytes
are the ones --digest names, and unpack it into --dest. A worker started with
--fetch-image runs this as the init container of every build Pod of an S3
context, so the kaniko container gets the context as a directory and holds
no S3 key; the digest check means a context object replaced after the
request was made is never built.

With --absent REF it then asks the registry for REF (with the credentials
of $DOCKER_CONFIG/config.json, the build Pod's own) and refuses to let the
build start if REF holds an image already: the build never pushes over a
tag that was there before it began.

Exit codes: 0 unpacked; ` + fmt.Sprint(kaniko.FetchExitMismatch) + ` the bytes do not match --digest; ` + fmt.Sprint(kaniko.FetchExitRefused) + ` the URL was refused
(no such object, or the URL expired); ` + fmt.Sprint(kaniko.FetchExitBadContext) + ` the context --digest names is itself
unusable (an unsafe, unsupported or malformed entry, too large); ` + fmt.Sprint(kaniko.FetchExitTagTaken) + ` --absent
holds an image; ` + fmt.Sprint(kaniko.FetchExitRegistry) + ` the registry refused the check (credentials refused:
401, 403, another 4xx); ` + fmt.Sprint(kaniko.FetchExitRegistryDown) + ` the registry could not answer it now (5xx,
unreachable: the Job retries); 1 anything else (a download that keeps
failing: the Job retries).
On failure --dest is left empty.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rawURL == "" || digest == "" || dest == "" {
				return usageErr("--url, --digest and --dest are required")
			}
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel func()
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			var reg *registry.Client
			if absent != "" {
				var err error
				if reg, err = absentChecker(insecure); err != nil {
					return usageErr("%v", err)
				}
				if _, err := reg.ParseReference(absent); err != nil {
					return usageErr("--absent: %v", err)
				}
			}
			client := &http.Client{Transport: http.DefaultTransport}
			err := contexttar.Fetch(ctx, client, rawURL, digest, dest, maxBytes)
			if err == nil && reg != nil {
				// After the download, as close to the build as it gets.
				if err = checkAbsent(ctx, reg, absent); err != nil {
					err = errors.Join(err, contexttar.ClearDir(dest))
				}
			}
			var (
				taken   *tagTakenError
				checkFx *tagCheckError
			)
			switch {
			case err == nil:
				fmt.Fprintf(cmd.ErrOrStderr(), "context %s unpacked into %s\n", digest, dest)
				return nil
			case errors.As(err, &taken):
				return &exitError{code: kaniko.FetchExitTagTaken, err: err}
			case errors.As(err, &checkFx) && checkFx.refused():
				return &exitError{code: kaniko.FetchExitRegistry, err: err}
			case errors.As(err, &checkFx):
				return &exitError{code: kaniko.FetchExitRegistryDown, err: err}
			case errors.Is(err, contexttar.ErrDigestMismatch):
				return &exitError{code: kaniko.FetchExitMismatch, err: fmt.Errorf("context mismatch: %w", err)}
			case errors.Is(err, contexttar.ErrFetchRefused):
				return &exitError{code: kaniko.FetchExitRefused, err: fmt.Errorf("context missing: %w", err)}
			case errors.Is(err, contexttar.ErrBadContext):
				// The bytes are the ones the digest names: the context
				// itself cannot be built.
				return &exitError{code: kaniko.FetchExitBadContext, err: fmt.Errorf("context refused: %w", err)}
			default:
				return failed(err)
			}
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&rawURL, "url", "", "presigned GET URL of the context archive")
	fs.StringVar(&digest, "digest", "", "the context's digest, sha256:<hex> (the request's contextDigest)")
	fs.StringVar(&dest, "dest", "", "directory to unpack into (emptied on failure)")
	fs.Int64Var(&maxBytes, "max-bytes", contexttar.DefaultMaxBytes, "largest unpacked context accepted")
	fs.DurationVar(&timeout, "timeout", 30*time.Minute, "give up after this long")
	fs.StringVar(&absent, "absent", "", "an image reference (repo:tag) that must hold no image yet; the build does not start if it does")
	fs.StringSliceVar(&insecure, "insecure-registry", nil, "registry host[:port] reached over plain HTTP for --absent (repeatable)")
	return cmd
}

// tagTakenError: the tag --absent names holds an image.
type tagTakenError struct{ ref, digest string }

func (e *tagTakenError) Error() string {
	return fmt.Sprintf("tag taken: %s holds %s already; the build would push over it", e.ref, e.digest)
}

// tagCheckError: the registry could not answer whether --absent holds
// an image (unreachable, 5xx, credentials refused).
type tagCheckError struct {
	ref string
	err error
}

func (e *tagCheckError) Error() string {
	return fmt.Sprintf("checking that %s holds no image yet: %v", e.ref, e.err)
}

func (e *tagCheckError) Unwrap() error { return e.err }

// refused reports whether the registry answered the check with a 4xx:
// asking again with the same credentials gets the same answer.
func (e *tagCheckError) refused() bool {
	var terr *transport.Error
	return errors.As(e.err, &terr) && terr.StatusCode >= 400 && terr.StatusCode < 500
}

// absentChecker is the registry client of --absent: the build Pod's own
// docker config, when it has one.
func absentChecker(insecure []string) (*registry.Client, error) {
	opts := registry.Options{Insecure: insecure}
	if dir := os.Getenv("DOCKER_CONFIG"); dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "config.json")); err == nil {
			opts.DockerConfig = filepath.Join(dir, "config.json")
		}
	}
	return registry.New(opts)
}

// checkAbsent returns a *tagTakenError if ref holds an image, nil if the
// registry has none, and any other error as it is (retried by the Job).
func checkAbsent(ctx context.Context, reg *registry.Client, ref string) error {
	d, err := reg.Head(ctx, ref)
	switch {
	case err == nil:
		return &tagTakenError{ref: ref, digest: d}
	case registry.IsNotFound(err):
		return nil
	default:
		return &tagCheckError{ref: ref, err: err}
	}
}
