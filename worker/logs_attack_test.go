package worker

// Attacks on build logs end to end: hostile tenants through the logs
// service, secrets, workers killed at the worst moment, NATS restarting
// under a build. Each test names its attack and the outcome expected. A
// test marked "held" passed when written and guards what it shows; every
// other test failed when written, and passes since its break was fixed
// (issue 27).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap/zaptest"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
)

// scriptBackend is a Backend whose builds a test scripts: run writes the
// build's lines into b.Log (as the local executor does, ignoring the
// writer's errors) and returns the outcome.
type scriptBackend struct {
	run func(ctx context.Context, b Build) (Outcome, error)
}

func (*scriptBackend) Identity() string { return "script" }

func (s *scriptBackend) Run(ctx context.Context, b Build, started Started) (Outcome, error) {
	started("script-"+v1.DefaultTag(b.Key), true, b.Request.RequestID)
	out, err := s.run(ctx, b)
	out.Job, out.JobUID, out.Run = "script-"+v1.DefaultTag(b.Key), b.Run, b.Run
	return out, err
}

func (*scriptBackend) Cleanup(context.Context, string, string) error { return nil }

// logLine writes one executor line, as LocalBackend's step does.
func logLine(ctx context.Context, b Build, text string) {
	if b.Log != nil {
		_ = b.Log.Line(ctx, "", v1.LogStreamLocal, 1, time.Now().UTC(), []byte(text))
	}
}

// scriptFailure is a scripted build's failed outcome (no registry needed).
func scriptFailure() Outcome {
	now := time.Now().UTC()
	return Outcome{Reason: v1.ReasonBuildFailed, Message: "scripted failure", LogTail: "scripted failure", StartedAt: now, FinishedAt: now}
}

// withLogsOf turns logs on with archive and a stream of 64 MiB, less
// than the default (256 MiB): the tests' logs are small, and the test
// server's whole store is 1 GiB.
func withLogsOf(a LogArchive) func(*Config) {
	return func(c *Config) { c.Logs = LogsConfig{Enabled: true, Archive: a, MaxBytes: 64 << 20} }
}

// logWorker is a worker on its own connection that a test can kill the
// way SIGKILL does: the connection drops first, then everything stops.
type logWorker struct {
	w      *Worker
	nc     *nats.Conn
	cancel context.CancelFunc
	done   chan struct{}
}

func (e *env) startLogWorker(id string, backend Backend, archive LogArchive, mutate func(*Config), before func(*Worker)) *logWorker {
	t := e.t
	t.Helper()
	cfg := testConfig(id)
	cfg.Logger = zaptest.NewLogger(t).Named(id)
	withLogsOf(archive)(&cfg)
	if mutate != nil {
		mutate(&cfg)
	}
	nc, err := nats.Connect(e.world.nats.URL(), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(nc, backend, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Setup(context.Background()); err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(w)
	}
	ctx, cancel := context.WithCancel(context.Background())
	k := &logWorker{w: w, nc: nc, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(k.done)
		_ = w.Run(ctx)
		nc.Close()
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-k.done:
		case <-time.After(20 * time.Second):
		}
	})
	return k
}

// kill is SIGKILL: no hand-back, no ack, no release.
func (k *logWorker) kill() {
	k.nc.Close()
	k.cancel()
}

// storedLog reads the whole stored log of run of key (ended or not).
func (e *env) storedLog(key, run string) (data []byte, ended bool) {
	e.t.Helper()
	r := buildlog.NewReader(e.js)
	var seq uint64
	for {
		c, err := r.Next(context.Background(), key, run, seq)
		if err != nil {
			e.t.Fatal(err)
		}
		if c == nil {
			return data, ended
		}
		data = append(data, c.Data...)
		seq, ended = c.Seq, ended || c.Ended
	}
}

// logTexts is the "<stream> <text>" of every line of data; the test
// fails when data does not parse.
func logTexts(t *testing.T, data []byte) []string {
	t.Helper()
	var out []string
	if err := v1.EachLogLine(data, func(l v1.LogLine) bool {
		out = append(out, l.Stream+" "+string(l.Text))
		return true
	}); err != nil {
		t.Errorf("the log does not parse: %v\n%s", err, data)
	}
	return out
}

func countPrefix(lines []string, prefix string) int {
	n := 0
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}

// logsRequest sends one logs request of tenant and decodes the reply.
func logsRequest(t *testing.T, e *env, tenant string, req v1.LogsRequest, timeout time.Duration) v1.LogsReply {
	t.Helper()
	b, _ := json.Marshal(req)
	return logsRaw(t, e, tenant, string(b), timeout)
}

