package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
)

func newWatchCmd() *cobra.Command {
	var (
		nf     natsFlags
		tenant string
		name   string
		output string
		all    bool
		since  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "watch",
		Short: "Print result events as they arrive",
		Long: `Print result events as they arrive, optionally filtered by tenant and
name. With -o json each result is printed as one line of JSON: its data,
the same object ` + "`buildq submit --wait -o json`" + ` prints. Stops on Ctrl-C.

Without --all or --since it subscribes to buildq.results.<tenant>.<name>
(core NATS), which a tenant's NATS user may do for its own tenant (pass
--tenant). --all and --since replay the BUILDQ_RESULTS stream through the
JetStream API, which needs an operator's permissions.

A watch misses nothing across a NATS restart or a lost connection: it
keeps reconnecting, and once back it fetches the results stored after the
last one it printed — a tenant's from its stored-results service
(buildq.api.results.<tenant>, answered by the workers), an operator's from
the stream — and prints those it had not, each result once. When the
stream no longer holds them (older than its max age) it says so on stderr.`,
		Example: `  buildq watch
  buildq watch --tenant acme --name web -o json
  buildq watch --all            # replay everything stored first (operators)`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := bindEnv(cmd, natsEnv); err != nil {
				return err
			}
			if output != "text" && output != "json" {
				return usageErr("-o must be text or json, got %q", output)
			}
			f := publisher.Filter{Tenant: tenant, Name: name, DeliverAll: all}
			if since > 0 {
				f.Since = time.Now().Add(-since)
			}
			if err := f.Validate(); err != nil {
				return usageErr("%v", err)
			}
			nf.name = "buildq-watch"
			// A watch outlives a NATS restart: reconnect for as long as it
			// runs (it fills the gap once back).
			nc, err := nf.connect(nats.MaxReconnects(-1), nats.ReconnectWait(time.Second))
			if err != nil {
				return err
			}
			defer nc.Close()
			pub, err := publisher.New(nc)
			if err != nil {
				return failed(err)
			}
			out, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			show := func(r v1.Result) error { return printWatched(out, r, output == "json") }
			if f.DeliverAll || !f.Since.IsZero() {
				err = pub.Watch(cmd.Context(), f, show)
			} else {
				err = pub.Follow(cmd.Context(), f, show, publisher.OnGap(func(g publisher.Gap) {
					reportGap(stderr, g)
				}))
			}
			if err != nil && !errors.Is(err, context.Canceled) {
				return failed(err)
			}
			return nil
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVar(&tenant, "tenant", "", "only this tenant")
	cmd.Flags().StringVar(&name, "name", "", "only this build name")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json (one result's data per line, as submit -o json prints it)")
	cmd.Flags().BoolVar(&all, "all", false, "replay every stored result first")
	cmd.Flags().DurationVar(&since, "since", 0, "replay results of the last D first (e.g. 1h)")
	return cmd
}

// printWatched prints one result of a watch: a line of text, or its data
// as one line of JSON (the object submit -o json prints).
func printWatched(out io.Writer, r v1.Result, asJSON bool) error {
	d := r.Data
	if asJSON {
		b, err := json.Marshal(d)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(out, string(b))
		return err
	}
	line := fmt.Sprintf("%s  %s/%s  %-9s", r.Time.Local().Format("2006-01-02 15:04:05"), d.Tenant, d.Name, d.Status)
	if d.Status == v1.StatusSucceeded {
		line += fmt.Sprintf(" %-8s %s", d.Origin, d.ImageRef)
	} else {
		line += fmt.Sprintf(" %s: %s", d.Reason, d.Message)
	}
	_, err := fmt.Fprintf(out, "%s  (request %s)\n", line, d.RequestID)
	return err
}

// reportGap tells on stderr what a watch did after a reconnection.
func reportGap(stderr io.Writer, g publisher.Gap) {
	from := fmt.Sprintf("after stream sequence %d", g.AfterSeq)
	if g.AfterSeq == 0 {
		from = "since " + g.Since.Local().Format("15:04:05")
	}
	if g.Err != nil {
		fmt.Fprintf(stderr, "buildq watch: reconnected; %d missed result(s) printed, but not every result stored %s could be fetched: %v\n", g.Replayed, from, g.Err)
		return
	}
	fmt.Fprintf(stderr, "buildq watch: reconnected; %d result(s) published while disconnected printed (stored %s)\n", g.Replayed, from)
}

func newStatusCmd() *cobra.Command {
	var (
		nf     natsFlags
		output string
		tenant string
	)
	cmd := &cobra.Command{
		Use:   "status KEY|REQUEST_ID",
		Short: "Show the state of a build key or a request",
		Long: `Show what buildq knows of a build key (64 hex digits: the claim or the
indexed image) or of a request id (its state, build key and result).
Request ids are per tenant: --tenant names the tenant, and a worker answers
on buildq.api.status.<tenant> with that tenant's requests and builds only.`,
		Args: exactArgs(1, "KEY|REQUEST_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bindEnv(cmd, natsEnv); err != nil {
				return err
			}
			if output != "text" && output != "json" {
				return usageErr("-o must be text or json, got %q", output)
			}
			if p := v1.DNSLabelProblem(tenant); p != "" {
				return usageErr("--tenant %s", p)
			}
			nf.name = "buildq-status"
			nc, err := nf.connect()
			if err != nil {
				return err
			}
			defer nc.Close()
			var view v1.StatusReply
			if err := apiRequest(cmd.Context(), nc, tenant, v1.APIStatusSubject(tenant), args[0], &view); err != nil {
				return err
			}
			if view.Error != "" {
				return failed(errors.New(view.Error))
			}
			if output == "json" {
				return writeJSON(cmd.OutOrStdout(), view)
			}
			out := cmd.OutOrStdout()
			if r := view.Request; r != nil {
				fmt.Fprintf(out, "request  %s (%s/%s)\nstate    %s", r.RequestID, r.Tenant, r.Name, r.State)
				if r.Origin != "" {
					fmt.Fprintf(out, " (%s)", r.Origin)
				}
				if r.Reason != "" {
					fmt.Fprintf(out, " %s", r.Reason)
				}
				if r.Digest != "" {
					fmt.Fprintf(out, "\ndigest   %s", r.Digest)
				}
				if src := r.Source; src != nil {
					fmt.Fprintf(out, "\nsource   %s@%s (%s), context %s", src.GitURL, src.Commit, cmp.Or(src.Ref, "commit"), src.ContextDigest)
				}
				fmt.Fprintf(out, "\nupdated  %s by %s\n", r.UpdatedAt.Local().Format(time.RFC3339), r.Worker)
			}
			if view.Key != "" {
				fmt.Fprintf(out, "key      %s\n", view.Key)
			}
			if b := view.Build; b != nil {
				fmt.Fprintf(out, "build    %s", b.State)
				if b.Reason != "" {
					fmt.Fprintf(out, " (%s: %s)", b.Reason, b.Message)
				}
				fmt.Fprintln(out)
				if b.Job != "" {
					fmt.Fprintf(out, "job      %s\n", b.Job)
				}
				if b.Digest != "" {
					fmt.Fprintf(out, "image    %s@%s\n", b.Repository, b.Digest)
				}
				if b.Attestation != "" {
					fmt.Fprintf(out, "provenance %s\n", b.Attestation)
				}
				printPlatforms(out, "platform ", b.Platforms)
				if b.State == v1.StateBuilding && b.Owner != "" {
					fmt.Fprintf(out, "owner    %s\n", b.Owner)
				}
			}
			return nil
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json")
	cmd.Flags().StringVar(&tenant, "tenant", "default", "tenant whose request or build to show")
	return cmd
}

// apiRequest sends target to a tenant API subject and decodes the reply.
func apiRequest(ctx context.Context, nc *nats.Conn, tenant, subject, target string, reply any) error {
	if target == "" || len(target) > v1.MaxRequestIDLen {
		return usageErr("%q is neither a build key (64 hex digits) nor a request id", target)
	}
	pub, err := publisher.New(nc)
	if err != nil {
		return failed(err)
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	msg, err := pub.TenantRequest(ctx, tenant, subject, []byte(target))
	if err != nil {
		return failed(err)
	}
	if err := json.Unmarshal(msg.Data, reply); err != nil {
		return failed(fmt.Errorf("unreadable reply on %s: %w", subject, err))
	}
	return nil
}

func newCancelCmd() *cobra.Command {
	var (
		nf     natsFlags
		tenant string
		output string
		wait   bool
	)
	cmd := &cobra.Command{
		Use:   "cancel KEY|REQUEST_ID",
		Short: "Cancel a request, or the tenant's requests waiting on a build",
		Long: `Cancel one of the tenant's requests (by request id), or all of the
tenant's requests waiting on a build key. Each gets the result "canceled".
The build itself is stopped (its Job deleted) only when no other request —
of any tenant — still waits on it. --tenant names the tenant; a worker
answers on buildq.api.cancel.<tenant>.

The answer comes once each request's "canceled" result is stored: the
worker that answers publishes it. A request whose build's result was
stored before it keeps that result, and the answer says the request had
finished. If a "canceled" could not be confirmed stored, the answer says
so, and the request's result event says how it ended. --wait waits for
the result and prints it (a request id only).`,
		Args: exactArgs(1, "KEY|REQUEST_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bindEnv(cmd, natsEnv); err != nil {
				return err
			}
			if p := v1.DNSLabelProblem(tenant); p != "" {
				return usageErr("--tenant %s", p)
			}
			if output != "text" && output != "json" {
				return usageErr("-o must be text or json, got %q", output)
			}
			nf.name = "buildq-cancel"
			nc, err := nf.connect()
			if err != nil {
				return err
			}
			defer nc.Close()
			var rep v1.CancelReply
			if err := apiRequest(cmd.Context(), nc, tenant, v1.APICancelSubject(tenant), args[0], &rep); err != nil {
				return err
			}
			var result *v1.Result
			if wait && rep.Canceled {
				if rep.Key == args[0] {
					return usageErr("--wait needs a request id; %s is a build key", args[0])
				}
				pub, err := publisher.New(nc)
				if err != nil {
					return failed(err)
				}
				ctx, cancel := context.WithTimeout(cmd.Context(), 2*time.Minute)
				defer cancel()
				if result, err = pub.Wait(ctx, tenant, "", args[0], time.Time{}); err != nil {
					return failed(fmt.Errorf("the cancel is recorded, but its result did not come: %w", err))
				}
			}
			if output == "json" {
				out := struct {
					v1.CancelReply
					Result *v1.ResultData `json:"result,omitempty"`
				}{CancelReply: rep}
				if result != nil {
					out.Result = &result.Data
				}
				if err := writeJSON(cmd.OutOrStdout(), out); err != nil {
					return failed(err)
				}
			} else {
				msg := rep.Message
				switch {
				case result != nil:
					msg += fmt.Sprintf("; request %s's result: %s", args[0], result.Data.Status)
				case rep.Canceled && !wait:
					msg += " (--wait prints the request's result)"
				}
				fmt.Fprintln(cmd.OutOrStdout(), msg)
			}
			if !rep.Canceled {
				return &exitError{code: exitFailed, err: errors.New("")}
			}
			return nil
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVar(&tenant, "tenant", "default", "tenant whose requests to cancel")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json (the reply, and with --wait the result's data)")
	cmd.Flags().BoolVar(&wait, "wait", false, "wait for the canceled request's result (request ids only)")
	return cmd
}
