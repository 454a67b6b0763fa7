package buildlog

// Storing a chunk (writer.go buffers the lines): one message per chunk,
// published with the subject's last sequence as its precondition and the
// capture's state in its headers; a publish whose outcome was lost is found
// again by those headers, and a writer that lost the race resyncs from the
// stored log's last chunk.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// publishAttempts bounds the retries of a chunk whose publish failed and
// did not land.
const publishAttempts = 5

// publish stores the buffer as one chunk with w.next's state, expecting
// the subject's last sequence to be w.last; w.mu is held.
func (w *Writer) publish(ctx context.Context, extra func(nats.Header)) error {
	m := nats.NewMsg(w.subject)
	m.Data = w.buf
	putState(m.Header, w.next)
	if extra != nil {
		extra(m.Header)
	}
	// Unique per chunk of this writer: its retry of a publish that landed
	// is dropped by the stream's duplicate window; another writer's chunk
	// with the same totals is not.
	m.Header.Set(nats.MsgIdHdr, w.run+"/"+w.id+"/"+strconv.FormatInt(w.next.bytes, 10)+"/"+strconv.FormatInt(w.next.lines, 10))
	backoff := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		opts := []jetstream.PublishOpt{jetstream.WithExpectLastSequencePerSubject(w.last)}
		if mutant.On("log-append-blind") {
			opts = nil
		}
		ack, err := w.js.PublishMsg(ctx, m, opts...)
		if err == nil {
			w.last = ack.Sequence
			w.stored = w.next
			w.flushed = w.opts.Now()
			if w.opts.Stored != nil {
				w.opts.Stored(len(w.buf))
			}
			w.buf = w.buf[:0]
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// Did it land (a lost PubAck), or did another writer append?
		st, seq, rerr := w.readLast(ctx)
		switch {
		case rerr != nil:
			// Unknown: try again with the same precondition.
		case seq == w.last:
			// Nothing was stored: try again.
		case st.bytes == w.next.bytes && st.lines == w.next.lines && st.pos == w.next.pos && st.part == w.next.part && st.ended == w.next.ended:
			w.last, w.stored = seq, w.next
			w.buf = w.buf[:0]
			return nil
		default:
			w.take(st, seq)
			w.conflict = true
			return ErrConflict
		}
		if attempt >= publishAttempts {
			return fmt.Errorf("buildlog: store a chunk of %s: %w", w.subject, err)
		}
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return ctx.Err()
		}
		backoff *= 2
	}
}

// take makes st, stored at seq, the writer's state, dropping the buffer.
func (w *Writer) take(st state, seq uint64) {
	w.stored, w.next, w.last = st, st, seq
	w.buf = w.buf[:0]
	w.conflict = false
}

// resync takes the stored log's state.
func (w *Writer) resync(ctx context.Context) error {
	st, seq, err := w.readLast(ctx)
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.take(st, seq)
	w.mu.Unlock()
	return nil
}

// Resync drops what is buffered and takes the stored log's state.
func (w *Writer) Resync(ctx context.Context) error { return w.resync(ctx) }

// readLast reads the state of the subject's last chunk (zero and 0 when
// there is none).
func (w *Writer) readLast(ctx context.Context) (state, uint64, error) {
	s, err := w.js.Stream(ctx, v1.LogsStream)
	if err != nil {
		return state{}, 0, fmt.Errorf("buildlog: %w", err)
	}
	m, err := s.GetLastMsgForSubject(ctx, w.subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return state{}, 0, nil
	}
	if err != nil {
		return state{}, 0, fmt.Errorf("buildlog: read the last chunk of %s: %w", w.subject, err)
	}
	st, err := getState(m.Header)
	if err != nil {
		return state{}, 0, fmt.Errorf("buildlog: chunk %d of %s: %w", m.Sequence, w.subject, err)
	}
	return st, m.Sequence, nil
}

func putState(h nats.Header, st state) {
	if st.pos.Pod != "" {
		h.Set(hdrPod, st.pos.Pod)
	}
	if st.pos.Container != "" {
		h.Set(hdrContainer, st.pos.Container)
	}
	if !st.pos.Time.IsZero() {
		h.Set(hdrTime, st.pos.Time.UTC().Format(time.RFC3339Nano))
		h.Set(hdrCount, strconv.Itoa(st.pos.Count))
	}
	h.Set(hdrAttempt, strconv.Itoa(st.pos.Attempt))
	if st.part > 0 {
		h.Set(hdrPart, strconv.Itoa(st.part))
	}
	h.Set(hdrBytes, strconv.FormatInt(st.bytes, 10))
	h.Set(hdrLines, strconv.FormatInt(st.lines, 10))
	if st.truncated {
		h.Set(hdrTruncated, "true")
	}
}

func getState(h nats.Header) (state, error) {
	var (
		st  state
		err error
	)
	st.pos.Pod, st.pos.Container = h.Get(hdrPod), h.Get(hdrContainer)
	num := func(name string) int64 {
		v := h.Get(name)
		if v == "" || err != nil {
			return 0
		}
		n, perr := strconv.ParseInt(v, 10, 64)
		if perr != nil {
			err = fmt.Errorf("header %s: %w", name, perr)
		}
		return n
	}
	if v := h.Get(hdrTime); v != "" {
		if st.pos.Time, err = time.Parse(time.RFC3339Nano, v); err != nil {
			return state{}, fmt.Errorf("header %s: %w", hdrTime, err)
		}
	}
	st.pos.Count = int(num(hdrCount))
	st.pos.Attempt = int(num(hdrAttempt))
	st.part = int(num(hdrPart))
	st.bytes, st.lines = num(hdrBytes), num(hdrLines)
	st.truncated = h.Get(hdrTruncated) == "true"
	st.ended = h.Get(hdrEnd) != ""
	return st, err
}