// logsRaw sends payload as it is to tenant's logs service.
func logsRaw(t *testing.T, e *env, tenant, payload string, timeout time.Duration) v1.LogsReply {
	t.Helper()
	b := payload
	m, err := tenantAPIRequest(e.nc, tenant, v1.APILogsSubject(tenant), b, timeout)
	if err != nil {
		t.Fatalf("logs request %s: %v", b, err)
	}
	var rep v1.LogsReply
	if err := json.Unmarshal(m.Data, &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}

// checkArchive asserts ref is archived in a and the archive holds data.
func checkArchive(t *testing.T, a *memLogArchive, ref *v1.LogRef, data []byte) {
	t.Helper()
	if !ref.Archived() {
		t.Errorf("the result's data.logs points at no archive: %s", mustJSON(t, ref))
		return
	}
	got, err := buildlog.ReadArchive(context.Background(), a, ref)
	if err != nil {
		t.Errorf("read the archive: %v", err)
		return
	}
	if string(got) != string(data) {
		t.Errorf("the archive:\n%s\nthe stream:\n%s", got, data)
	}
}

// Attack: secrets in the result. A local build whose Dockerfile uses a
// secret build argument where the executor's error names it (COPY
// ${TOKEN}: the path does not exist). Expected: the value is in none of
// the stored log, the archive, the result (message, log tail) and the
// progress events — the log masks it, but the result and the finished
// event carry the executor's message as is.
func TestLogAttackSecretMaskedInTheResult(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nARG TOKEN\nCOPY ${TOKEN} /x\n", "app": "hello"})
	r := tenantRequestFor("acme", digest)
	const secret = "t0p-s3cret-value"
	r.BuildArgs = map[string]string{"TOKEN": secret}
	r.SecretBuildArgs = []string{"TOKEN"}
	archive := &memLogArchive{}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		withLogsOf(archive)(c)
	})
	events := e.events()
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	res := results.waitFor(t, 1, 20*time.Second)[0]
	if res.Data.Status != v1.StatusFailed || res.Data.Logs == nil {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	data, _ := e.storedLog(res.Data.Key, res.Data.Logs.Run)
	if !strings.Contains(string(data), "error: ") {
		t.Fatalf("the build did not fail where the test expects:\n%s", data)
	}
	where := map[string]string{"the stored log": string(data), "the result": mustJSON(t, res)}
	archive.mu.Lock()
	for k, z := range archive.objects {
		where["archive "+k] = string(z) // gzip: the value would show only if stored uncompressed
	}
	archive.mu.Unlock()
	if ref := res.Data.Logs; ref.Archived() {
		if got, err := buildlog.ReadArchive(context.Background(), archive, ref); err == nil {
			where["the archive"] = string(got)
		}
	}
	var evs []string
	for _, raw := range events.all() {
		evs = append(evs, string(raw))
	}
	where["the progress events"] = strings.Join(evs, "\n")
	for name, s := range where {
		if strings.Contains(s, secret) {
			t.Errorf("the secret build argument's value is in %s:\n%s", name, s)
		}
	}
}

// Attack: log-line injection from a tenant's Dockerfile. The local
// executor's error for a JSON-form COPY names the source path as decoded —
// newlines included — and the error goes to the log as one executor line.
// Expected: one line stays one line; nothing in the log claims to be
// buildq's own ("pushed", "build succeeded") that buildq did not write,
// and the whole log parses (a reader stops at the first line that does
// not).
func TestLogAttackDockerfileCannotForgeBuildqLines(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	forged := `x\n2026-01-01T00:00:00Z buildq 1 pushed sha256:` + strings.Repeat("0", 64) + `\n2026-01-01T00:00:00Z buildq 1 build succeeded\nnot a log line`
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY [\"" + forged + "\", \"/y\"]\n", "app": "hello"})
	r := tenantRequestFor("acme", digest)
	archive := &memLogArchive{}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		withLogsOf(archive)(c)
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	res := results.waitFor(t, 1, 20*time.Second)[0]
	if res.Data.Status != v1.StatusFailed || res.Data.Logs == nil {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	data, _ := e.storedLog(res.Data.Key, res.Data.Logs.Run)
	var forgedOwn []string
	perr := v1.EachLogLine(data, func(l v1.LogLine) bool {
		if l.Own() && (strings.HasPrefix(string(l.Text), "pushed") || string(l.Text) == "build succeeded") {
			forgedOwn = append(forgedOwn, string(l.Text))
		}
		return true
	})
	if len(forgedOwn) > 0 {
		t.Errorf("the Dockerfile forged buildq's own lines %q in a failed build's log:\n%s", forgedOwn, data)
	}
	if perr != nil {
		t.Errorf("the stored log does not parse past the injected newline: %v\n%s", perr, data)
	}
	// What the tenant (and anyone its request's log is shown to) reads.
	rep := logsRequest(t, e, "acme", v1.LogsRequest{Target: r.RequestID}, 10*time.Second)
	if err := v1.EachLogLine(rep.Data, func(v1.LogLine) bool { return true }); err != nil {
		t.Errorf("the logs service serves a log that does not parse: %v", err)
	}
}

