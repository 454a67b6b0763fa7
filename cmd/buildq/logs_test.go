package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

func init() {
	// A lost reply is noticed after a second here, not ten, and the
	// command gives up after five seconds without one.
	logsTiming = logsTimings{grace: time.Second, retryMin: 20 * time.Millisecond, retryMax: 200 * time.Millisecond, giveUp: 5 * time.Second}
}

// logsPage is one step of a fake logs service's script: the cursor the
// request must carry, and the reply (none when drop).
type logsPage struct {
	cursor string
	drop   bool
	reply  v1.LogsReply
}

// fakeLogs is a logs service answering buildq.api.logs.<tenant> from a
// script, one page per request, in order.
type fakeLogs struct {
	t      *testing.T
	mu     sync.Mutex
	pages  []logsPage
	asked  []v1.LogsRequest
	before func(i int) // called before page i is answered (or dropped)
}

func startFakeLogs(t *testing.T, nc *nats.Conn, tenant string, pages ...logsPage) *fakeLogs {
	t.Helper()
	f := &fakeLogs{t: t, pages: pages}
	if _, err := nc.Subscribe(v1.APILogsSubject(tenant), f.serve); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fakeLogs) serve(m *nats.Msg) {
	var req v1.LogsRequest
	if err := json.Unmarshal(m.Data, &req); err != nil {
		f.t.Errorf("the logs request is not JSON: %q", m.Data)
		return
	}
	if !strings.HasPrefix(m.Reply, v1.InboxPrefix("acme")+".") {
		f.t.Errorf("reply subject %q is not under the tenant's inbox", m.Reply)
	}
	f.mu.Lock()
	i := len(f.asked)
	f.asked = append(f.asked, req)
	f.mu.Unlock()
	if i >= len(f.pages) {
		f.t.Errorf("request %d beyond the script: %+v", i, req)
		_ = m.Respond([]byte(`{"error":"the script has ended"}`))
		return
	}
	p := f.pages[i]
	if req.Cursor != p.cursor {
		f.t.Errorf("request %d has cursor %q, want %q", i, req.Cursor, p.cursor)
	}
	if f.before != nil {
		f.before(i)
	}
	if p.drop {
		return
	}
	b, err := json.Marshal(p.reply)
	if err != nil {
		f.t.Error(err)
		return
	}
	_ = m.Respond(b)
}

func (f *fakeLogs) requests() []v1.LogsRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.asked)
}

// logData is lines in the stored format.
func logData(lines ...v1.LogLine) []byte {
	var b []byte
	for _, l := range lines {
		b = v1.AppendLogLine(b, l)
	}
	return b
}

var logT0 = time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC)

func own(sec int, attempt int, text string) v1.LogLine {
	return v1.LogLine{Time: logT0.Add(time.Duration(sec) * time.Second), Stream: v1.LogStreamBuildq, Attempt: attempt, Text: []byte(text)}
}

func exe(sec int, attempt int, text string) v1.LogLine {
	return v1.LogLine{Time: logT0.Add(time.Duration(sec) * time.Second), Stream: "kaniko", Attempt: attempt, Text: []byte(text)}
}

const logsID = "01J9Z3Y8X6V5W4T3S2R1Q0P9N8"

// logsWorld is an embedded NATS server and a connection for the fake.
func logsWorld(t *testing.T) (*testnats.Server, *nats.Conn) {
	t.Helper()
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	nc := ns.Connect(t)
	return ns, nc
}

func logsCLI(t *testing.T, ns *testnats.Server, args ...string) (int, string, string) {
	t.Helper()
	return cli(t, append([]string{"logs", logsID, "--tenant", "acme", "--nats-url", ns.URL()}, args...)...)
}

// Bytes an executor printed that are not UTF-8, with escapes and a
// carriage return: printed exactly.
var rawText = "step \xff\xfe\x80 \x1b[31mred\x1b[0m\tdone\r"

