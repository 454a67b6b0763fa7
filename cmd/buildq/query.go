package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
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
		Long: `Print the result events of BUILDQ_RESULTS as they arrive, optionally
filtered by tenant and name. With -o json each event is printed as one line
of JSON (the full CloudEvent). Stops on Ctrl-C.`,
		Example: `  buildq watch
  buildq watch --tenant acme --name web -o json
  buildq watch --all            # replay everything stored first`,
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
			nc, err := nf.connect()
			if err != nil {
				return err
			}
			defer nc.Close()
			pub, err := publisher.New(nc)
			if err != nil {
				return failed(err)
			}
			out := cmd.OutOrStdout()
			err = pub.Watch(cmd.Context(), f, func(r v1.Result) error {
				if output == "json" {
					b, err := json.Marshal(r)
					if err != nil {
						return err
					}
					_, err = fmt.Fprintln(out, string(b))
					return err
				}
				d := r.Data
				line := fmt.Sprintf("%s  %s/%s  %-9s", r.Time.Local().Format("2006-01-02 15:04:05"), d.Tenant, d.Name, d.Status)
				if d.Status == v1.StatusSucceeded {
					line += fmt.Sprintf(" %-8s %s", d.Origin, d.ImageRef)
				} else {
					line += fmt.Sprintf(" %s: %s", d.Reason, d.Message)
				}
				_, err := fmt.Fprintf(out, "%s  (request %s)\n", line, d.RequestID)
				return err
			})
			if err != nil && !errors.Is(err, context.Canceled) {
				return failed(err)
			}
			return nil
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVar(&tenant, "tenant", "", "only this tenant")
	cmd.Flags().StringVar(&name, "name", "", "only this build name")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json (one CloudEvent per line)")
	cmd.Flags().BoolVar(&all, "all", false, "replay every stored result first")
	cmd.Flags().DurationVar(&since, "since", 0, "replay results of the last D first (e.g. 1h)")
	return cmd
}

// statusView is what `buildq status` prints.
type statusView struct {
	Key     string               `json:"key,omitempty"`
	Request *worker.RequestEntry `json:"request,omitempty"`
	Build   *worker.Record       `json:"build,omitempty"`
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
Request ids are per tenant: --tenant names the request's tenant.`,
		Args: exactArgs(1, "KEY|REQUEST_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bindEnv(cmd, natsEnv); err != nil {
				return err
			}
			if output != "text" && output != "json" {
				return usageErr("-o must be text or json, got %q", output)
			}
			nf.name = "buildq-status"
			nc, view, err := connectAndLookup(cmd.Context(), &nf, tenant, args[0])
			if err != nil {
				return err
			}
			defer nc.Close()
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
				if b.State == worker.StateBuilding && b.Owner != "" {
					fmt.Fprintf(out, "owner    %s (lease until %s)\n", b.Owner, b.LeaseUntil.Local().Format(time.RFC3339))
				}
			} else if view.Key != "" {
				fmt.Fprintln(out, "build    not started")
			}
			return nil
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text or json")
	cmd.Flags().StringVar(&tenant, "tenant", "default", "tenant of the request id")
	return cmd
}

// connectAndLookup connects to NATS and resolves target; the caller closes
// the connection.
func connectAndLookup(ctx context.Context, nf *natsFlags, tenant, target string) (*nats.Conn, *statusView, error) {
	nc, err := nf.connect()
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, failed(err)
	}
	view, err := lookup(ctx, js, tenant, target)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, view, nil
}

// lookup resolves a key, or a tenant's request id, through the KV buckets.
func lookup(ctx context.Context, js jetstream.JetStream, tenant, target string) (*statusView, error) {
	builds, err := js.KeyValue(ctx, v1.BuildsBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, failed(publisher.ErrNoWorkers)
	}
	if err != nil {
		return nil, failed(err)
	}
	view := &statusView{}
	key := target
	if !worker.IsBuildKey(target) {
		if len(target) > v1.MaxRequestIDLen || target == "" {
			return nil, usageErr("%q is neither a build key (64 hex digits) nor a request id", target)
		}
		reqs, err := js.KeyValue(ctx, worker.RequestsBucket)
		if err != nil {
			return nil, failed(err)
		}
		e, err := reqs.Get(ctx, worker.RequestIndexKey(tenant, target))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil, failed(fmt.Errorf("no request %s of tenant %s is known (still queued, of another tenant — see --tenant — or older than the results' max age)", target, tenant))
		}
		if err != nil {
			return nil, failed(err)
		}
		var re worker.RequestEntry
		if err := json.Unmarshal(e.Value(), &re); err != nil {
			return nil, failed(err)
		}
		view.Request = &re
		key = re.Key
	}
	view.Key = key
	if key == "" {
		return view, nil
	}
	e, err := builds.Get(ctx, key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		if view.Request == nil {
			return nil, failed(fmt.Errorf("no build is known for key %s", key))
		}
	case err != nil:
		return nil, failed(err)
	default:
		var rec worker.Record
		if err := json.Unmarshal(e.Value(), &rec); err != nil {
			return nil, failed(err)
		}
		view.Build = &rec
	}
	return view, nil
}

func newCancelCmd() *cobra.Command {
	var (
		nf     natsFlags
		tenant string
	)
	cmd := &cobra.Command{
		Use:   "cancel KEY|REQUEST_ID",
		Short: "Cancel a running build",
		Long: `Cancel the build of a key, or the build a request is waiting on. The build
is stopped (its Job deleted) and every request waiting on it gets the result
"canceled". Request ids are per tenant: --tenant names the request's tenant.`,
		Args: exactArgs(1, "KEY|REQUEST_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bindEnv(cmd, natsEnv); err != nil {
				return err
			}
			nf.name = "buildq-cancel"
			nc, view, err := connectAndLookup(cmd.Context(), &nf, tenant, args[0])
			if err != nil {
				return err
			}
			defer nc.Close()
			tenant, name := tenant, "_"
			if view.Request != nil {
				tenant, name = view.Request.Tenant, view.Request.Name
			} else if view.Build != nil && view.Build.Tenant != "" {
				tenant, name = view.Build.Tenant, view.Build.Name
			}
			msg, err := nc.Request(v1.CancelSubject(tenant, name), []byte(view.Key), 20*time.Second)
			if err != nil {
				return failed(fmt.Errorf("no worker answered the cancel request: %w", err))
			}
			var rep worker.CancelReply
			if err := json.Unmarshal(msg.Data, &rep); err != nil {
				return failed(fmt.Errorf("unreadable cancel reply: %w", err))
			}
			fmt.Fprintln(cmd.OutOrStdout(), rep.Message)
			if !rep.Canceled {
				return &exitError{code: exitFailed, err: errors.New("")}
			}
			return nil
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVar(&tenant, "tenant", "default", "tenant of the request id")
	return cmd
}