// Attack: follow the log of a build its tenant canceled (the owner is
// alive). Expected: the log gets its end ("build canceled") soon after the
// cancel, so `buildq logs -f` stops, and the tenant reads it by the
// canceled request's id. Before the fix, the cancel ends the owner's handling
// (its context), so own() takes the shutdown path: nobody writes the end
// (the service's 30 s idle rule is the only way out), and the canceled
// result carries no data.logs, so by request id the service answers "no
// log is kept" although the stream holds it.
func TestLogAttackCanceledBuildLogEnds(t *testing.T) {
	t.Parallel()
	e := setup(t)
	started := make(chan Build, 1)
	backend := &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		logLine(ctx, b, "step 1 of a build about to be canceled")
		_ = b.Log.Flush(ctx)
		started <- b
		<-ctx.Done()
		return Outcome{}, ctx.Err()
	}}
	archive := &memLogArchive{}
	e.startLogWorker("w1", backend, archive, nil, nil)
	results := e.collect()
	r := tenantRequestFor("acme", digestOf("canceled build"))
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	var b Build
	select {
	case b = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the build did not start")
	}
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), r.RequestID); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	res := results.waitFor(t, 1, 10*time.Second)[0]
	if res.Data.Status != v1.StatusCanceled {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	deadline := time.Now().Add(8 * time.Second)
	var data []byte
	ended := false
	for time.Now().Before(deadline) && !ended {
		data, ended = e.storedLog(b.Key, b.Run)
		time.Sleep(100 * time.Millisecond)
	}
	if !ended {
		t.Errorf("8 s after the cancel the canceled build's log has no end (a follower waits for the 30 s idle rule):\n%s", data)
	} else if lines := logTexts(t, data); countPrefix(lines, "buildq build canceled") != 1 {
		t.Errorf("the end of a canceled build's log:\n%s", data)
	}
	rep := logsRequest(t, e, "acme", v1.LogsRequest{Target: r.RequestID}, 10*time.Second)
	if rep.Error != "" || !strings.Contains(string(rep.Data), "step 1 of a build about to be canceled") {
		t.Errorf("the canceled request's log by its id: %s", mustJSON(t, rep))
	}
}

// gateArchive is a memLogArchive whose first PutLog, once armed, stops
// until gate closes (the worker is killed meanwhile) and then fails.
type gateArchive struct {
	memLogArchive
	armed   atomic.Bool
	entered chan struct{}
	gate    chan struct{}
}

func (g *gateArchive) PutLog(ctx context.Context, object string, data []byte) (string, error) {
	if g.armed.CompareAndSwap(true, false) {
		close(g.entered)
		<-g.gate
		return "", errors.New("the worker was killed while it archived")
	}
	return g.memLogArchive.PutLog(ctx, object, data)
}

