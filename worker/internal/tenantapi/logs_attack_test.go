package tenantapi

// Attacks on the logs service through crafted requests, run against the
// service itself (not over NATS): a panic here would be a panic in the
// goroutine Serve starts for the request, which nothing recovers — the
// whole worker process would die. Calling logs directly lets the test
// recover it and fail instead of crashing the test binary.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/worker/internal/buildlog"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/runs"
)

type attackArchive struct {
	mu      sync.Mutex
	objects map[string][]byte
}

func (a *attackArchive) PutLog(_ context.Context, object string, data []byte) (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.objects == nil {
		a.objects = map[string][]byte{}
	}
	a.objects[object] = append([]byte(nil), data...)
	return "logs", nil
}

func (a *attackArchive) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	b, ok := a.objects[key]
	if !ok {
		return nil, fmt.Errorf("no object %s", key)
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

// logsWorld is a logs service over a fresh server's buckets and stream.
type logsWorld struct {
	svc     *Service
	js      jetstream.JetStream
	nc      *nats.Conn
	ledger  *ledger.Ledger
	runs    *runs.Store
	archive *attackArchive
}

func newLogsWorld(t *testing.T) *logsWorld {
	t.Helper()
	_, nc, js := testnats.JetStream(t)
	ctx := context.Background()
	if _, err := buildlog.EnsureStream(ctx, js, buildlog.StreamConfig{MaxBytes: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	lkv, err := ledger.EnsureBucket(ctx, js, ledger.BucketConfig{})
	if err != nil {
		t.Fatal(err)
	}
	rkv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: v1.BuildsBucket})
	if err != nil {
		t.Fatal(err)
	}
	l := ledger.New(ledger.Config{Worker: "w1", Now: time.Now})
	l.UseBucket(lkv)
	rs := runs.New()
	rs.UseBucket(rkv)
	a := &attackArchive{}
	svc := New(Config{Ledger: l, Runs: rs, NC: nc, Now: time.Now, Logs: buildlog.NewReader(js), Archive: a,
		StopBuild: func(context.Context, string, string) error { return nil }, AnswerParked: func(context.Context, string) {}})
	return &logsWorld{svc: svc, js: js, nc: nc, ledger: l, runs: rs, archive: a}
}

// building stores a run of key claimed by tenant's request id, still
// building, with lines in its log (not ended, not archived).
func (w *logsWorld) building(t *testing.T, tenant, id, key, run string, lines ...string) {
	t.Helper()
	ctx := context.Background()
	if _, ok, err := w.runs.Claim(ctx, &v1.BuildRecord{Key: key, Run: run, Tenant: tenant, Name: "web", RequestID: id,
		State: v1.StateBuilding, Owner: "w1", LeaseUntil: time.Now().Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if _, _, err := w.ledger.Open(ctx, tenant, "web", id, key, 1, time.Now()); err != nil {
		t.Fatal(err)
	}
	lw, err := buildlog.Open(ctx, w.js, key, run, buildlog.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range lines {
		if err := lw.Line(ctx, "", v1.LogStreamLocal, 1, time.Now().Add(time.Duration(i)), []byte(l)); err != nil {
			t.Fatal(err)
		}
	}
	if err := lw.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

// ask calls the logs service as Serve would, recovering a panic (which in
// a worker kills the process) into a test failure.
func (w *logsWorld) ask(t *testing.T, tenant string, payload string) (rep v1.LogsReply) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("logs request %s of tenant %s panicked (in a worker: the process dies): %v", payload, tenant, p)
			rep = v1.LogsReply{Error: fmt.Sprint("panic: ", p)}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	return w.svc.logs(ctx, tenant, []byte(payload))
}

func req(target, cursor string) string {
	b, _ := json.Marshal(v1.LogsRequest{Target: target, Cursor: cursor})
	return string(b)
}

// hexKey is a build key made from s.
func hexKey(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// Attack: an archive cursor ("<run>:a:<off>") on a log that has no
// archive (the run is still building, or its archive failed). Expected:
// an error reply. Before the fix, archivePage hands buildlog.ReadArchive a nil
// reference, which dereferences it: a panic in the request's goroutine —
// one tenant request kills the worker serving it (and, one by one, every
// worker of the queue group).
func TestLogAttackArchiveCursorOnUnarchivedLogIsRefused(t *testing.T) {
	t.Parallel()
	w := newLogsWorld(t)
	key := hexKey("building")
	w.building(t, "acme", "req1", key, "run1", "step one", "step two")
	rep := w.ask(t, "acme", req("req1", "run1:a:0"))
	if rep.Error == "" && len(rep.Data) == 0 {
		t.Errorf("archive cursor on a log with no archive: %+v", rep)
	}
}

// Held: crafted stream cursors — the sequence of another run's chunk,
// past the end, the largest uint64 (seq+1 wraps to 0), an offset that
// does not match, another run's id, garbage and negative numbers — never
// serve a line of another run's log, never panic, and a cursor that does
// not parse is refused.
func TestLogAttackCraftedCursorsStayInTheirRun(t *testing.T) {
	t.Parallel()
	w := newLogsWorld(t)
	mine, theirs := hexKey("mine"), hexKey("theirs!")
	w.building(t, "mallory", "m1", mine, "runM", "mallory line")
	w.building(t, "acme", "a1", theirs, "runA", "ACME-PRIVATE line 1", "ACME-PRIVATE line 2")
	// mallory's own log, to learn a valid cursor and sequences.
	first := w.ask(t, "mallory", req("m1", ""))
	if first.Error != "" || !strings.Contains(string(first.Data), "mallory line") {
		t.Fatalf("mallory's own log: %+v", first)
	}
	for _, cur := range []string{
		"runM:1:0", "runM:2:0", "runM:3:0", "runM:0:9999", "runM:1:1",
		"runM:18446744073709551615:0", "runM:18446744073709551614:0",
		"runA:0:0", "runA:1:0", "runA:a:0",
		fmt.Sprintf("runM:%d:0", uint64(math.MaxInt64)), "runM:99999999999999999999:0",
		"runM:-1:0", "runM:1:-5", "runM:x:0", ":1:0", "runM:1", "runM:1:0:0", "runM:a:-1",
		"\x00:\x00:\x00",
	} {
		rep := w.ask(t, "mallory", req("m1", cur))
		if strings.Contains(string(rep.Data), "ACME") || strings.Contains(rep.Error, "ACME") {
			t.Errorf("cursor %q served another tenant's run: %+v", cur, rep)
		}
		if rep.Key != "" && rep.Key != mine {
			t.Errorf("cursor %q answered for key %s", cur, rep.Key)
		}
	}
	// Unknown to mallory: acme's request id, and acme's key.
	for _, target := range []string{"a1", theirs} {
		rep := w.ask(t, "mallory", req(target, "runA:0:0"))
		if rep.Error == "" || len(rep.Data) > 0 || rep.Key != "" || rep.Run != "" {
			t.Errorf("mallory asking for %s: %+v", target, rep)
		}
	}
	// The same answer for acme's key as for a key nobody built.
	known := w.ask(t, "mallory", req(theirs, ""))
	unknown := w.ask(t, "mallory", req(hexKey("nobody built this"), ""))
	if strings.ReplaceAll(known.Error, theirs, "K") != strings.ReplaceAll(unknown.Error, hexKey("nobody built this"), "K") {
		t.Errorf("acme's key answers %q, an unknown key %q", known.Error, unknown.Error)
	}
}

// archived stores an ended run of key of tenant, archived, its record
// final and pointing at the archive; it returns the stored log.
func (w *logsWorld) archived(t *testing.T, tenant, key, run string, lines ...string) []byte {
	t.Helper()
	ctx := context.Background()
	lw, err := buildlog.Open(ctx, w.js, key, run, buildlog.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range lines {
		if err := lw.Line(ctx, "", v1.LogStreamLocal, 1, time.Now().Add(time.Duration(i)), []byte(l)); err != nil {
			t.Fatal(err)
		}
	}
	if err := lw.End(ctx, "succeeded", ""); err != nil {
		t.Fatal(err)
	}
	ref, err := buildlog.Store(ctx, buildlog.NewReader(w.js), w.archive, key, run, v1.ArchiveObject(tenant, key, run))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := w.runs.Claim(ctx, &v1.BuildRecord{Key: key, Run: run, Tenant: tenant, Name: "web", RequestID: "r",
		State: v1.StateSucceeded, Logs: ref}); err != nil || !ok {
		t.Fatalf("record: %v %v", ok, err)
	}
	data, _, err := buildlog.NewReader(w.js).ReadAll(ctx, key, run)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// Held: an archived log read a byte at a time (MaxBytes 1) still moves a
// whole line per page and ends with Done and the whole log; archive
// offsets past the end, or huge, are refused; a stream cursor on an
// archived log continues without serving anything twice.
func TestLogAttackArchivePagesWithExtremeLimits(t *testing.T) {
	t.Parallel()
	w := newLogsWorld(t)
	key := hexKey("archived!")
	var lines []string
	for i := range 20 {
		lines = append(lines, fmt.Sprintf("line %02d %s", i, strings.Repeat("z", i*7)))
	}
	want := w.archived(t, "acme", key, "runX", lines...)
	var got []byte
	cursor := ""
	for pages := 0; ; pages++ {
		if pages > 100 {
			t.Fatalf("no end after %d pages of MaxBytes 1; got %q", pages, got)
		}
		b, _ := json.Marshal(v1.LogsRequest{Target: key, Cursor: cursor, MaxBytes: 1, WaitMs: -5})
		rep := w.ask(t, "acme", string(b))
		if rep.Error != "" {
			t.Fatalf("page %d: %s", pages, rep.Error)
		}
		if !rep.Done && len(rep.Data) == 0 {
			t.Fatalf("page %d: no progress, cursor %q", pages, rep.Cursor)
		}
		got = append(got, rep.Data...)
		cursor = rep.Cursor
		if rep.Done {
			if rep.State != "succeeded" {
				t.Errorf("done with state %q", rep.State)
			}
			break
		}
	}
	if !bytes.Equal(got, want) {
		t.Errorf("read by pages of one byte:\n%s\nstored:\n%s", got, want)
	}
	for _, cur := range []string{"runX:a:" + fmt.Sprint(len(want)+1), "runX:a:9223372036854775807"} {
		if rep := w.ask(t, "acme", req(key, cur)); rep.Error == "" || len(rep.Data) > 0 {
			t.Errorf("cursor %q past the end: %+v", cur, rep)
		}
	}
}
