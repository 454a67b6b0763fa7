// Package buildlog keeps the logs of build runs in the JetStream stream
// BUILDQ_LOGS, one subject per run (v1.LogsSubject), and archives each
// finished run's log to S3.
//
// A run's log is a sequence of chunks, each one message: whole lines in
// the stored format (v1.LogLine), at most ChunkBytes or FlushEvery's worth.
// Every chunk carries in its headers where the capture stood after its
// last line (the pod, the container, the kubelet timestamp of the
// container's last line and how many lines carried it): the last line
// the chunk holds, never one still buffered, so whoever captures next
// (the same worker after a broken stream, another after a crash) resumes
// exactly there. A line too long for a chunk is stored in pieces; a
// chunk that holds only its first pieces says how many of its bytes are
// stored, and the writer resuming there stores only the rest. Chunks are
// published with the subject's last sequence as a precondition: two
// capturers of one run cannot both append, and a publish whose outcome
// was lost is found by its totals, so the stored log holds every line
// once.
package buildlog

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// Defaults of a writer.
const (
	DefaultCap        = 10 << 20
	DefaultChunkBytes = 64 << 10
	DefaultFlushEvery = 250 * time.Millisecond
)

// Headers of a chunk.
const (
	hdrPod       = "Buildq-Log-Pod"
	hdrContainer = "Buildq-Log-Container"
	hdrTime      = "Buildq-Log-Time"
	hdrCount     = "Buildq-Log-Count"
	hdrAttempt   = "Buildq-Log-Attempt"
	hdrBytes     = "Buildq-Log-Bytes"
	hdrLines     = "Buildq-Log-Lines"
	hdrTruncated = "Buildq-Log-Truncated"
	// hdrPart: the bytes stored of the line after the position (the first
	// pieces of a line longer than a chunk).
	hdrPart = "Buildq-Log-Part"
	// hdrEnd marks the run's last chunk: the run's state.
	hdrEnd    = "Buildq-Log-End"
	hdrReason = "Buildq-Log-Reason"
	// hdrObject names the archive object the run's log goes to.
	hdrObject = "Buildq-Log-Object"
)

// ErrConflict means the stored log moved on under the writer (another capturer
// appended, or a publish of unknown outcome was not ours). The writer
// has dropped what it buffered and taken the stored state: the caller
// resumes from Position.
var ErrConflict = errors.New("buildlog: the run's log was appended to by another writer")

// Position is where the capture of a run stands: the last line stored of
// the executor's output. When only the first pieces of a line longer than
// a chunk are stored, it stands just before that line (Count one less,
// possibly 0: before the first line at Time), and the writer resuming
// there stores only the rest of the line.
type Position struct {
	Pod       string
	Container string
	// Time is the kubelet timestamp of the container's last line; Count
	// how many of its lines carried exactly that time.
	Time    time.Time
	Count   int
	Attempt int
}

// Options of a writer.
type Options struct {
	// Cap bounds the log's bytes (DefaultCap); the line that would pass it
	// is replaced by a marker line saying so, and later lines are dropped.
	Cap int64
	// Mask are secret values, written as "***" wherever they appear.
	Mask []string
	// ChunkBytes bounds a chunk (DefaultChunkBytes). FlushEvery
	// (DefaultFlushEvery) is how long lines wait: a line that comes
	// FlushEvery or more after the last chunk was stored is stored at
	// once, later ones once the first of them has waited FlushEvery —
	// which Run checks every FlushEvery/5, so a line waits up to about
	// 1.2 × FlushEvery.
	ChunkBytes int
	FlushEvery time.Duration
	Now        func() time.Time
	// Object is the archive object the log will go to (v1.ArchiveObject),
	// recorded with the end of the log.
	Object string
	// Stored, when set, is told the size of every chunk stored.
	Stored func(bytes int)
}

