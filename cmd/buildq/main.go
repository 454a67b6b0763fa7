// Command buildq is the one binary of buildq: the worker, the embedded dev
// stack and the client commands (submit, watch, status, cancel, logs,
// render).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	// Root certificates for an image without /etc/ssl (make image): used
	// only when the system has none.
	_ "golang.org/x/crypto/x509roots/fallback"
)

// Exit codes (DESIGN §6).
const (
	exitOK      = 0
	exitFailed  = 1 // the build failed or was canceled, or an operation failed
	exitInvalid = 2 // invalid input or usage
)

// exitError carries an exit code through cobra.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageErr(format string, args ...any) error {
	return &exitError{code: exitInvalid, err: fmt.Errorf(format, args...)}
}

func failed(err error) error { return &exitError{code: exitFailed, err: err} }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run executes the command line and returns the process exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRoot()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	var ee *exitError
	if errors.As(err, &ee) {
		if ee.err != nil && ee.err.Error() != "" {
			fmt.Fprintln(root.ErrOrStderr(), "buildq:", ee.err)
		}
		return ee.code
	}
	// cobra's own errors (unknown flag, bad arg count) are usage errors.
	fmt.Fprintln(root.ErrOrStderr(), "buildq:", err)
	return exitInvalid
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "buildq",
		Short: "Queue-driven container image builds on NATS JetStream and Kubernetes",
		Long: `buildq builds container images from build requests published on NATS JetStream.

Workers take requests from the shared stream, build each unique source once
(kaniko Jobs on Kubernetes, or the in-process local executor) and publish one
result event per request. Run "buildq dev" for the whole stack on a laptop.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usageErr("%v\nRun '%s --help' for usage.", err, c.CommandPath())
	})
	root.AddCommand(newWorkerCmd(), newDevCmd(), newSubmitCmd(), newWatchCmd(), newStatusCmd(), newCancelCmd(), newLogsCmd(), newRenderCmd(), newFetchContextCmd(), newNATSConfigCmd(), newGatewayCmd(), newVerifyCmd())
	return root
}

// bindEnv lets every flag of cmd be set from BUILDQ_<FLAG> (dashes become
// underscores), unless it was given on the command line. Extra maps flag
// names to further variables (NATS_URL for --nats-url).
func bindEnv(cmd *cobra.Command, extra map[string]string) error {
	_, err := bindEnvTracked(cmd, extra)
	return err
}

// bindEnvTracked is bindEnv that also returns the flags set other than
// by their own name on the command line: from the environment, or by a
// renamed flag's old name. A renamed flag's old variable is read only
// when neither the flag nor its new variable is set.
func bindEnvTracked(cmd *cobra.Command, extra map[string]string) (map[string]bool, error) {
	var errs []error
	set := map[string]bool{}
	renamed := deprecatedNames(cmd.Flags())
	for from, to := range renamed {
		if f := cmd.Flags().Lookup(from); f != nil && f.Changed {
			set[to] = true // given on the command line by its old name
		}
	}
	bind := func(f *pflag.Flag) {
		if f.Changed || set[f.Name] || f.Name == "help" {
			return
		}
		if to, ok := renamed[f.Name]; ok {
			if nf := cmd.Flags().Lookup(to); nf != nil && (nf.Changed || set[to]) {
				return
			}
		}
		names := []string{"BUILDQ_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))}
		if e, ok := extra[f.Name]; ok {
			names = append(names, e)
		}
		for _, n := range names {
			v, ok := os.LookupEnv(n)
			if !ok {
				continue
			}
			set[f.Name] = true
			if to, ok := renamed[f.Name]; ok {
				set[to] = true
			}
			if sv, isSlice := f.Value.(pflag.SliceValue); isSlice {
				if err := sv.Replace(splitList(v)); err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", n, err))
				}
			} else if err := f.Value.Set(v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", n, v, err))
			}
			return
		}
	}
	var old []*pflag.Flag
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if _, ok := renamed[f.Name]; ok {
			old = append(old, f)
			return
		}
		bind(f)
	})
	for _, f := range old {
		bind(f)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, usageErr("%v", err)
	}
	return set, nil
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}
