package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
)

// logsTimings are how `buildq logs` waits for the logs service.
type logsTimings struct {
	// grace is how long a request may take beyond the wait it asks for
	// before it counts as lost and is sent again.
	grace time.Duration
	// retryMin and retryMax bound the pause before a lost request is
	// sent again (doubling from retryMin).
	retryMin, retryMax time.Duration
	// giveUp: with no reply at all for this long, the command fails.
	giveUp time.Duration
}

// logsTiming is what the command uses; tests shorten it.
var logsTiming = logsTimings{grace: 10 * time.Second, retryMin: 250 * time.Millisecond, retryMax: 5 * time.Second, giveUp: 2 * time.Minute}

func newLogsCmd() *cobra.Command {
	var (
		nf         natsFlags
		tenant     string
		output     string
		follow     bool
		since      time.Duration
		timestamps bool
	)
	cmd := &cobra.Command{
		Use:   "logs ID",
		Short: "Print the log of a build",
		Long: `Print the log of a build: what the executor printed, byte for byte, and
the lines buildq itself wrote into it (claimed, attempts, truncation, the
end), shown as "[buildq] ...".

ID is one of the tenant's request ids or a build key (64 hex digits). A
request answered by a build it did not start — it joined a build already
running, or it was answered from the cache — shows that build's log,
headed by a note that says so.

Without -f it prints the log as far as it goes now and exits 0. With -f it
follows the log until the build ends, then exits with the build's outcome:
0 if it succeeded, 1 if it failed or was canceled (the state and reason on
stderr). If the connection to NATS is lost it keeps asking, and resumes
where it left off, for up to 2 minutes.

Logs are served by the workers' tenant API, on buildq.api.logs.<tenant>
(--tenant names the tenant), and only to a tenant one of whose requests the
build answered; a tenant never reads the log stream itself. With -o json
each line is one JSON object {"time","stream","attempt","own","text"}
(text with invalid UTF-8 replaced; then "raw" holds the bytes, base64),
preceded by {"note": ...} and, when the log ended, followed by
{"done": true, "state": ..., "reason": ...}.`,
		Example: `  buildq logs 01J9Z3Y8X6V5W4T3S2R1Q0P9N8 --tenant acme
  buildq logs 01J9Z3Y8X6V5W4T3S2R1Q0P9N8 --tenant acme -f
  buildq logs KEY --tenant acme --since 10m --timestamps
  buildq logs ID --tenant acme -o json | jq -r .text`,
		Args: exactArgs(1, "ID"),
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
			if since < 0 {
				return usageErr("--since must not be negative, got %s", since)
			}
			target := args[0]
			if target == "" || len(target) > v1.MaxRequestIDLen {
				return usageErr("%q is neither a build key (64 hex digits) nor a request id", target)
			}
			req := v1.LogsRequest{Target: target}
			if since > 0 {
				req.Since = time.Now().Add(-since)
			}
			if follow {
				req.WaitMs = v1.MaxLogsWait.Milliseconds()
			}
			l := &logsRun{
				tenant: tenant, subject: v1.APILogsSubject(tenant), timing: logsTiming,
				stderr: cmd.ErrOrStderr(), out: bufio.NewWriter(cmd.OutOrStdout()),
				json: output == "json", timestamps: timestamps, follow: follow,
			}
			nf.name = "buildq-logs"
			// Reconnect for as long as it takes (the command gives up by
			// itself, logsTimings.giveUp); a request in flight when the
			// connection drops is lost: ask again, without waiting it out.
			nc, err := nf.connect(nats.MaxReconnects(-1), nats.DisconnectErrHandler(func(*nats.Conn, error) { l.dropRequest() }))
			if err != nil {
				return err
			}
			defer nc.Close()
			if l.pub, err = publisher.New(nc); err != nil {
				return failed(err)
			}
			err = l.run(cmd.Context(), req)
			if ferr := l.out.Flush(); err == nil && ferr != nil {
				err = failed(ferr)
			}
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVar(&tenant, "tenant", "default", "tenant whose request or build's log to show")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text (the log's lines) or json (one object per line)")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "follow the log until the build ends; exit 0 if it succeeded, 1 otherwise")
	cmd.Flags().DurationVar(&since, "since", 0, "only lines of the last D (e.g. 10m)")
	cmd.Flags().BoolVar(&timestamps, "timestamps", false, "prefix each line with its time (RFC 3339, UTC)")
	return cmd
}

// logsRun is one `buildq logs`: it asks the logs service page after page
// and prints what comes.
type logsRun struct {
	pub     *publisher.Client
	tenant  string
	subject string
	timing  logsTimings
	stderr  io.Writer
	out     *bufio.Writer

	json, timestamps, follow bool

	noted bool // the note is printed
	// answered: a reply came; lastReply is when the last one did; lost:
	// the notice of a lost connection is printed since.
	answered  bool
	lastReply time.Time
	lost      bool
	line      []byte

	mu     sync.Mutex
	cancel context.CancelFunc // ends the request in flight
}

// dropRequest ends the request in flight, if any: its reply is lost.
func (l *logsRun) dropRequest() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cancel != nil {
		l.cancel()
	}
}

func (l *logsRun) run(ctx context.Context, req v1.LogsRequest) error {
	l.lastReply = time.Now()
	for {
		asked := time.Now()
		rep, err := l.page(ctx, req)
		if err != nil {
			return err
		}
		if rep.Error != "" {
			return failed(errors.New(rep.Error))
		}
		if rep.Note != "" && !l.noted {
			l.noted = true
			if err := l.note(rep.Note); err != nil {
				return failed(err)
			}
		}
		if err := l.lines(rep.Data); err != nil {
			return err
		}
		if rep.Done {
			if l.json {
				if err := l.writeJSON(logsDone{Done: true, State: rep.State, Reason: rep.Reason}); err != nil {
					return failed(err)
				}
			}
			if !l.follow || rep.State == string(v1.StatusSucceeded) {
				return nil
			}
			if err := l.out.Flush(); err != nil {
				return failed(err)
			}
			return failed(buildEnded(rep))
		}
		if len(rep.Data) > 0 && (rep.Cursor == "" || rep.Cursor == req.Cursor) {
			// The same cursor again would print the same lines again.
			return failed(fmt.Errorf("the logs service on %s sent lines without a new cursor", l.subject))
		}
		if rep.Cursor != "" {
			req.Cursor = rep.Cursor
		}
		if err := l.out.Flush(); err != nil {
			return failed(err)
		}
		if !l.follow {
			if len(rep.Data) == 0 {
				return nil
			}
			continue
		}
		// Nothing new, sooner than the wait asked for: do not ask again
		// at once.
		if len(rep.Data) == 0 && time.Since(asked) < l.timing.retryMin {
			if err := sleepCtx(ctx, l.timing.retryMin); err != nil {
				return err
			}
		}
	}
}

// buildEnded says how a build that did not succeed ended.
func buildEnded(rep v1.LogsReply) error {
	state := rep.State
	if state == "" {
		state = "ended without a state"
	}
	if rep.Reason != "" {
		return fmt.Errorf("build %s: %s", state, rep.Reason)
	}
	return fmt.Errorf("build %s", state)
}

// page sends req until a reply comes: a request lost (no reply in time, no
// worker answering for a moment, the connection down) is sent again, with
// the same cursor, after a pause that doubles from timing.retryMin to
// timing.retryMax, until timing.giveUp has passed without any reply.
func (l *logsRun) page(ctx context.Context, req v1.LogsRequest) (v1.LogsReply, error) {
	var rep v1.LogsReply
	payload, err := json.Marshal(req)
	if err != nil {
		return rep, failed(err)
	}
	pause := l.timing.retryMin
	for {
		rctx, cancel := context.WithTimeout(ctx, time.Duration(req.WaitMs)*time.Millisecond+l.timing.grace)
		l.mu.Lock()
		l.cancel = cancel
		l.mu.Unlock()
		msg, err := l.pub.TenantRequest(rctx, l.tenant, l.subject, payload)
		l.mu.Lock()
		l.cancel = nil
		l.mu.Unlock()
		cancel()
		if err == nil {
			if err := json.Unmarshal(msg.Data, &rep); err != nil {
				return rep, failed(fmt.Errorf("unreadable reply on %s: %w", l.subject, err))
			}
			l.answered, l.lastReply, l.lost = true, time.Now(), false
			return rep, nil
		}
		if ctx.Err() != nil {
			return rep, ctx.Err()
		}
		switch {
		case errors.Is(err, nats.ErrPermissionViolation), errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrAuthorization):
			return rep, failed(err)
		case !l.answered && (errors.Is(err, nats.ErrNoResponders) || errors.Is(err, publisher.ErrNoWorkers)):
			// Nothing to resume: no worker serves this tenant's logs.
			return rep, failed(fmt.Errorf("no worker answers %s: is a worker running, one that serves build logs?", l.subject))
		}
		waited := time.Since(l.lastReply)
		if waited >= l.timing.giveUp {
			return rep, failed(fmt.Errorf("no answer from the logs service on %s for %s, giving up: %w", l.subject, waited.Round(time.Second), err))
		}
		if !l.lost {
			l.lost = true
			if err := l.out.Flush(); err != nil {
				return rep, failed(err)
			}
			fmt.Fprintln(l.stderr, "buildq logs: connection lost; resuming…")
		}
		if err := sleepCtx(ctx, min(pause, l.timing.giveUp-waited)); err != nil {
			return rep, err
		}
		pause = min(2*pause, l.timing.retryMax)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// The objects of -o json.
type (
	logsNote struct {
		Note string `json:"note"`
	}
	logsLine struct {
		Time    time.Time `json:"time"`
		Stream  string    `json:"stream"`
		Attempt int       `json:"attempt"`
		Own     bool      `json:"own"`
		// Text is the line as a string, invalid UTF-8 replaced (U+FFFD);
		// Raw, only then, the bytes as printed.
		Text string `json:"text"`
		Raw  []byte `json:"raw,omitempty"`
	}
	logsDone struct {
		Done   bool   `json:"done"`
		State  string `json:"state"`
		Reason string `json:"reason"`
	}
)

func (l *logsRun) note(note string) error {
	if l.json {
		return l.writeJSON(logsNote{Note: note})
	}
	_, err := fmt.Fprintf(l.out, "[buildq] %s\n", note)
	return err
}

// lines prints the lines of data (the stored format): the executor's
// text as it is, byte for byte; buildq's own lines after "[buildq] ".
func (l *logsRun) lines(data []byte) error {
	var werr error
	err := v1.EachLogLine(data, func(line v1.LogLine) bool {
		if l.json {
			o := logsLine{Time: line.Time.UTC(), Stream: line.Stream, Attempt: line.Attempt, Own: line.Own(), Text: string(line.Text)}
			if !utf8.Valid(line.Text) {
				o.Raw = line.Text
			}
			werr = l.writeJSON(o)
			return werr == nil
		}
		b := l.line[:0]
		if l.timestamps {
			b = line.Time.UTC().AppendFormat(b, time.RFC3339Nano)
			b = append(b, ' ')
		}
		if line.Own() {
			b = append(b, "[buildq] "...)
		}
		b = append(b, line.Text...)
		b = append(b, '\n')
		l.line = b
		_, werr = l.out.Write(b)
		return werr == nil
	})
	if werr != nil {
		return failed(werr)
	}
	if err != nil {
		return failed(fmt.Errorf("the logs service on %s: %w", l.subject, err))
	}
	return nil
}

func (l *logsRun) writeJSON(v any) error {
	enc := json.NewEncoder(l.out)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}