// Attack: the worker that owns a run is killed at the worst moments of
// its log's life, and another worker finishes the run (the request is
// redelivered to it, the claim lapses, it takes the run over). Expected
// after recovery: the stored log holds every line once and ends once,
// and the result's data.logs points at an archive that holds exactly the
// stored log.
//
//   - between End and the archive: the log's end is stored, its archive is
//     not. Before the fix, the new owner opens the log, finds it ended and drops
//     the writer (own.go: "a takeover of a run that ended"), so it never
//     archives it: the result has no data.logs at all, no archive exists,
//     and the request's log is "not kept" by request id.
//   - between the archive and the record's end: the same — the archive
//     exists, but the result does not point at it.
//   - mid-capture (the build still running): held; the new owner says it
//     runs the build from here and the log goes on.
func TestLogAttackWorkerKilledAtTheWorstMoment(t *testing.T) {
	t.Parallel()
	for _, moment := range []string{"between End and the archive", "between the archive and the record's end", "mid-capture"} {
		t.Run(moment, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			archive := &gateArchive{entered: make(chan struct{}), gate: make(chan struct{})}
			entered := make(chan struct{})
			var armedFinalize atomic.Bool
			w1Script := func(ctx context.Context, b Build) (Outcome, error) {
				for i := 1; i <= 3; i++ {
					logLine(ctx, b, fmt.Sprintf("w1 line %d", i))
				}
				if moment == "mid-capture" {
					if b.Log != nil {
						_ = b.Log.Flush(ctx)
					}
					close(entered)
					<-ctx.Done()
					return Outcome{}, ctx.Err()
				}
				return scriptFailure(), nil
			}
			var before func(*Worker)
			switch moment {
			case "between End and the archive":
				archive.armed.Store(true)
				entered = archive.entered
			case "between the archive and the record's end":
				armedFinalize.Store(true)
				before = func(w *Worker) {
					w.faults = &faultHooks{beforeFinalize: func(string) {
						if armedFinalize.CompareAndSwap(true, false) {
							close(entered)
							<-archive.gate
						}
					}}
				}
			}
			w1 := e.startLogWorker("w1", &scriptBackend{run: w1Script}, archive, nil, before)
			results := e.collect()
			r := tenantRequestFor("acme", digestOf("killed "+moment))
			if _, err := e.pub.Publish(context.Background(), r); err != nil {
				t.Fatal(err)
			}
			select {
			case <-entered:
			case <-time.After(10 * time.Second):
				t.Fatal("w1 did not reach the moment")
			}
			w1.kill()
			close(archive.gate)
			<-w1.done
			var w2Runs atomic.Int32
			e.startLogWorker("w2", &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
				w2Runs.Add(1)
				for i := 1; i <= 3; i++ {
					logLine(ctx, b, fmt.Sprintf("w2 line %d", i))
				}
				return scriptFailure(), nil
			}}, archive, nil, nil)
			res := results.waitFor(t, 1, 20*time.Second)[0]
			if res.Data.Status != v1.StatusFailed {
				t.Fatalf("result %s", mustJSON(t, res))
			}
			rec := e.claim(res.Data.Key)
			data, ended := e.storedLog(res.Data.Key, rec.Run)
			lines := logTexts(t, data)
			if !ended || countPrefix(lines, "buildq build failed") != 1 {
				t.Errorf("the stored log does not end exactly once:\n%s", data)
			}
			for i := 1; i <= 3; i++ {
				if n := countPrefix(lines, fmt.Sprintf("local w1 line %d", i)); n != 1 {
					t.Errorf("w1's line %d is stored %d times:\n%s", i, n, data)
				}
			}
			if res.Data.Logs == nil {
				t.Fatalf("after w2 finished the run (%d runs of its backend) the result has no data.logs; the stored log:\n%s\nresult %s",
					w2Runs.Load(), data, mustJSON(t, res))
			}
			if res.Data.Logs.Run != rec.Run {
				t.Errorf("data.logs names run %s, the record %s", res.Data.Logs.Run, rec.Run)
			}
			checkArchive(t, &archive.memLogArchive, res.Data.Logs, data)
			if rep := logsRequest(t, e, "acme", v1.LogsRequest{Target: r.RequestID}, 10*time.Second); rep.Error != "" || !rep.Done {
				t.Errorf("the request's log by its id: %s", mustJSON(t, rep))
			}
		})
	}
}

