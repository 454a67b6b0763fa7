package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/internal/testnats"
	"github.com/buildq/buildq/worker/internal/buildlog"
)

// memLogArchive is a LogArchive in memory.
type memLogArchive struct {
	mu      sync.Mutex
	objects map[string][]byte
	fail    bool
}

func (m *memLogArchive) PutLog(_ context.Context, object string, data []byte) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail {
		return "", errors.New("the store is down")
	}
	if m.objects == nil {
		m.objects = map[string][]byte{}
	}
	m.objects[object] = append([]byte(nil), data...)
	return "logs-bucket", nil
}

func (m *memLogArchive) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.objects[key]
	if !ok {
		return nil, s3store.ErrNotFound
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

func withLogs(a LogArchive) func(*Config) {
	return func(c *Config) { c.Logs = LogsConfig{Enabled: true, Archive: a} }
}

// logsOf asks tenant's logs service for target's log, page by page from
// the start until it ends or no line comes, and returns the lines, the
// last reply and the first reply's note.
func logsOf(t *testing.T, e *env, tenant, target string) (string, v1.LogsReply) {
	t.Helper()
	var (
		out  strings.Builder
		last v1.LogsReply
	)
	req := v1.LogsRequest{Target: target}
	for range 100 {
		b, _ := json.Marshal(req)
		m, err := tenantAPIRequest(e.nc, tenant, v1.APILogsSubject(tenant), string(b), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var rep v1.LogsReply
		if err := json.Unmarshal(m.Data, &rep); err != nil {
			t.Fatal(err)
		}
		if rep.Note != "" && out.Len() == 0 {
			out.WriteString("note: " + rep.Note + "\n")
		}
		if err := v1.EachLogLine(rep.Data, func(l v1.LogLine) bool {
			out.WriteString(l.Stream + " " + string(l.Text) + "\n")
			return true
		}); err != nil {
			t.Fatal(err)
		}
		last = rep
		if rep.Error != "" || rep.Done || len(rep.Data) == 0 {
			return out.String(), rep
		}
		req.Cursor = rep.Cursor
	}
	return out.String(), last
}

// A build's log — the executor's steps and buildq's own lines — is in the
// stream while it runs and archived when it ends; its result says where.
// The log is its tenant's: another tenant asking by request id or by
// build key gets nothing, and a request answered from the cache shows the
// log of the build that made the image, headed by a note.
func TestBuildLogsOfALocalBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nARG TOKEN\nCOPY app /app\n", "app": "hello"})
	r := tenantRequestFor("acme", digest)
	r.BuildArgs = map[string]string{"TOKEN": "t0p-s3cret"}
	r.SecretBuildArgs = []string{"TOKEN"}
	archive := &memLogArchive{}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		withLogs(archive)(c)
	})
	results := e.collect()
	r.RequestID = "first"
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	res := results.waitFor(t, 1, 20*time.Second)[0]
	if res.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	ref := res.Data.Logs
	if !ref.Archived() || ref.Key != res.Data.Key || ref.Object != v1.ArchiveObject("acme", res.Data.Key, ref.Run) || !strings.HasPrefix(ref.Digest, "sha256:") || ref.Lines < 5 {
		t.Fatalf("result's logs %s", mustJSON(t, ref))
	}
	text, rep := logsOf(t, e, "acme", "first")
	if strings.Contains(text, "first") {
		t.Errorf("the log names the request that claimed the build (every tenant it answers reads it):\n%s", text)
	}
	for _, want := range []string{
		"buildq build " + res.Data.Key + " claimed by worker w1",
		"buildq fetching context s3://",
		"local FROM scratch",
		"local ARG TOKEN",
		"local COPY app /app: 1 file, 5 B",
		"buildq pushed " + res.Data.Digest,
		"buildq build succeeded",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("log lacks %q:\n%s", want, text)
		}
	}
	if strings.Contains(text, "t0p-s3cret") {
		t.Errorf("the secret build argument is in the log:\n%s", text)
	}
	if !rep.Done || rep.State != "succeeded" || rep.Archive == nil || rep.Archive.Digest != ref.Digest {
		t.Fatalf("last reply %s", mustJSON(t, rep))
	}
	// The archive holds what was served, line for line.
	z := archive.objects[ref.Object]
	if len(z) == 0 {
		t.Fatal("no archive object")
	}

	// Answered from the cache: the same log, headed by a note.
	r2 := *r
	r2.RequestID = "second"
	if _, err := e.pub.Publish(context.Background(), &r2); err != nil {
		t.Fatal(err)
	}
	res2 := byID(results.waitFor(t, 2, 20*time.Second))["second"][0]
	if res2.Data.Origin != v1.OriginCache || res2.Data.Logs == nil || res2.Data.Logs.Run != ref.Run {
		t.Fatalf("cache hit %s", mustJSON(t, res2))
	}
	text2, _ := logsOf(t, e, "acme", "second")
	if !strings.HasPrefix(text2, "note: request second was answered from the cache") || !strings.HasSuffix(text2, text) {
		t.Fatalf("cache hit's log:\n%s\nthe build's:\n%s", text2, text)
	}
	// By build key, for the tenant whose request claimed it.
	if text3, _ := logsOf(t, e, "acme", res.Data.Key); text3 != text {
		t.Fatalf("log by key:\n%s", text3)
	}

	// Another tenant: by request id and by build key, nothing.
	for _, target := range []string{"first", res.Data.Key} {
		text, rep := logsOf(t, e, "mallory", target)
		if rep.Error == "" || text != "" || rep.Key != "" || rep.Run != "" {
			t.Errorf("mallory asking for %s got %q, reply %s", target, text, mustJSON(t, rep))
		}
	}
	_, unknown := logsOf(t, e, "mallory", hex64("nothing"))
	_, known := logsOf(t, e, "mallory", res.Data.Key)
	if unknown.Error != strings.ReplaceAll(known.Error, res.Data.Key, hex64("nothing")) {
		t.Errorf("a key another tenant built answers %q, an unknown key %q", known.Error, unknown.Error)
	}
}