func (o Options) withDefaults() Options {
	if o.Cap <= 0 {
		o.Cap = DefaultCap
	}
	if o.ChunkBytes <= 0 {
		o.ChunkBytes = DefaultChunkBytes
	}
	if o.FlushEvery <= 0 {
		o.FlushEvery = DefaultFlushEvery
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	o.Mask = maskValues(o.Mask)
	return o
}

// state is what the stored log says (and, ahead of it, what the writer
// has buffered).
type state struct {
	pos Position
	// part: the bytes of the line after pos already stored (its first
	// pieces), 0 when none.
	part      int
	bytes     int64
	lines     int64
	truncated bool
	ended     bool
}

// Writer appends to one run's log. It is safe for concurrent use.
type Writer struct {
	js      jetstream.JetStream
	subject string
	run     string
	opts    Options
	// id tells this writer's chunks from another's (Nats-Msg-Id).
	id string

	mu sync.Mutex
	// stored is the state after the last stored chunk; last its sequence
	// (0: the subject has none).
	stored state
	last   uint64
	// next is the state after the buffered lines.
	next  state
	buf   []byte
	since time.Time // when the first buffered line was added
	// flushed is when a chunk was last stored: a line after a quiet
	// FlushEvery is stored at once (leading edge), the lines that follow
	// it within FlushEvery wait for the next chunk.
	flushed time.Time
	// conflict: a flush found the stored log moved on (ErrConflict) and
	// dropped the buffer; the next Line or Attempt says so, so its
	// caller resumes from Position instead of going on after a gap.
	conflict bool
	// kick, while Start's flusher runs, takes the lines to store at once
	// (the leading edge) off their writer's hands: nil, the writer
	// stores them itself.
	kick chan struct{}
}

// Open returns a writer for run of key, resuming after what is stored.
func Open(ctx context.Context, js jetstream.JetStream, key, run string, opts Options) (*Writer, error) {
	w := OpenNew(js, key, run, opts)
	if err := w.resync(ctx); err != nil {
		return nil, err
	}
	return w, nil
}

// OpenNew returns a writer for the log of a run nothing is stored under
// yet — one claimed just now, under a run id never used before — without
// reading the stream: Open's read is two round trips on the way to the
// build's Job. Its first chunk is stored only while the subject is still
// empty (every chunk's precondition: the subject's last sequence, here
// none); should another writer have stored one first, that flush fails
// as any lost race does (ErrConflict) and the writer resyncs.
func OpenNew(js jetstream.JetStream, key, run string, opts Options) *Writer {
	var id [6]byte
	_, _ = rand.Read(id[:])
	return &Writer{js: js, subject: v1.LogsSubject(key, run), run: run, opts: opts.withDefaults(), id: hex.EncodeToString(id[:])}
}

// Position is where the stored log's capture stands (buffered lines not
// counted).
func (w *Writer) Position() Position {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stored.pos
}

// Ended reports whether the log is ended (End was stored).
func (w *Writer) Ended() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.next.ended
}

// Truncated reports whether the log reached its cap: further executor
// lines are dropped, so there is no need to read them.
func (w *Writer) Truncated() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.next.truncated
}

// AddMask adds secret values to mask in the lines added from now on.
func (w *Writer) AddMask(values []string) {
	if len(values) == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.opts.Mask = append(w.opts.Mask, values...)
	w.opts = w.opts.withDefaults()
}

// Lines is how many lines the log holds (buffered ones included).
func (w *Writer) Lines() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.next.lines
}

// Subject is the run's log subject.
func (w *Writer) Subject() string { return w.subject }

// Line adds one line of the executor's output: printed by container of
// pod (attempt) at ts. It flushes when the chunk is full.
func (w *Writer) Line(ctx context.Context, pod, container string, attempt int, ts time.Time, text []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.next.ended {
		return nil
	}
	if w.conflict {
		w.conflict = false
		return ErrConflict
	}
	// at is where the capture stands once the line is stored; the state
	// moves there only then (add), so a chunk stored before never names
	// it.
	at := w.next.pos
	if at.Pod == pod && at.Container == container && at.Time.Equal(ts) {
		at.Count++
	} else {
		at.Time, at.Count = ts, 1
	}
	at.Pod, at.Container, at.Attempt = pod, container, attempt
	if w.next.truncated {
		// Dropped, but the position moves: a resumed capture does not
		// read it again.
		w.next.pos, w.next.part = at, 0
		return nil
	}
	text = w.mask(text)
	part := 0
	if p := w.next.pos; w.next.part > 0 && p.Pod == pod && p.Container == container && p.Time.Equal(ts) {
		// The line the stored position stands just before (at.Count is
		// p.Count+1): its first w.next.part bytes are stored already.
		part = min(w.next.part, len(text))
		text = text[part:]
	}
	if part > 0 && len(text) == 0 {
		w.next.pos, w.next.part = at, 0
		return nil
	}
	return w.told(w.add(ctx, v1.LogLine{Time: ts, Stream: container, Attempt: attempt, Text: text}, &at, part))
}