// Attack: NATS restarts while a build writes its log (the local
// executor's way: Line, errors ignored). Expected: every line written
// during the outage is stored once — no duplicates from publishes retried
// across the reconnect — or, if any is lost, the log says so; the log
// ends once and its archive matches. Held — though the executor is
// blocked in Line for as long as the outage lasts: the periodic flush
// holds the writer's lock across its publish retries.
func TestLogAttackNATSRestartDuringABuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const n = 40
	halfway := make(chan struct{})
	// When the executor printed each line (unix ns). Line blocks while
	// the writer's periodic flush waits out the outage (it holds the
	// writer's lock), so few lines are printed while NATS is down.
	var written [n + 1]atomic.Int64
	var longest atomic.Int64 // the longest Line call
	backend := &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		for i := 1; i <= n; i++ {
			written[i].Store(time.Now().UnixNano())
			logLine(ctx, b, fmt.Sprintf("restart line %02d", i))
			if d := time.Now().UnixNano() - written[i].Load(); d > longest.Load() {
				longest.Store(d)
			}
			if i == 8 {
				close(halfway)
			}
			time.Sleep(75 * time.Millisecond)
		}
		return scriptFailure(), nil
	}}
	archive := &memLogArchive{}
	// A lease and an ack wait longer than the outage: the run stays this
	// worker's, its backend runs once.
	e.startLogWorker("w1", backend, archive, func(c *Config) {
		c.Lease, c.AckWait = 20*time.Second, 20*time.Second
	}, nil)
	results := e.collect()
	r := tenantRequestFor("acme", digestOf("nats restart"))
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	select {
	case <-halfway:
	case <-time.After(10 * time.Second):
		t.Fatal("the build did not start")
	}
	down := time.Now().UnixNano()
	if err := e.world.nats.Restart(time.Second); err != nil {
		t.Fatal(err)
	}
	up := time.Now().UnixNano()
	res := results.waitFor(t, 1, 20*time.Second)[0]
	if res.Data.Logs == nil {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	during := 0
	for i := 1; i <= n; i++ {
		if at := written[i].Load(); at > down && at < up {
			during++
		}
	}
	if during == 0 {
		t.Fatal("no line was printed while NATS was down: the test shows nothing")
	}
	t.Logf("%d lines printed while NATS was down; the longest Line call blocked the executor %s", during, time.Duration(longest.Load()))
	data, ended := e.storedLog(res.Data.Key, res.Data.Logs.Run)
	lines := logTexts(t, data)
	says := strings.Contains(strings.ToLower(string(data)), "lost")
	for i := 1; i <= n; i++ {
		switch c := countPrefix(lines, fmt.Sprintf("local restart line %02d", i)); {
		case c > 1:
			t.Errorf("line %d stored %d times:\n%s", i, c, data)
		case c == 0 && !says:
			t.Errorf("line %d silently lost:\n%s", i, data)
		}
	}
	if !ended || countPrefix(lines, "buildq build failed") != 1 {
		t.Errorf("the log does not end once:\n%s", data)
	}
	checkArchive(t, archive, res.Data.Logs, data)
}

// Attack: one tenant floods the logs service with long polls (it follows
// many logs at once, or on purpose). Expected (held): past its 16 waiting polls
// its requests are answered at once; another tenant's requests are
// answered promptly, and may still wait themselves; once the polls end,
// the worker holds no subscription they made (no leak of ChanSubscribe).
func TestLogAttackLongPollFloodDoesNotStarveOthers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	started := make(chan Build, 2)
	backend := &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		logLine(ctx, b, "a quiet build")
		started <- b
		<-ctx.Done()
		return Outcome{}, ctx.Err()
	}}
	w := e.startLogWorker("w1", backend, &memLogArchive{}, nil, nil)
	flood, acme := tenantRequestFor("flood", digestOf("flood")), tenantRequestFor("acme", digestOf("victim"))
	for _, r := range []*v1.Request{flood, acme} {
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("the builds did not start")
		}
	}
	// The end of each log as it stands: a poll from there waits.
	tail := func(tenant, id string) string {
		var cur string
		eventually(t, 5*time.Second, "the log's first lines", func() bool {
			rep := logsRequest(t, e, tenant, v1.LogsRequest{Target: id}, 5*time.Second)
			cur = rep.Cursor
			return strings.Contains(string(rep.Data), "a quiet build")
		})
		return cur
	}
	floodCur, acmeCur := tail("flood", flood.RequestID), tail("acme", acme.RequestID)
	baseline := w.nc.NumSubscriptions()

	const polls = 60
	inbox := v1.InboxPrefix("flood") + ".poll"
	replies := make(chan time.Time, polls)
	sub, err := e.nc.Subscribe(inbox+".*", func(*nats.Msg) { replies <- time.Now() })
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	b, _ := json.Marshal(v1.LogsRequest{Target: flood.RequestID, Cursor: floodCur, WaitMs: 10_000})
	sent := time.Now()
	for i := range polls {
		if err := e.nc.PublishRequest(v1.APILogsSubject("flood"), fmt.Sprintf("%s.%d", inbox, i), b); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	// The other tenant, at once and with a wait of its own.
	t0 := time.Now()
	if rep := logsRequest(t, e, "acme", v1.LogsRequest{Target: acme.RequestID, Cursor: acmeCur}, 5*time.Second); rep.Error != "" {
		t.Fatalf("acme: %s", mustJSON(t, rep))
	}
	if d := time.Since(t0); d > time.Second {
		t.Errorf("acme's logs request took %s behind another tenant's %d long polls", d, polls)
	}
	t0 = time.Now()
	logsRequest(t, e, "acme", v1.LogsRequest{Target: acme.RequestID, Cursor: acmeCur, WaitMs: 1500}, 5*time.Second)
	if d := time.Since(t0); d < time.Second || d > 4*time.Second {
		t.Errorf("acme's long poll of 1.5 s returned after %s", d)
	}
	// The flood past its 16: answered at once.
	quick := 0
	deadline := time.After(12 * time.Second)
	for got := range polls {
		select {
		case at := <-replies:
			if at.Sub(sent) < 3*time.Second {
				quick++
			}
		case <-deadline:
			t.Fatalf("%d of %d long polls answered after 12 s", got, polls)
		}
	}
	if quick < polls-16 {
		t.Errorf("%d of the flood's %d polls answered at once, want at least %d", quick, polls, polls-16)
	}
	if quick == polls {
		t.Errorf("none of the flood's polls waited: the per-tenant bound is not what limits them")
	}
	eventually(t, 5*time.Second, "the long polls' subscriptions to go", func() bool { return w.nc.NumSubscriptions() <= baseline })
}