// An archive that cannot be written is not silent: the result's logs say
// why, and the log is still served from the stream.
func TestBuildLogArchiveFailureIsReported(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	digest, tgz := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "hello"})
	r := tenantRequestFor("acme", digest)
	archive := &memLogArchive{fail: true}
	e.startLocalWorker("w1", NewLocalBackend(mapContexts{r.Source.S3.Key: tgz}, tr.client, t.TempDir(), 0), func(c *Config) {
		withRegistry(tr)(c)
		withLogs(archive)(c)
	})
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	res := results.waitFor(t, 1, 30*time.Second)[0]
	if res.Data.Status != v1.StatusSucceeded || res.Data.Logs == nil || res.Data.Logs.Archived() || !strings.Contains(res.Data.Logs.Error, "the store is down") {
		t.Fatalf("result %s", mustJSON(t, res))
	}
	text, rep := logsOf(t, e, "acme", r.RequestID)
	if !rep.Done || !strings.Contains(text, "local COPY app /app") {
		t.Fatalf("log from the stream:\n%s\n%s", text, mustJSON(t, rep))
	}
}

// Two capturers of one run — a worker that lost the run but still reads
// its Pod, and the one that took it over — each append what they read
// from where they last saw the stored log end: the second one's chunk
// fails its precondition, it resumes from the stored position, and the
// log holds every line once, in order.
func TestBuildLogTwoCapturersStoreEachLineOnce(t *testing.T) {
	t.Parallel()
	_, _, js := testnats.JetStream(t)
	ctx := context.Background()
	if _, err := buildlog.EnsureStream(ctx, js, buildlog.StreamConfig{}); err != nil {
		t.Fatal(err)
	}
	key := hex64("two capturers")
	t0 := time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)
	// capture reads the Pod's lines 1..upto after the writer's stored
	// position, as the follower does, and stores them.
	capture := func(lw *buildlog.Writer, upto int) error {
		pos := lw.Position()
		for i := 1; i <= upto; i++ {
			ts := t0.Add(time.Duration(i) * time.Millisecond)
			if pos.Container == "kaniko" && !ts.After(pos.Time) {
				continue
			}
			if err := lw.Line(ctx, "pod-1", "kaniko", 1, ts, []byte(fmt.Sprintf("line %d", i))); err != nil {
				return err
			}
		}
		return lw.Flush(ctx)
	}
	a, err := buildlog.Open(ctx, js, key, "r1", buildlog.Options{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := buildlog.Open(ctx, js, key, "r1", buildlog.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := capture(a, 10); err != nil {
		t.Fatal(err)
	}
	err = capture(b, 15)
	if errors.Is(err, buildlog.ErrConflict) {
		err = capture(b, 20) // resumes after what a stored
	} else if err == nil {
		err = capture(b, 20)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := b.End(ctx, "succeeded", ""); err != nil {
		t.Fatal(err)
	}
	data, _, err := buildlog.NewReader(js).ReadAll(ctx, key, "r1")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	_ = v1.EachLogLine(data, func(l v1.LogLine) bool { got = append(got, string(l.Text)); return true })
	var want []string
	for i := 1; i <= 20; i++ {
		want = append(want, fmt.Sprintf("line %d", i))
	}
	want = append(want, "build succeeded")
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("stored log:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// A fresh build's log is opened without reading the logs stream: nothing
// is stored under a run claimed just now, and the read (the stream's
// info, then its last chunk) was two round trips on the way to the Job.
// Its first line is stored all the same, beside the Job's create.
func TestAFreshBuildsLogIsNotReadBeforeItsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", withLogs(&memLogArchive{}))
	results := e.collect()
	var reads atomic.Int32
	for _, subj := range []string{
		"$JS.API.STREAM.INFO." + v1.LogsStream,
		"$JS.API.STREAM.MSG.GET." + v1.LogsStream,
		"$JS.API.DIRECT.GET." + v1.LogsStream,
		"$JS.API.DIRECT.GET." + v1.LogsStream + ".>",
	} {
		sub, err := e.nc.Subscribe(subj, func(*nats.Msg) { reads.Add(1) })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	req := request("fresh-log")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if n := reads.Load(); n != 0 {
		t.Errorf("%d reads of %s before the Job of a fresh run: its log is empty, nothing needs reading", n, v1.LogsStream)
	}
	key := v1.BuildKey(req, kanikoID)
	rec := e.claim(key)
	if rec == nil {
		t.Fatal("no record of the build")
	}
	stream, err := e.js.Stream(context.Background(), v1.LogsStream)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the log's first line stored", func() bool {
		m, err := stream.GetLastMsgForSubject(context.Background(), v1.LogsSubject(key, rec.Run))
		return err == nil && strings.Contains(string(m.Data), "claimed by worker w1")
	})
	e.kubelet(job, 0, digestOf("fresh-log"))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Logs == nil {
		t.Fatalf("result %s, want the build's image and its log", mustJSON(t, r.Data))
	}
}