func TestLogsTextPrintsTheLogAsItIs(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	f := startFakeLogs(t, nc, "acme",
		logsPage{cursor: "", reply: v1.LogsReply{Key: "k", Run: "r", Note: "request " + logsID + " joined build k started by another request",
			Data: logData(own(0, 1, "claimed by worker-1"), exe(1, 1, "INFO[0000] Retrieving image"), exe(2, 1, rawText)), Cursor: "c1"}},
		// The note again on a later page is not printed again.
		logsPage{cursor: "c1", reply: v1.LogsReply{Note: "again", Cursor: "c2",
			Data: logData(own(3, 1, "attempt 1 failed: pod evicted"), own(4, 2, "attempt 2"), exe(5, 2, "INFO[0000] Retrieving image"), exe(6, 2, ""))}},
		logsPage{cursor: "c2", reply: v1.LogsReply{Cursor: "c2"}},
	)
	code, stdout, stderr := logsCLI(t, ns)
	if code != 0 || stderr != "" {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	want := "[buildq] request " + logsID + " joined build k started by another request\n" +
		"[buildq] claimed by worker-1\n" +
		"INFO[0000] Retrieving image\n" +
		rawText + "\n" +
		"[buildq] attempt 1 failed: pod evicted\n" +
		"[buildq] attempt 2\n" +
		"INFO[0000] Retrieving image\n" +
		"\n"
	if stdout != want {
		t.Fatalf("stdout:\n%q\nwant:\n%q", stdout, want)
	}
	reqs := f.requests()
	if len(reqs) != 3 {
		t.Fatalf("%d requests, want 3", len(reqs))
	}
	for _, r := range reqs {
		if r.Target != logsID || r.WaitMs != 0 || !r.Since.IsZero() {
			t.Errorf("request %+v: want target %s, no wait, no since", r, logsID)
		}
	}
}

func TestLogsTimestampsAndSince(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	f := startFakeLogs(t, nc, "acme",
		logsPage{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed"), exe(1, 1, rawText)), Cursor: "c1", Done: true, State: "succeeded"}},
	)
	start := time.Now()
	code, stdout, stderr := logsCLI(t, ns, "--timestamps", "--since", "10m")
	if code != 0 || stderr != "" {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	want := "2026-03-04T05:06:07.123456789Z [buildq] claimed\n2026-03-04T05:06:08.123456789Z " + rawText + "\n"
	if stdout != want {
		t.Fatalf("stdout:\n%q\nwant:\n%q", stdout, want)
	}
	reqs := f.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1 (the log ended)", len(reqs))
	}
	if s := reqs[0].Since; s.Before(start.Add(-10*time.Minute-time.Second)) || s.After(time.Now().Add(-10*time.Minute)) {
		t.Fatalf("since %s, want 10 minutes before %s", s, start)
	}
}

func TestLogsFollowEndsWithTheBuild(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		state, reason string
		code          int
		stderr        string
	}{
		{"succeeded", "", 0, ""},
		{"failed", "BuildFailed", 1, "buildq: build failed: BuildFailed\n"},
		{"canceled", "Canceled", 1, "buildq: build canceled: Canceled\n"},
		// A run refused for its tag answers nobody: not the request's end.
		{"failed", "TagTaken", 0, "buildq logs: nothing is recorded as built: the build's first tag already held an image when it started, or its Pod was gone before its digest was read; its requests look again (most are answered with the image at their tag) — see buildq status\n"},
	} {
		t.Run(c.state+"/"+c.reason, func(t *testing.T) {
			t.Parallel()
			ns, nc := logsWorld(t)
			f := startFakeLogs(t, nc, "acme",
				logsPage{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed")), Cursor: "c1"}},
				// A long poll that brought nothing.
				logsPage{cursor: "c1", reply: v1.LogsReply{Cursor: "c1"}},
				logsPage{cursor: "c1", reply: v1.LogsReply{Data: logData(exe(1, 1, "building")), Cursor: "c2"}},
				logsPage{cursor: "c2", reply: v1.LogsReply{Data: logData(own(2, 1, c.state)), Cursor: "c3", Done: true, State: c.state, Reason: c.reason}},
			)
			code, stdout, stderr := logsCLI(t, ns, "-f")
			if code != c.code || stderr != c.stderr {
				t.Fatalf("exit %d, stderr %q; want %d, %q", code, stderr, c.code, c.stderr)
			}
			if want := "[buildq] claimed\nbuilding\n[buildq] " + c.state + "\n"; stdout != want {
				t.Fatalf("stdout %q, want %q", stdout, want)
			}
			for _, r := range f.requests() {
				if r.WaitMs != v1.MaxLogsWait.Milliseconds() {
					t.Errorf("request %+v: want a wait of %s", r, v1.MaxLogsWait)
				}
			}
			if n := len(f.requests()); n != 4 {
				t.Fatalf("%d requests, want 4", n)
			}
		})
	}
}

func TestLogsJSON(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	startFakeLogs(t, nc, "acme",
		logsPage{reply: v1.LogsReply{Note: "answered from the cache: the log of build k", Data: logData(own(0, 1, "claimed")), Cursor: "c1"}},
		logsPage{cursor: "c1", reply: v1.LogsReply{Data: logData(exe(1, 2, rawText), exe(2, 2, "<ok> & done")), Cursor: "c2", Done: true, State: "failed", Reason: "BuildFailed"}},
	)
	code, stdout, stderr := logsCLI(t, ns, "-o", "json")
	if code != 0 || stderr != "" {
		t.Fatalf("exit %d (without -f the outcome is not the exit code), stderr %q", code, stderr)
	}
	lines := strings.Split(strings.TrimSuffix(stdout, "\n"), "\n")
	want := []map[string]any{
		{"note": "answered from the cache: the log of build k"},
		{"time": "2026-03-04T05:06:07.123456789Z", "stream": "buildq", "attempt": 1.0, "own": true, "text": "claimed"},
		{"time": "2026-03-04T05:06:08.123456789Z", "stream": "kaniko", "attempt": 2.0, "own": false,
			"text": "step \uFFFD\uFFFD\uFFFD \x1b[31mred\x1b[0m\tdone\r", "raw": base64.StdEncoding.EncodeToString([]byte(rawText))},
		{"time": "2026-03-04T05:06:09.123456789Z", "stream": "kaniko", "attempt": 2.0, "own": false, "text": "<ok> & done"},
		{"done": true, "state": "failed", "reason": "BuildFailed"},
	}
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), stdout)
	}
	for i, l := range lines {
		var got map[string]any
		if err := json.Unmarshal([]byte(l), &got); err != nil {
			t.Fatalf("line %d is not one JSON object: %v\n%s", i, err, l)
		}
		gb, _ := json.Marshal(got)
		wb, _ := json.Marshal(want[i])
		if !bytes.Equal(gb, wb) {
			t.Errorf("line %d:\n%s\nwant\n%s", i, gb, wb)
		}
	}
	// The replacement is the one encoding/json would make; raw holds the
	// bytes exactly.
	var o struct{ Raw []byte }
	_ = json.Unmarshal([]byte(lines[2]), &o)
	if string(o.Raw) != rawText {
		t.Fatalf("raw %q, want %q", o.Raw, rawText)
	}
	if strings.Contains(lines[4], `\u003c`) {
		t.Error("HTML escaping in the text")
	}
}

