package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/spf13/cobra"

	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
)

func newFetchContextCmd() *cobra.Command {
	var (
		rawURL, digest, dest string
		maxBytes             int64
		timeout              time.Duration
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

Exit codes: 0 unpacked; ` + fmt.Sprint(kaniko.FetchExitMismatch) + ` the bytes do not match --digest; ` + fmt.Sprint(kaniko.FetchExitRefused) + ` the URL was refused
(no such object, or the URL expired); ` + fmt.Sprint(kaniko.FetchExitBadContext) + ` the context --digest names is itself
unusable (an unsafe, unsupported or malformed entry, too large); 1 anything
else (a download that keeps failing: the Job retries).
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
			client := &http.Client{Transport: http.DefaultTransport}
			err := contexttar.Fetch(ctx, client, rawURL, digest, dest, maxBytes)
			switch {
			case err == nil:
				fmt.Fprintf(cmd.ErrOrStderr(), "context %s unpacked into %s\n", digest, dest)
				return nil
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
	return cmd
}