// Attack: a logs request whose reply subject is not the tenant's inbox
// (another tenant's, the server's default _INBOX., a KV subject, the bare
// inbox prefix). Expected (held): no answer at all; the tenant's own inbox
// is answered.
func TestLogAttackReplyNotTheTenantsInbox(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startLogWorker("w1", &scriptBackend{run: func(context.Context, Build) (Outcome, error) { return scriptFailure(), nil }}, &memLogArchive{}, nil, nil)
	got := make(chan string, 8)
	refused := []string{"_INBOX_mallory.x", "_INBOX.x", "$KV.buildq-builds.x", "_INBOX_acme"}
	for _, s := range append(refused, "_INBOX_acme.ok") {
		sub, err := e.nc.Subscribe(s, func(m *nats.Msg) { got <- m.Subject })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
	}
	// The worker answers once its API is up.
	eventually(t, 5*time.Second, "the logs service", func() bool {
		_, err := tenantAPIRequest(e.nc, "acme", v1.APILogsSubject("acme"), "nothing", 2*time.Second)
		return err == nil
	})
	drain := func() {
		for {
			select {
			case <-got:
			case <-time.After(200 * time.Millisecond):
				return
			}
		}
	}
	drain()
	for _, reply := range refused {
		if err := e.nc.PublishRequest(v1.APILogsSubject("acme"), reply, []byte("nothing")); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.nc.PublishRequest(v1.APILogsSubject("acme"), "_INBOX_acme.ok", []byte("nothing")); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if s != "_INBOX_acme.ok" {
			t.Errorf("answered on %s", s)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the tenant's own inbox was not answered")
	}
	select {
	case s := <-got:
		t.Errorf("answered on %s", s)
	case <-time.After(500 * time.Millisecond):
	}
}

// Attack: a secret build argument that one request marks secret and
// another (same values, so the same build key: secretBuildArgs is not in
// it) does not. The first claims the run, the second joins it; the first
// is canceled and hands the run over. Expected: the run's log — one log,
// archived under the claimer's tenant — never holds the value the claimer
// marked secret; before the fix the masks are those of whichever request runs the
// build at the moment.
func TestLogAttackSecretMaskedAfterHandOverToANonSecretJoiner(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const secret = "handover-s3cret-99"
	starts := make(chan Build, 4)
	backend := &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		// An executor that prints the argument (kaniko: RUN echo $TOKEN).
		logLine(ctx, b, "TOKEN is "+b.Request.BuildArgs["TOKEN"])
		if b.Log != nil {
			_ = b.Log.Flush(ctx)
		}
		starts <- b
		select {
		case <-ctx.Done():
			return Outcome{}, ctx.Err()
		case <-time.After(2 * time.Second):
			return scriptFailure(), nil
		}
	}}
	archive := &memLogArchive{}
	e.startLogWorker("w1", backend, archive, nil, nil)
	results := e.collect()
	a := tenantRequestFor("acme", digestOf("handover"))
	a.BuildArgs = map[string]string{"TOKEN": secret}
	a.SecretBuildArgs = []string{"TOKEN"}
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	var first Build
	select {
	case first = <-starts:
	case <-time.After(10 * time.Second):
		t.Fatal("the build did not start")
	}
	b := *a
	b.RequestID, b.SecretBuildArgs = "joiner", nil
	if _, err := e.pub.Publish(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	key := first.Key
	eventually(t, 10*time.Second, "the joiner to wait on the build", func() bool {
		le := e.ledgerEntry("acme", "joiner")
		return le != nil && le.Key == key
	})
	time.Sleep(300 * time.Millisecond)
	if rep := cancelRequest(t, e.nc, v1.APICancelSubject("acme"), a.RequestID); !rep.Canceled {
		t.Fatalf("cancel: %+v", rep)
	}
	got := byID(results.waitFor(t, 2, 20*time.Second))
	if len(got["joiner"]) == 0 {
		t.Fatalf("results %v", got)
	}
	data, _ := e.storedLog(key, first.Run)
	if strings.Contains(string(data), secret) {
		t.Errorf("the claimer's secret is in its run's log after the hand-over:\n%s", data)
	}
	if ref := got["joiner"][0].Data.Logs; ref != nil && ref.Archived() {
		if z, err := buildlog.ReadArchive(context.Background(), archive, ref); err == nil && strings.Contains(string(z), secret) {
			t.Errorf("the claimer's secret is in the archive %s:\n%s", ref.Object, z)
		}
	}
}