// A reply that never comes (a worker gone between pages, a connection
// lost) is asked for again with the same cursor; nothing is printed twice.
func TestLogsDroppedReplyIsRetried(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	f := startFakeLogs(t, nc, "acme",
		logsPage{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed"), exe(1, 1, "one")), Cursor: "c1"}},
		logsPage{cursor: "c1", drop: true},
		logsPage{cursor: "c1", reply: v1.LogsReply{Data: logData(exe(2, 1, "two")), Cursor: "c2"}},
		logsPage{cursor: "c2", drop: true},
		logsPage{cursor: "c2", drop: true},
		logsPage{cursor: "c2", reply: v1.LogsReply{Data: logData(exe(3, 1, "three")), Cursor: "c3", Done: true, State: "succeeded"}},
	)
	code, stdout, stderr := logsCLI(t, ns)
	if code != 0 {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	if want := "[buildq] claimed\none\ntwo\nthree\n"; stdout != want {
		t.Fatalf("stdout %q, want %q", stdout, want)
	}
	// One notice per outage.
	if want := "buildq logs: connection lost; resuming…\nbuildq logs: connection lost; resuming…\n"; stderr != want {
		t.Fatalf("stderr %q, want %q", stderr, want)
	}
	if n := len(f.requests()); n != 6 {
		t.Fatalf("%d requests, want 6", n)
	}
}

// The NATS server restarts in the middle of -f: the command reconnects and
// resumes where it was.
func TestLogsFollowResumesAfterARestart(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	restarted := make(chan error, 1)
	f := startFakeLogs(t, nc, "acme",
		logsPage{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed"), exe(1, 1, "one")), Cursor: "c1"}},
		logsPage{cursor: "c1", drop: true}, // the server goes down instead
		logsPage{cursor: "c1", reply: v1.LogsReply{Data: logData(exe(2, 1, "two")), Cursor: "c2", Done: true, State: "succeeded"}},
	)
	f.before = func(i int) {
		if i == 1 {
			go func() { restarted <- ns.Restart(200 * time.Millisecond) }()
		}
	}
	code, stdout, stderr := logsCLI(t, ns, "-f")
	if err := <-restarted; err != nil {
		t.Fatal(err)
	}
	if code != 0 {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	if want := "[buildq] claimed\none\ntwo\n"; stdout != want {
		t.Fatalf("stdout %q, want %q", stdout, want)
	}
	if !strings.Contains(stderr, "connection lost; resuming") {
		t.Errorf("stderr %q does not say the connection was lost", stderr)
	}
}

func TestLogsErrorReplyFails(t *testing.T) {
	t.Parallel()
	ns, nc := logsWorld(t)
	startFakeLogs(t, nc, "acme",
		logsPage{reply: v1.LogsReply{Error: "request " + logsID + " of tenant acme: not found"}},
	)
	code, stdout, stderr := logsCLI(t, ns, "-f")
	// Exit 2: the log could not be read (not 1, a failed build).
	if code != 1 || stderr != "buildq: request "+logsID+" of tenant acme: not found\n" || stdout != "" {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
}

// Nothing answers at all: with no worker serving logs the command says so
// at once; a service that stops answering is given up on.
func TestLogsGivesUp(t *testing.T) {
	t.Parallel()
	t.Run("no worker", func(t *testing.T) {
		t.Parallel()
		ns, _ := logsWorld(t)
		start := time.Now()
		code, _, stderr := logsCLI(t, ns)
		if code != 1 || stderr != "buildq: no worker answers "+v1.APILogsSubject("acme")+": is a worker running, one that serves build logs?\n" {
			t.Fatalf("exit %d, stderr %q", code, stderr)
		}
		if d := time.Since(start); d > 3*time.Second {
			t.Errorf("took %s", d)
		}
	})
	t.Run("silent service", func(t *testing.T) {
		t.Parallel()
		ns, nc := logsWorld(t)
		pages := []logsPage{{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed")), Cursor: "c1"}}}
		for range 50 {
			pages = append(pages, logsPage{cursor: "c1", drop: true})
		}
		startFakeLogs(t, nc, "acme", pages...)
		start := time.Now()
		code, stdout, stderr := logsCLI(t, ns)
		if code != 1 || stdout != "[buildq] claimed\n" {
			t.Fatalf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
		}
		if !strings.HasPrefix(stderr, "buildq logs: connection lost; resuming…\nbuildq: no answer from the logs service on buildq.api.logs.acme for ") ||
			!strings.Contains(stderr, "giving up") {
			t.Fatalf("stderr %q", stderr)
		}
		if d := time.Since(start); d < logsTiming.giveUp || d > logsTiming.giveUp+logsTiming.grace+3*time.Second {
			t.Errorf("gave up after %s, want about %s", d, logsTiming.giveUp)
		}
	})
}

func TestLogsUsageErrors(t *testing.T) {
	t.Parallel()
	for name, args := range map[string][]string{
		"no id":          {"logs"},
		"two ids":        {"logs", "a", "b"},
		"bad output":     {"logs", logsID, "-o", "yaml"},
		"negative since": {"logs", logsID, "--since", "-10m"},
		"bad since":      {"logs", logsID, "--since", "yesterday"},
		"bad tenant":     {"logs", logsID, "--tenant", "Acme"},
		"long id":        {"logs", strings.Repeat("x", v1.MaxRequestIDLen+1)},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := cli(t, append(args, "--nats-url", "nats://127.0.0.1:1")...)
			if code != 2 || !strings.HasPrefix(stderr, "buildq: ") {
				t.Fatalf("exit %d, stderr %q", code, stderr)
			}
		})
	}
}

func TestLogsHelp(t *testing.T) {
	t.Parallel()
	code, stdout, _ := cli(t, "logs", "--help")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"request id", "build key", "joined", "cache", "note", "buildq.api.logs.<tenant>", "-f", "--since", "--timestamps", "-o",
		"Exit codes", "130", "could not be read", "64 KiB", "stored no log"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("--help does not say %q", want)
		}
	}
}

// --secret-build-arg is a build argument whose name the request lists as
// secret (the worker masks its value in the log).
func TestSecretBuildArg(t *testing.T) {
	t.Parallel()
	f := requestFlags{dockerfile: "Dockerfile", buildArgs: []string{"A=1"}, secretBuildArgs: []string{"TOKEN=s3cr=t", "B="}}
	req, err := f.requestFields("web")
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]string{"A": "1", "TOKEN": "s3cr=t", "B": ""}; !maps.Equal(req.BuildArgs, want) {
		t.Fatalf("build args %v, want %v", req.BuildArgs, want)
	}
	if want := []string{"B", "TOKEN"}; !slices.Equal(req.SecretBuildArgs, want) {
		t.Fatalf("secret build args %v, want %v", req.SecretBuildArgs, want)
	}
	req.Tenant = "acme"
	setSource(req, "buildq", "sha256:"+strings.Repeat("0", 64))
	if err := validate(req); err != nil {
		t.Fatalf("the request does not validate: %v", err)
	}
	// Only secret ones.
	f = requestFlags{dockerfile: "Dockerfile", secretBuildArgs: []string{"TOKEN=x"}}
	if req, err = f.requestFields("web"); err != nil || req.BuildArgs["TOKEN"] != "x" || !slices.Equal(req.SecretBuildArgs, []string{"TOKEN"}) {
		t.Fatalf("%+v %v", req, err)
	}
	// None: no list.
	f = requestFlags{dockerfile: "Dockerfile", buildArgs: []string{"A=1"}}
	if req, err = f.requestFields("web"); err != nil || req.SecretBuildArgs != nil {
		t.Fatalf("%+v %v", req, err)
	}

	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\n"})
	for name, c := range map[string]struct {
		args []string
		want string
	}{
		"also a build arg":           {[]string{"--build-arg", "TOKEN=a", "--secret-build-arg", "TOKEN=b"}, "TOKEN is also given with --build-arg"},
		"also a build arg, same one": {[]string{"--build-arg", "TOKEN=a", "--secret-build-arg", "TOKEN=a"}, "TOKEN is also given with --build-arg"},
		"no value":                   {[]string{"--secret-build-arg", "TOKEN:hunter2"}, "want NAME=VALUE"},
		"no name":                    {[]string{"--secret-build-arg", "=hunter2"}, "want NAME=VALUE"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := cli(t, append([]string{"submit", dir, "--nats-url", "nats://127.0.0.1:1"}, c.args...)...)
			if code != 2 || !strings.Contains(stderr, c.want) {
				t.Fatalf("exit %d, stderr %q; want 2 and %q", code, stderr, c.want)
			}
			if strings.Contains(stderr, "hunter2") || strings.Contains(stderr, "TOKEN=b") {
				t.Errorf("stderr shows a secret value: %q", stderr)
			}
		})
	}
	code, stdout, _ := cli(t, "submit", "--help")
	if code != 0 || !strings.Contains(stdout, "--secret-build-arg") || !strings.Contains(stdout, "masked") {
		t.Errorf("submit --help does not explain --secret-build-arg")
	}
}

// The exit code of buildq logs tells the build's outcome from the
// command's own trouble: 0 the build succeeded (or, without -f, the log
// was printed), 1 it failed or was canceled (with -f), 2 the log could not
// be read (as for invalid usage), 130 the command was interrupted. An
// interrupted follow is never taken for a build that succeeded.
func TestLogsExitCodes(t *testing.T) {
	t.Parallel()
	t.Run("could not read the log", func(t *testing.T) {
		t.Parallel()
		ns, nc := logsWorld(t)
		startFakeLogs(t, nc, "acme",
			logsPage{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed")), Cursor: "c1"}},
			logsPage{cursor: "c1", reply: v1.LogsReply{Error: "the log of run r of build k is no longer kept"}},
		)
		code, stdout, stderr := logsCLI(t, ns, "-f")
		if code != 1 || stdout != "[buildq] claimed\n" || stderr != "buildq: the log of run r of build k is no longer kept\n" {
			t.Fatalf("exit %d, stdout %q, stderr %q; want 1, the lines before, the error", code, stdout, stderr)
		}
	})
	t.Run("no NATS", func(t *testing.T) {
		t.Parallel()
		code, _, stderr := cli(t, "logs", logsID, "--tenant", "acme", "--nats-url", "nats://127.0.0.1:1", "-f")
		if code != 1 || !strings.HasPrefix(stderr, "buildq: ") {
			t.Fatalf("exit %d, stderr %q; want 1", code, stderr)
		}
	})
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		for _, follow := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s, follow %v", sig, follow), func(t *testing.T) {
				// Not parallel: the signal goes to the whole test process,
				// caught here as the command's main catches it.
				ns, nc := logsWorld(t)
				cursor := ""
				if follow {
					cursor = "c1"
				}
				f := startFakeLogs(t, nc, "acme",
					logsPage{reply: v1.LogsReply{Data: logData(own(0, 1, "claimed")), Cursor: "c1"}},
					// Asked for more (with -f: the build goes on; without:
					// the rest of a long log): the answer is held back, and
					// the command is interrupted meanwhile.
					logsPage{cursor: cursor, drop: true},
				)
				ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
				defer stop()
				f.before = func(i int) {
					if i == 1 {
						_ = syscall.Kill(os.Getpid(), sig)
					}
				}
				var out, errb bytes.Buffer
				args := []string{"logs", logsID, "--tenant", "acme", "--nats-url", ns.URL()}
				if follow {
					args = append(args, "-f")
				} else {
					// Without -f a page that brought lines is followed by
					// the next one at once.
					f.pages[1].cursor = "c1"
				}
				done := make(chan int, 1)
				go func() { done <- run(ctx, args, &out, &errb) }()
				select {
				case code := <-done:
					if code != 130 {
						t.Fatalf("exit %d, stdout %q, stderr %q; want 130", code, out.String(), errb.String())
					}
				case <-time.After(30 * time.Second):
					t.Fatal("the interrupted command did not end")
				}
				if out.String() != "[buildq] claimed\n" || !strings.Contains(errb.String(), "interrupted") {
					t.Fatalf("stdout %q, stderr %q", out.String(), errb.String())
				}
			})
		}
	}
}