// told clears the pending conflict when err reports it to the caller.
func (w *Writer) told(err error) error {
	if errors.Is(err, ErrConflict) {
		w.conflict = false
	}
	return err
}

// Own adds a line buildq writes itself (stream v1.LogStreamBuildq), at
// the current time.
func (w *Writer) Own(ctx context.Context, text string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.next.ended || w.next.truncated {
		return nil
	}
	return w.add(ctx, w.own(text), nil, 0)
}

// Attempt records that the capture moved on to pod, a new attempt of the
// build (the Job retried): a line says so, and a resumed capture starts
// there.
func (w *Writer) Attempt(ctx context.Context, pod string, attempt int, reason string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.next.ended {
		return nil
	}
	if w.conflict {
		w.conflict = false
		return ErrConflict
	}
	at := Position{Pod: pod, Attempt: attempt}
	if w.next.truncated {
		w.next.pos, w.next.part = at, 0
		return nil
	}
	msg := fmt.Sprintf("attempt %d: pod %s", attempt, pod)
	if reason != "" {
		msg += " (" + reason + ")"
	}
	l := w.own(msg)
	l.Attempt = max(attempt, 1)
	return w.told(w.add(ctx, l, &at, 0))
}

func (w *Writer) own(text string) v1.LogLine {
	attempt := max(w.next.pos.Attempt, 1)
	return v1.LogLine{Time: w.opts.Now().UTC(), Stream: v1.LogStreamBuildq, Attempt: attempt, Text: w.mask([]byte(text))}
}

// add buffers l, or the marker when l would pass the cap; w.mu is held.
// at is where the capture stands once l is stored (nil: l is one of
// buildq's own lines, which does not move it), part the bytes of the
// executor's line stored before l.Text (a resumed long line).
//
// A line that does not fit the chunk being filled first stores that
// chunk, with the state it holds; the state moves to the line only once
// the line is in the buffer. A line longer than a chunk is stored in
// pieces (a chunk must fit a message): until its last piece is in, the
// position stands just before the line and part counts its bytes in.
func (w *Writer) add(ctx context.Context, l v1.LogLine, at *Position, part int) error {
	if l.Attempt == 0 {
		l.Attempt = 1
	}
	if bytes.IndexByte(l.Text, '\n') >= 0 {
		// A line is a line: a newline in its text would start another,
		// which could pass for one of buildq's own.
		l.Text = bytes.ReplaceAll(l.Text, []byte("\n"), []byte(" "))
	}
	limit := w.opts.ChunkBytes - 128 - len(l.Stream)
	rest := l.Text
	for {
		piece := l
		piece.Text = rest
		last := len(rest) <= limit
		if !last {
			piece.Text = rest[:limit]
		}
		line := v1.AppendLogLine(nil, piece)
		truncate := w.next.bytes+int64(len(line)) > w.opts.Cap && l.Stream != v1.LogStreamBuildq
		if truncate {
			m := w.own(fmt.Sprintf("log truncated: it reached the cap of %d bytes; the build's further output is not kept", w.opts.Cap))
			m.Attempt = l.Attempt
			line = v1.AppendLogLine(nil, m)
		}
		if len(w.buf)+len(line) > w.opts.ChunkBytes {
			// Stored as it stands: without this line.
			if err := w.flushLocked(ctx); err != nil {
				return err
			}
		}
		now := w.opts.Now()
		if len(w.buf) == 0 {
			w.since = now
		}
		w.buf = append(w.buf, line...)
		w.next.bytes += int64(len(line))
		w.next.lines++
		// The buffer holds the piece (or the marker): the state moves past
		// it. Past the cap the rest of the line is dropped, and the
		// position moves past all of it.
		switch {
		case at == nil:
		case last || truncate:
			w.next.pos, w.next.part = *at, 0
		default:
			part += len(piece.Text)
			before := *at
			before.Count--
			w.next.pos, w.next.part = before, part
		}
		if truncate {
			w.next.truncated = true
		}
		if now.Sub(w.flushed) >= w.opts.FlushEvery {
			if w.kick != nil {
				// Stored by the flusher, beside whatever its writer
				// does next (own.go: the Job's create); a conflict
				// waits for the next Line, as after a timed flush.
				select {
				case w.kick <- struct{}{}:
				default:
				}
			} else if err := w.flushLocked(ctx); err != nil {
				return err
			}
		}
		if last || truncate {
			return nil
		}
		rest = rest[limit:]
	}
}