// slowContexts is a ContextSource whose reads of the objects under slow
// never finish (a large object the worker is still hashing).
type slowContexts struct {
	mapContexts
	slow string
}

func (s slowContexts) Open(ctx context.Context, bucket, key string) (io.ReadCloser, error) {
	if strings.HasPrefix(key, s.slow) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return s.mapContexts.Open(ctx, bucket, key)
}

// Attack: read another tenant's build log through one's own request id,
// before the worker has checked that one holds the content. Mallory knows
// the inputs of acme's build (its context digest travels in results,
// logs, provenance) but not its content, and publishes a request with the
// same build key, naming her own context object — a large one, or one
// whose read fails transiently, so the worker's possession check takes
// its time. The ledger entry of her request holds the key from the start.
// Expected: the logs service serves her nothing of acme's build (the
// status service, for the same entry, shows acme's record to acme only);
// before the fix the request-id path resolves the entry's key to the key's current
// run, whoever's it is, and serves acme's log.
func TestLogAttackNoForeignLogBeforePossession(t *testing.T) {
	t.Parallel()
	e := setup(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "acme's private app"})
	acme := tenantRequestFor("acme", digest)
	m := tenantRequestFor("mallory", digest)
	if v1.BuildKey(acme, "script") != v1.BuildKey(m, "script") {
		t.Fatal("the two requests do not share a key")
	}
	started := make(chan Build, 1)
	backend := &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		logLine(ctx, b, "ACME-PRIVATE: deploying with internal endpoint db.acme.internal")
		if b.Log != nil {
			_ = b.Log.Flush(ctx)
		}
		started <- b
		<-ctx.Done()
		return Outcome{}, ctx.Err()
	}}
	contexts := slowContexts{mapContexts: mapContexts{acme.Source.S3.Key: tgz}, slow: "contexts/mallory/"}
	e.startLogWorker("w1", backend, &memLogArchive{}, func(c *Config) { c.Contexts = contexts }, nil)
	if _, err := e.pub.Publish(context.Background(), acme); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("acme's build did not start")
	}
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "mallory's request to be taken", func() bool {
		le := e.ledgerEntry("mallory", m.RequestID)
		return le != nil && le.Key != ""
	})
	rep := logsRequest(t, e, "mallory", v1.LogsRequest{Target: m.RequestID}, 10*time.Second)
	if strings.Contains(string(rep.Data), "ACME-PRIVATE") || rep.Run != "" {
		t.Errorf("mallory reads acme's build log through her own request, whose possession check has not passed:\n%s\nreply %s", rep.Data, mustJSON(t, rep))
	}
	// The status service, for comparison, shows her nothing of acme's.
	sm, err := tenantAPIRequest(e.nc, "mallory", v1.APIStatusSubject("mallory"), m.RequestID, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var st v1.StatusReply
	_ = json.Unmarshal(sm.Data, &st)
	if st.Build != nil {
		t.Errorf("status shows mallory acme's record: %s", sm.Data)
	}
}

