package buildlog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

const testKey = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func setup(t *testing.T) (jetstream.JetStream, *Reader) {
	t.Helper()
	_, _, js := testnats.JetStream(t)
	if _, err := EnsureStream(context.Background(), js, StreamConfig{}); err != nil {
		t.Fatal(err)
	}
	return js, NewReader(js)
}

func texts(t *testing.T, data []byte) []string {
	t.Helper()
	var out []string
	if err := v1.EachLogLine(data, func(l v1.LogLine) bool {
		out = append(out, l.Stream+" "+string(l.Text))
		return true
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func chunks(t *testing.T, r *Reader, run string) []*Chunk {
	t.Helper()
	var out []*Chunk
	var seq uint64
	for {
		c, err := r.Next(context.Background(), testKey, run, seq)
		if err != nil {
			t.Fatal(err)
		}
		if c == nil {
			return out
		}
		out = append(out, c)
		seq = c.Seq
	}
}

var t0 = time.Date(2026, 12, 2, 3, 0, 0, 0, time.UTC)

// Lines are chunked at ChunkBytes, and every chunk's totals add up.
func TestWriterChunksAtSize(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	w, err := Open(ctx, js, testKey, "r1", Options{ChunkBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for i := range 100 {
		text := fmt.Sprintf("line %03d %s", i, strings.Repeat("x", 40))
		want = append(want, "kaniko "+text)
		if err := w.Line(ctx, "p1", "kaniko", 1, t0.Add(time.Duration(i)*time.Millisecond), []byte(text)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	cs := chunks(t, r, "r1")
	if len(cs) < 5 {
		t.Fatalf("100 lines of ~80 bytes in chunks of 1 KiB: %d chunks", len(cs))
	}
	var all []byte
	for _, c := range cs {
		if len(c.Data) > 1024 {
			t.Fatalf("chunk %d holds %d bytes, more than the 1024 asked", c.Seq, len(c.Data))
		}
		all = append(all, c.Data...)
		if c.Bytes != int64(len(all)) {
			t.Fatalf("chunk %d says %d bytes so far, the chunks hold %d", c.Seq, c.Bytes, len(all))
		}
	}
	if got := texts(t, all); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stored lines differ:\n%s", strings.Join(got, "\n"))
	}
	if p := w.Position(); p.Pod != "p1" || p.Container != "kaniko" || !p.Time.Equal(t0.Add(99*time.Millisecond)) || p.Count != 1 {
		t.Fatalf("position %+v", p)
	}
}

// Run flushes buffered lines after FlushEvery, without more lines coming.
func TestWriterFlushesOnTime(t *testing.T) {
	js, r := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := Open(ctx, js, testKey, "r1", Options{FlushEvery: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { w.Run(ctx); close(done) }()
	if err := w.Line(ctx, "p1", "kaniko", 1, t0, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(chunks(t, r, "r1")) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("a buffered line was not stored within 5 s of a 50 ms flush interval")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
}

// A writer opened on a run's stored log resumes at its position: the same
// timestamp counted across chunks.
func TestWriterResumesPosition(t *testing.T) {
	js, _ := setup(t)
	ctx := context.Background()
	w, _ := Open(ctx, js, testKey, "r1", Options{})
	for _, text := range []string{"a", "b"} {
		if err := w.Line(ctx, "p1", "kaniko", 1, t0, []byte(text)); err != nil {
			t.Fatal(err)
		}
		if err := w.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}
	w2, err := Open(ctx, js, testKey, "r1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if p := w2.Position(); p.Pod != "p1" || p.Container != "kaniko" || !p.Time.Equal(t0) || p.Count != 2 || p.Attempt != 1 {
		t.Fatalf("resumed position %+v, want p1/kaniko at t0, count 2", p)
	}
	if err := w2.Attempt(ctx, "p2", 2, "pod p1 failed"); err != nil {
		t.Fatal(err)
	}
	if err := w2.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	w3, _ := Open(ctx, js, testKey, "r1", Options{})
	if p := w3.Position(); p.Pod != "p2" || p.Container != "" || !p.Time.IsZero() || p.Attempt != 2 {
		t.Fatalf("position after a new attempt %+v", p)
	}
}

// Two writers of one run: the second one's append fails with a conflict,
// it takes the stored state, and the log holds every line once.
func TestWriterConflict(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	a, _ := Open(ctx, js, testKey, "r1", Options{})
	b, _ := Open(ctx, js, testKey, "r1", Options{})
	_ = a.Line(ctx, "p1", "kaniko", 1, t0, []byte("one"))
	if err := a.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// b read another line at the same place: its chunk is refused.
	err := b.Line(ctx, "p1", "kaniko", 1, t0, []byte("not one"))
	if err == nil {
		err = b.Flush(ctx)
	}
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("second writer's append: %v, want ErrConflict", err)
	}
	if p := b.Position(); !p.Time.Equal(t0) || p.Count != 1 {
		t.Fatalf("after the conflict the writer stands at %+v", p)
	}
	_ = b.Line(ctx, "p1", "kaniko", 1, t0.Add(time.Second), []byte("two"))
	if err := b.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.End(ctx, "succeeded", ""); err != nil {
		t.Fatal(err)
	}
	data, last, err := r.ReadAll(ctx, testKey, "r1")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(texts(t, data), "|"); got != "kaniko one|kaniko two|buildq build succeeded" {
		t.Fatalf("log %q", got)
	}
	if !last.Ended || last.State != "succeeded" {
		t.Fatalf("last chunk %+v", last)
	}
	// End is stored once.
	if err := b.End(ctx, "failed", "x"); err != nil {
		t.Fatal(err)
	}
	if n := len(chunks(t, r, "r1")); n != 3 {
		t.Fatalf("%d chunks after a second End, want 3", n)
	}
}

// Secret values are masked before anything is stored, the longest first.
func TestWriterMasks(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	w, _ := Open(ctx, js, testKey, "r1", Options{Mask: []string{"s3cr3t", "s3cr3t-token", ""}})
	_ = w.Line(ctx, "p", "kaniko", 1, t0, []byte("token=s3cr3t-token and s3cr3t, not s3cr"))
	_ = w.End(ctx, "succeeded", "")
	data, _, err := r.ReadAll(ctx, testKey, "r1")
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(data, []byte("s3cr3t")) {
		t.Fatalf("secret stored: %q", data)
	}
	if got := texts(t, data)[0]; got != "kaniko token=*** and ***, not s3cr" {
		t.Fatalf("masked line %q", got)
	}
}

// Past the cap, a marker says so once and nothing else is kept, but the
// end is.
func TestWriterCap(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	w, _ := Open(ctx, js, testKey, "r1", Options{Cap: 4096})
	for i := range 200 {
		_ = w.Line(ctx, "p", "kaniko", 1, t0.Add(time.Duration(i)), []byte(strings.Repeat("y", 60)))
	}
	if !w.Truncated() {
		t.Fatal("not truncated after 12 KiB with a 4 KiB cap")
	}
	_ = w.End(ctx, "succeeded", "")
	data, last, err := r.ReadAll(ctx, testKey, "r1")
	if err != nil {
		t.Fatal(err)
	}
	lines := texts(t, data)
	n := len(lines)
	if !strings.HasPrefix(lines[n-2], "buildq log truncated") || lines[n-1] != "buildq build succeeded" || !last.Truncated {
		t.Fatalf("last lines %q, truncated %v", lines[n-2:], last.Truncated)
	}
	if len(data) > 4096+400 {
		t.Fatalf("%d bytes kept with a cap of 4096", len(data))
	}
}

// Invalid UTF-8 and every other byte but newline are kept as printed;
// a line longer than a chunk is split.
func TestWriterBytesKept(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	w, _ := Open(ctx, js, testKey, "r1", Options{ChunkBytes: 1024})
	raw := []byte("bin \xff\xfe\x00\x1b[31mred\r")
	_ = w.Line(ctx, "p", "kaniko", 1, t0, raw)
	long := bytes.Repeat([]byte("z"), 3000)
	_ = w.Line(ctx, "p", "kaniko", 1, t0.Add(1), long)
	_ = w.End(ctx, "succeeded", "")
	data, _, err := r.ReadAll(ctx, testKey, "r1")
	if err != nil {
		t.Fatal(err)
	}
	var got [][]byte
	_ = v1.EachLogLine(data, func(l v1.LogLine) bool { got = append(got, append([]byte(nil), l.Text...)); return true })
	if !bytes.Equal(got[0], raw) {
		t.Fatalf("line %q, printed %q", got[0], raw)
	}
	if joined := bytes.Join(got[1:len(got)-1], nil); !bytes.Equal(joined, long) || len(got) < 5 {
		t.Fatalf("long line split into %d pieces, %d bytes together", len(got)-2, len(joined))
	}
}

// The archive is the stored log, gzip, with its digest; reading it back
// checks the digest.
func TestArchive(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	w, _ := Open(ctx, js, testKey, "r1", Options{})
	_ = w.Own(ctx, "claimed")
	_ = w.Line(ctx, "p", "kaniko", 1, t0, []byte("hello"))
	if _, err := Store(ctx, r, &memArchive{}, testKey, "r1", "o"); !errors.Is(err, ErrNotEnded) {
		t.Fatalf("archive of a log not ended: %v", err)
	}
	_ = w.End(ctx, "failed", "BuildFailed")
	a := &memArchive{}
	ref, err := Store(ctx, r, a, testKey, "r1", v1.ArchiveObject("acme", testKey, "r1"))
	if err != nil {
		t.Fatal(err)
	}
	if ref.Lines != 3 || ref.Bucket != "b" || !strings.HasPrefix(ref.Digest, "sha256:") || ref.Object != "logs/acme/"+testKey+"/r1.log.gz" {
		t.Fatalf("ref %+v", ref)
	}
	data, err := ReadArchive(ctx, a, ref)
	if err != nil {
		t.Fatal(err)
	}
	stored, _, _ := r.ReadAll(ctx, testKey, "r1")
	if !bytes.Equal(data, stored) || int64(len(data)) != ref.Bytes {
		t.Fatalf("archive %q, stored %q", data, stored)
	}
	// An archive larger than a worker reads is an error, not a log cut
	// short.
	if _, err := readArchive(ctx, a, ref, int64(len(data))-1); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("an archive past the read limit: %v", err)
	}
	if got, err := readArchive(ctx, a, ref, int64(len(data))); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("an archive at the read limit: %v", err)
	}
	// The same log archives to the same bytes.
	ref2, _ := Store(ctx, r, a, testKey, "r1", ref.Object)
	if ref2.Digest != ref.Digest {
		t.Fatal("archiving twice gave two digests")
	}
	a.objects[ref.Object][30] ^= 1
	if _, err := ReadArchive(ctx, a, ref); err == nil || !strings.Contains(err.Error(), "not sha256") {
		t.Fatalf("a changed archive was read: %v", err)
	}
}

type memArchive struct {
	mu      sync.Mutex
	objects map[string][]byte
}

func (m *memArchive) PutLog(_ context.Context, object string, data []byte) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.objects == nil {
		m.objects = map[string][]byte{}
	}
	m.objects[object] = append([]byte(nil), data...)
	return "b", nil
}

func (m *memArchive) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	d, ok := m.objects[key]
	if !ok {
		return nil, errors.New("not found")
	}
	return io.NopCloser(bytes.NewReader(d)), nil
}

// A conflict met by the periodic flush is not lost: the capturer's next
// line is refused with ErrConflict, so it resumes from the stored
// position instead of going on after the lines the flush dropped.
func TestWriterPeriodicConflictReachesTheCapturer(t *testing.T) {
	js, _ := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, _ := Open(ctx, js, testKey, "r1", Options{FlushEvery: 300 * time.Millisecond})
	// b's first line is stored at once (nothing stored for a while).
	if err := b.Line(ctx, "p", "kaniko", 1, t0, []byte("b0")); err != nil {
		t.Fatal(err)
	}
	a, _ := Open(ctx, js, testKey, "r1", Options{})
	if err := a.Line(ctx, "p", "kaniko", 1, t0.Add(time.Second), []byte("a1")); err != nil {
		t.Fatal(err)
	}
	// b's next line waits for its next chunk, which the periodic flush
	// stores — or finds a's there.
	if err := b.Line(ctx, "p", "kaniko", 1, t0.Add(time.Second), []byte("b1, another line")); err != nil {
		t.Fatal(err)
	}
	go b.Run(ctx)
	deadline := time.Now().Add(5 * time.Second)
	for b.Lines() != 2 || !b.Position().Time.Equal(t0.Add(time.Second)) || b.Due() {
		if time.Now().After(deadline) {
			t.Fatalf("b's flush did not meet the conflict: lines %d, position %+v", b.Lines(), b.Position())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := b.Line(ctx, "p", "kaniko", 1, t0.Add(2*time.Second), []byte("next")); !errors.Is(err, ErrConflict) {
		t.Fatalf("the line after a dropped flush: %v, want ErrConflict", err)
	}
	if err := b.Line(ctx, "p", "kaniko", 1, t0.Add(2*time.Second), []byte("next")); err != nil {
		t.Fatalf("the resumed line: %v", err)
	}
}

// blockedPublishes holds every publish until release is closed, and says
// when one is waiting.
type blockedPublishes struct {
	jetstream.JetStream
	waiting chan struct{}
	release chan struct{}
}

func (b *blockedPublishes) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	select {
	case b.waiting <- struct{}{}:
	default:
	}
	select {
	case <-b.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return b.JetStream.PublishMsg(ctx, m, opts...)
}

// Once Start's flusher runs, a line to store at once (the first, or one
// after a quiet FlushEvery) is stored by the flusher: its writer returns
// while the publish still waits, and the line is stored once it goes.
func TestAStartedWriterHandsTheLeadingEdgeToItsFlusher(t *testing.T) {
	js, r := setup(t)
	blocked := &blockedPublishes{JetStream: js, waiting: make(chan struct{}, 1), release: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := OpenNew(blocked, testKey, "r1", Options{FlushEvery: time.Hour})
	w.Start(ctx)
	owned := make(chan error, 1)
	go func() { owned <- w.Own(ctx, "claimed") }()
	select {
	case err := <-owned:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		close(blocked.release)
		t.Fatal("Own waited for the stream: the leading edge was not handed to the flusher")
	}
	select {
	case <-blocked.waiting:
	case <-time.After(10 * time.Second):
		t.Fatal("the flusher never stored the line")
	}
	close(blocked.release)
	for deadline := time.Now().Add(10 * time.Second); len(chunks(t, r, "r1")) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the line was not stored once its publish went")
		}
	}
	if got := strings.Join(texts(t, chunks(t, r, "r1")[0].Data), "|"); got != "buildq claimed" {
		t.Fatalf("log %q", got)
	}
}

// A writer opened as new reads nothing; its first chunk is stored only
// while the run's subject is empty. Another writer's chunk stored first
// makes it a lost race (ErrConflict), after which it stands where the
// stored log does, as any writer that lost one.
func TestANewWritersFirstChunkNeedsAnEmptyLog(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	fresh := OpenNew(js, testKey, "r2", Options{})
	if err := fresh.Own(ctx, "first"); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(texts(t, chunks(t, r, "r2")[0].Data), "|"); got != "buildq first" {
		t.Fatalf("log %q", got)
	}

	other, err := Open(ctx, js, testKey, "r3", Options{})
	if err != nil {
		t.Fatal(err)
	}
	late := OpenNew(js, testKey, "r3", Options{})
	_ = other.Line(ctx, "p1", "kaniko", 1, t0, []byte("stored first"))
	if err := other.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	err = late.Line(ctx, "p1", "kaniko", 1, t0.Add(time.Second), []byte("not first"))
	if err == nil {
		err = late.Flush(ctx)
	}
	if !errors.Is(err, ErrConflict) {
		t.Fatalf("a new writer's chunk over a stored one: %v, want ErrConflict", err)
	}
	if p := late.Position(); !p.Time.Equal(t0) || p.Count != 1 {
		t.Fatalf("after the conflict the writer stands at %+v, want the stored log's position", p)
	}
	if n := len(chunks(t, r, "r3")); n != 1 {
		t.Fatalf("%d chunks, want the one stored first", n)
	}
}

// cutShort publishes for real and then answers as if its context had
// ended in flight (a cancel after the message was sent); failing refuses
// every publish while set.
type cutShort struct {
	jetstream.JetStream
	cancel  context.CancelFunc
	cut     bool
	failing bool
}

func (c *cutShort) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	if c.failing {
		return nil, errors.New("the stream is away")
	}
	if c.cut {
		c.cut = false
		if _, err := c.JetStream.PublishMsg(context.Background(), m, opts...); err != nil {
			return nil, err
		}
		c.cancel()
		return nil, ctx.Err()
	}
	return c.JetStream.PublishMsg(ctx, m, opts...)
}

// A chunk whose publish was cut short by a cancel after it was sent has
// landed; the writer does not know it. Its End (on a context of its own,
// as a canceled run's log is ended) is still stored, after that chunk,
// and every line once.
func TestTheEndFollowsAChunkCutShortInFlight(t *testing.T) {
	js, r := setup(t)
	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := &cutShort{JetStream: js, cancel: cancel}
	w := OpenNew(cs, testKey, "r4", Options{})
	// The first line is stored at once: that publish is cut short.
	cs.cut = true
	if err := w.Line(runCtx, "p1", "kaniko", 1, t0, []byte("one")); !errors.Is(err, context.Canceled) {
		t.Fatalf("a line whose chunk was cut short: %v, want context.Canceled", err)
	}
	if err := w.End(context.Background(), "canceled", ""); err != nil {
		t.Fatalf("End after a chunk cut short in flight: %v", err)
	}
	data, last, err := r.ReadAll(context.Background(), testKey, "r4")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(texts(t, data), "|"); got != "kaniko one|buildq build canceled" {
		t.Fatalf("log %q", got)
	}
	if !last.Ended || last.State != "canceled" {
		t.Fatalf("last chunk %+v, want the end", last)
	}
}

// An End that could not be stored leaves nothing of itself behind: a
// later flush stores no end line without the end's mark, and End can be
// called again.
func TestAnEndNotStoredIsTakenBackOut(t *testing.T) {
	js, r := setup(t)
	ctx := context.Background()
	cs := &cutShort{JetStream: js}
	w := OpenNew(cs, testKey, "r5", Options{})
	_ = w.Line(ctx, "p1", "kaniko", 1, t0, []byte("one"))
	cs.failing = true
	if err := w.End(ctx, "succeeded", ""); err == nil {
		t.Fatal("End stored while every publish is refused")
	}
	if w.Ended() {
		t.Fatal("the log says it ended, but its end was not stored")
	}
	cs.failing = false
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w.End(ctx, "succeeded", ""); err != nil {
		t.Fatal(err)
	}
	data, last, err := r.ReadAll(ctx, testKey, "r5")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(texts(t, data), "|"); got != "kaniko one|buildq build succeeded" {
		t.Fatalf("log %q", got)
	}
	if !last.Ended || last.State != "succeeded" {
		t.Fatalf("last chunk %+v, want the end", last)
	}
}
