package kube

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"time"
)

// splitLines reads kubelet log lines ("<RFC3339Nano> <text>\n") from rd and
// hands handle each line's timestamp and text, a text longer than
// maxLogPiece as several pieces of at most maxLogPiece bytes. A last line
// without '\n' is handed over only at io.EOF of a final stream (anywhere
// else it may be cut short: the stream is reopened before it). A line
// without a readable timestamp gets the previous line's (last at first).
// It returns the error that ended the reading (io.EOF at the end), or the
// first error of handle.
func splitLines(rd io.Reader, final bool, last time.Time, handle func(ts time.Time, text []byte) error) (readErr, handleErr error) {
	br := bufio.NewReaderSize(rd, logReadBuffer)
	var (
		inLine bool
		ts     time.Time
		buf    []byte
		pieces int // of the current line, handed over
	)
	// flush hands over the pieces of buf that are complete: all of it at
	// the end of a line (an empty line is one empty piece).
	flush := func(end bool) error {
		for len(buf) > maxLogPiece || (end && (len(buf) > 0 || pieces == 0)) {
			n := min(len(buf), maxLogPiece)
			piece := make([]byte, n)
			copy(piece, buf)
			buf = buf[:copy(buf, buf[n:])]
			pieces++
			if err := handle(ts, piece); err != nil {
				return err
			}
		}
		return nil
	}
	for {
		chunk, err := br.ReadSlice('\n')
		if len(chunk) > 0 {
			end := err == nil // ReadSlice ends with the delimiter iff err is nil
			if end {
				chunk = chunk[:len(chunk)-1]
			}
			if !inLine {
				inLine, pieces, buf = true, 0, buf[:0]
				var ok bool
				if ts, chunk, ok = cutTimestamp(chunk); ok {
					last = ts
				} else {
					ts = last
				}
			}
			buf = append(buf, chunk...)
			if herr := flush(end); herr != nil {
				return nil, herr
			}
			if end {
				inLine = false
			}
		}
		if err == nil || errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if inLine && final && err == io.EOF {
			if herr := flush(true); herr != nil {
				return nil, herr
			}
		}
		return err, nil
	}
}

// cutTimestamp splits the kubelet's timestamp off the start of a line.
func cutTimestamp(line []byte) (time.Time, []byte, bool) {
	stamp, rest, _ := bytes.Cut(line, []byte{' '})
	t, err := time.Parse(time.RFC3339Nano, string(stamp))
	if err != nil {
		return time.Time{}, line, false
	}
	return t, rest, true
}