// Due reports whether buffered lines have waited FlushEvery.
func (w *Writer) Due() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.buf) > 0 && w.opts.Now().Sub(w.since) >= w.opts.FlushEvery
}

// Flush stores the buffered lines. ErrConflict tells the caller to
// resume from Position.
func (w *Writer) Flush(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.conflict {
		w.conflict = false
		return ErrConflict
	}
	return w.told(w.flushLocked(ctx))
}

// Run flushes buffered lines once they waited FlushEvery, until ctx ends.
func (w *Writer) Run(ctx context.Context) {
	w.flusher(ctx, nil)
}

// Start runs the flusher of Run in a goroutine of its own until ctx
// ends, and from now on hands it the lines to store at once (a line after
// a quiet FlushEvery): their writer never waits on the stream for them.
func (w *Writer) Start(ctx context.Context) {
	kick := make(chan struct{}, 1)
	w.mu.Lock()
	w.kick = kick
	w.mu.Unlock()
	go w.flusher(ctx, kick)
}

func (w *Writer) flusher(ctx context.Context, kick chan struct{}) {
	t := time.NewTicker(w.opts.FlushEvery / 5)
	defer t.Stop()
	if kick != nil {
		defer func() {
			w.mu.Lock()
			if w.kick == kick {
				w.kick = nil
			}
			w.mu.Unlock()
		}()
	}
	for {
		select {
		case <-t.C:
			if w.Due() {
				// A conflict stays pending for the capturer's next line.
				// Any other failure is tried again at the next tick (the
				// lines stay buffered).
				w.mu.Lock()
				_ = w.flushLocked(ctx)
				w.mu.Unlock()
			}
		case <-kick:
			w.mu.Lock()
			// Unless a flush came between the kick and here: the lines
			// after it wait their FlushEvery.
			if w.opts.Now().Sub(w.flushed) >= w.opts.FlushEvery {
				_ = w.flushLocked(ctx)
			}
			w.mu.Unlock()
		case <-ctx.Done():
			return
		}
	}
}

// End stores the end of the log: what is buffered, then a line with the
// run's outcome, marked as the end. The end is stored once: a writer of
// an ended log does nothing.
//
// A chunk stored under it first — another capturer's, or this writer's
// own whose publish was cut short after it was sent (a cancel) — is a
// lost race: the writer takes the stored log's state and stores the end
// after it, once. An end that could not be stored is taken back out of
// the buffer, so no later flush stores its line without the end's mark,
// and End may be called again.
func (w *Writer) End(ctx context.Context, state, reason string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	err := w.end(ctx, state, reason)
	if errors.Is(err, ErrConflict) {
		w.conflict = false
		err = w.end(ctx, state, reason)
	}
	return err
}

func (w *Writer) end(ctx context.Context, state, reason string) error {
	if w.stored.ended {
		return nil
	}
	msg := "build " + state
	if reason != "" {
		msg += ": " + reason
	}
	// The end line is written past the cap: it is the log's last word.
	line := v1.AppendLogLine(nil, w.own(msg))
	if len(w.buf)+len(line) > w.opts.ChunkBytes {
		if err := w.flushLocked(ctx); err != nil {
			return err
		}
	}
	before, prev := len(w.buf), w.next
	w.buf = append(w.buf, line...)
	w.next.bytes += int64(len(line))
	w.next.lines++
	w.next.ended = true
	err := w.publish(ctx, func(h nats.Header) {
		h.Set(hdrEnd, state)
		if reason != "" {
			h.Set(hdrReason, reason)
		}
		if w.opts.Object != "" {
			h.Set(hdrObject, w.opts.Object)
		}
	})
	if err != nil && !errors.Is(err, ErrConflict) {
		// Not stored (a conflict has already taken the stored state).
		w.buf, w.next = w.buf[:before], prev
	}
	return err
}

// flushLocked stores the buffered lines as one chunk.
func (w *Writer) flushLocked(ctx context.Context) error {
	if len(w.buf) == 0 {
		return nil
	}
	return w.publish(ctx, nil)
}
