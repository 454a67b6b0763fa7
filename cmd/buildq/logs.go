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

// Exit codes of buildq logs besides exitOK (with -f: the build
// succeeded; without: the log was printed) and exitFailed (with -f: the
// build failed or was canceled).
const (
	// exitLogUnread: the log could not be read (the service refused or
	// never answered, NATS is out of reach, the output could not be
	// written): the build's outcome is unknown. DESIGN §6 has 1 for an
	// operation that failed, 2 for invalid input or usage only: stderr
	// tells a failed build from a log not read.
	exitLogUnread = exitFailed
	// exitInterrupted: SIGINT or SIGTERM before the log ended (128 +
	// SIGINT, as a shell reports a command it interrupted).
	exitInterrupted = 130
)

// unread is an error of reading the log (exitLogUnread).
func unread(err error) error { return &exitError{code: exitLogUnread, err: err} }

// logsExit maps the outcome of a `buildq logs` to its exit code: nil
// (0), the followed build's outcome (exitFailed), an interrupt
// (exitInterrupted), or the log not read (exitLogUnread).
func logsExit(ctx context.Context, err error, follow bool) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		msg := "interrupted"
		if follow {
			msg = "interrupted: stopped following the log (the build itself is not canceled)"
		}
		return &exitError{code: exitInterrupted, err: errors.New(msg)}
	}
	var outcome buildOutcome
	if errors.As(err, &outcome) {
		return err
	}
	var ee *exitError
	if errors.As(err, &ee) {
		if ee.code == exitLogUnread {
			return err
		}
		return unread(ee.err)
	}
	return unread(err)
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
		Long: `Print the log of a build: what the executor printed, and the lines
buildq itself wrote into it (claimed, attempts, truncation, the end),
shown as "[buildq] ...". The executor's lines are kept byte for byte,
except lines over about 64 KiB: those are stored split into pieces of
about 64 KiB, each printed as a line of its own.

ID is one of the tenant's request ids or a build key (64 hex digits). A
request answered by a build it did not start — it joined a build already
running, or it was answered from the cache — shows that build's log,
headed by a note that says so.

Without -f it prints the log as far as it goes now and exits 0. With -f it
follows the log until the build ends, then exits with the build's outcome
(the state and reason on stderr when it did not succeed). If the
connection to NATS is lost it keeps asking, and resumes where it left off,
for up to 2 minutes. A build that stored no log (built before build logs
were kept, or by a worker with --build-logs=false) has nothing to show:
the command says so on stderr and ends as for any other log.

Logs are served by the workers' tenant API, on buildq.api.logs.<tenant>
(--tenant names the tenant), and only to a tenant one of whose requests the
build answered, claimed it or waits on it; a tenant never reads the log
stream itself. With -o json each line is one JSON object
{"time","stream","attempt","own","text"} (text with invalid UTF-8
replaced; then "raw" holds the bytes, base64), preceded by {"note": ...}
and, when the log ended, followed by {"done": true, "state": ...,
"reason": ...}.

Exit codes:
  0    with -f: the build succeeded, or built nothing because its
       first tag already held an image (its requests look again: stderr
       says so); without -f: the log was printed, whatever the build's
       outcome
  1    with -f: the build failed or was canceled; or the log
       could not be read (unknown request or build, no worker
       answering, NATS out of reach, a log no longer kept): stderr
       says which
  2    invalid input or usage
  130  interrupted (SIGINT or SIGTERM) before the log ended; the build
       itself is not canceled`,
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
				return logsExit(cmd.Context(), err, follow)
			}
			defer nc.Close()
			if l.pub, err = publisher.New(nc); err != nil {
				return logsExit(cmd.Context(), err, follow)
			}
			err = l.run(cmd.Context(), req)
			if ferr := l.out.Flush(); err == nil && ferr != nil {
				err = unread(ferr)
			}
			return logsExit(cmd.Context(), err, follow)
		},
	}
	nf.register(cmd.Flags())
	cmd.Flags().StringVar(&tenant, "tenant", "default", "tenant whose request or build's log to show")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output: text (the log's lines) or json (one object per line)")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "follow the log until the build ends; exit 0 if it succeeded, 1 if not (see Exit codes)")
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
		if rep.Error != "" && !rep.Done {
			return unread(errors.New(rep.Error))
		}
		if rep.Note != "" && !l.noted {
			l.noted = true
			if err := l.note(rep.Note); err != nil {
				return unread(err)
			}
		}
		if err := l.lines(rep.Data); err != nil {
			return err
		}
		if rep.Done {
			if err := l.out.Flush(); err != nil {
				return unread(err)
			}
			if rep.Error != "" {
				// Over, with nothing (more) to show: the service says why
				// (the build stored no log).
				fmt.Fprintf(l.stderr, "buildq logs: %s\n", rep.Error)
			}
			if l.json {
				if err := l.writeJSON(logsDone{Done: true, State: rep.State, Reason: rep.Reason}); err != nil {
					return unread(err)
				}
			}
			if !l.follow || rep.State == string(v1.StatusSucceeded) {
				return nil
			}
			if rep.Reason == v1.ReasonTagTaken {
				// The run built nothing and answers nobody: its requests
				// go on (docs/design.md, "The dedupe index").
				fmt.Fprintf(l.stderr, "buildq logs: nothing is recorded as built: the build's first tag already held an image when it started, or its Pod was gone before its digest was read; its requests look again (most are answered with the image at their tag) — see buildq status\n")
				return nil
			}
			if err := l.out.Flush(); err != nil {
				return unread(err)
			}
			return failed(buildEnded(rep))
		}
		if len(rep.Data) > 0 && (rep.Cursor == "" || rep.Cursor == req.Cursor) {
			// The same cursor again would print the same lines again.
			return unread(fmt.Errorf("the logs service on %s sent lines without a new cursor", l.subject))
		}
		if rep.Cursor != "" {
			req.Cursor = rep.Cursor
		}
		if err := l.out.Flush(); err != nil {
			return unread(err)
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

// buildOutcome is how a followed build that did not succeed ended: the
// one error of buildq logs that is not the command's own (exitFailed).
type buildOutcome struct{ state, reason string }

func (b buildOutcome) Error() string {
	if b.reason != "" {
		return "build " + b.state + ": " + b.reason
	}
	return "build " + b.state
}

// buildEnded says how a build that did not succeed ended.
func buildEnded(rep v1.LogsReply) error {
	state := rep.State
	if state == "" {
		state = "ended without a state"
	}
	return buildOutcome{state: state, reason: rep.Reason}
}

// page sends req until a reply comes: a request lost (no reply in time, no
// worker answering for a moment, the connection down) is sent again, with
// the same cursor, after a pause that doubles from timing.retryMin to
// timing.retryMax, until timing.giveUp has passed without any reply.
func (l *logsRun) page(ctx context.Context, req v1.LogsRequest) (v1.LogsReply, error) {
	var rep v1.LogsReply
	payload, err := json.Marshal(req)
	if err != nil {
		return rep, unread(err)
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
				return rep, unread(fmt.Errorf("unreadable reply on %s: %w", l.subject, err))
			}
			l.answered, l.lastReply, l.lost = true, time.Now(), false
			return rep, nil
		}
		if ctx.Err() != nil {
			return rep, ctx.Err()
		}
		switch {
		case errors.Is(err, nats.ErrPermissionViolation), errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrAuthorization):
			return rep, unread(err)
		case !l.answered && (errors.Is(err, nats.ErrNoResponders) || errors.Is(err, publisher.ErrNoWorkers)):
			// Nothing to resume: no worker serves this tenant's logs.
			return rep, unread(fmt.Errorf("no worker answers %s: is a worker running, one that serves build logs?", l.subject))
		}
		waited := time.Since(l.lastReply)
		if waited >= l.timing.giveUp {
			return rep, unread(fmt.Errorf("no answer from the logs service on %s for %s, giving up: %w", l.subject, waited.Round(time.Second), err))
		}
		if !l.lost {
			l.lost = true
			if err := l.out.Flush(); err != nil {
				return rep, unread(err)
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
		return unread(werr)
	}
	if err != nil {
		return unread(fmt.Errorf("the logs service on %s: %w", l.subject, err))
	}
	return nil
}

func (l *logsRun) writeJSON(v any) error {
	enc := json.NewEncoder(l.out)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}