// Attack: odd payloads on the logs service — invalid JSON, wrong types,
// a target longer than any request id, a bare target with spaces, a
// nearly 1 MB payload, extreme waitMs and maxBytes, an unparsable since.
// Expected (held): each is answered at once with an error and no line,
// and the worker keeps answering.
func TestLogAttackOddPayloadsAreRefusedPromptly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	started := make(chan Build, 1)
	e.startLogWorker("w1", &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		logLine(ctx, b, "acme's line")
		started <- b
		<-ctx.Done()
		return Outcome{}, ctx.Err()
	}}, &memLogArchive{}, nil, nil)
	r := tenantRequestFor("acme", digestOf("odd payloads"))
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	<-started
	for name, payload := range map[string]string{
		"truncated JSON":     `{"target":`,
		"target of a number": `{"target": 5}`,
		"cursor of a number": `{"target":"` + r.RequestID + `","cursor":12}`,
		"since not a time":   `{"target":"` + r.RequestID + `","since":"yesterday"}`,
		"long target":        strings.Repeat("a", v1.MaxRequestIDLen+1),
		"nearly 1 MB":        `{"target":"` + strings.Repeat("b", 900<<10) + `"}`,
		"spaces":             r.RequestID + " " + r.RequestID,
		"empty":              "   ",
		"empty JSON target":  `{"target":"  ","waitMs":10000}`,
		"extremes": `{"target":"no-such-request","waitMs":-9223372036854775808,"maxBytes":-2147483648,` +
			`"cursor":"x:18446744073709551615:9223372036854775807"}`,
		"NUL bytes": "\x00\x00",
	} {
		t0 := time.Now()
		rep := logsRaw(t, e, "acme", payload, 5*time.Second)
		if rep.Error == "" || len(rep.Data) > 0 {
			t.Errorf("%s: %s", name, mustJSON(t, rep))
		}
		if d := time.Since(t0); d > 2*time.Second {
			t.Errorf("%s: answered after %s", name, d)
		}
	}
	// Extreme limits on a real target: capped, and the log is served
	// (page after page: the first line may be stored alone).
	req := v1.LogsRequest{Target: r.RequestID, WaitMs: 1 << 62, MaxBytes: 1 << 40}
	var served []byte
	for range 5 {
		b, _ := json.Marshal(req)
		rep := logsRaw(t, e, "acme", string(b), 15*time.Second)
		if rep.Error != "" {
			t.Fatalf("extreme limits: %s", mustJSON(t, rep))
		}
		served = append(served, rep.Data...)
		if strings.Contains(string(served), "acme's line") {
			break
		}
		req.Cursor = rep.Cursor
	}
	if !strings.Contains(string(served), "acme's line") {
		t.Errorf("extreme limits: the log served is %q", served)
	}
}

// Attack: follow a key's log with the cursor of a run that is over, after
// the key was built again (a new run). Expected (held): the next page says
// the build was started again, then the new run's log from its start —
// nothing of the old run again — and ends with the new run's outcome.
func TestLogAttackRunRestartedUnderTheSameKey(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var runs atomic.Int32
	e.startLogWorker("w1", &scriptBackend{run: func(ctx context.Context, b Build) (Outcome, error) {
		n := runs.Add(1)
		logLine(ctx, b, fmt.Sprintf("run %d line", n))
		return scriptFailure(), nil
	}}, &memLogArchive{}, nil, nil)
	results := e.collect()
	r := tenantRequestFor("acme", digestOf("restarted key"))
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	first := results.waitFor(t, 1, 10*time.Second)[0]
	key := first.Data.Key
	// Follow by key to the end of the first run.
	var cursor string
	for range 20 {
		rep := logsRequest(t, e, "acme", v1.LogsRequest{Target: key, Cursor: cursor}, 5*time.Second)
		if rep.Error != "" {
			t.Fatal(rep.Error)
		}
		cursor = rep.Cursor
		if rep.Done {
			break
		}
	}
	r2 := *r
	r2.RequestID = "again"
	if _, err := e.pub.Publish(context.Background(), &r2); err != nil {
		t.Fatal(err)
	}
	second := byID(results.waitFor(t, 2, 10*time.Second))["again"][0]
	if second.Data.Logs == nil || second.Data.Logs.Run == first.Data.Logs.Run {
		t.Fatalf("the key was not built again: %s", mustJSON(t, second))
	}
	var got []string
	done := false
	for range 20 {
		rep := logsRequest(t, e, "acme", v1.LogsRequest{Target: key, Cursor: cursor}, 5*time.Second)
		if rep.Error != "" {
			t.Fatal(rep.Error)
		}
		got = append(got, logTexts(t, rep.Data)...)
		cursor = rep.Cursor
		if done = rep.Done; done {
			break
		}
	}
	text := strings.Join(got, "\n")
	if !done || len(got) == 0 || got[0] != "buildq the build was started again as run "+second.Data.Logs.Run+"; its log follows" ||
		strings.Contains(text, "run 1 line") || countPrefix(got, "local run 2 line") != 1 || countPrefix(got, "buildq build failed") != 1 {
		t.Errorf("continuing after the first run (done %v):\n%s", done, text)
	}
}