// A run that is over and stored no log: the logs service says so (done,
// with the error saying why). buildq logs prints that on stderr, with or
// without -f, and ends: with -f with the build's outcome, without it 0.
func TestLogsOfARunThatStoredNoLog(t *testing.T) {
	t.Parallel()
	const why = "the build stored no log (built before build logs were kept, or with --build-logs=false), or it is no longer kept: run r of build k"
	for _, c := range []struct {
		name, state, reason string
		args                []string
		code                int
		stdout, stderr      string
	}{
		{"succeeded", "succeeded", "", nil, 0, "", "buildq logs: " + why + "\n"},
		{"succeeded -f", "succeeded", "", []string{"-f"}, 0, "", "buildq logs: " + why + "\n"},
		{"failed -f", "failed", "BuildFailed", []string{"-f"}, 1, "", "buildq logs: " + why + "\nbuildq: build failed: BuildFailed\n"},
		{"json", "succeeded", "", []string{"-o", "json"}, 0, `{"done":true,"state":"succeeded","reason":""}` + "\n", "buildq logs: " + why + "\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ns, nc := logsWorld(t)
			f := startFakeLogs(t, nc, "acme",
				logsPage{reply: v1.LogsReply{Key: "k", Run: "r", Cursor: "r:0:0", Done: true, State: c.state, Reason: c.reason, Error: why}},
			)
			code, stdout, stderr := logsCLI(t, ns, c.args...)
			if code != c.code || stdout != c.stdout || stderr != c.stderr {
				t.Fatalf("exit %d, stdout %q, stderr %q; want %d, %q, %q", code, stdout, stderr, c.code, c.stdout, c.stderr)
			}
			if n := len(f.requests()); n != 1 {
				t.Fatalf("%d requests, want 1: the log is over", n)
			}
		})
	}
}
