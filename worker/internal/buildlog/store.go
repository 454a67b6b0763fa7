package buildlog

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// StreamConfig sizes BUILDQ_LOGS.
type StreamConfig struct {
	// MaxAge: a chunk older than this is dropped (the archive stays).
	MaxAge time.Duration
	// MaxBytes bounds the stream; the oldest chunks go first.
	MaxBytes int64
	Storage  jetstream.StorageType
	Replicas int
	// Duplicates is the duplicate window (a publish retried after a
	// lost PubAck).
	Duplicates time.Duration
}

// Defaults of the stream.
const (
	DefaultMaxAge   = 24 * time.Hour
	DefaultMaxBytes = 256 << 20
)

// EnsureStream creates or updates BUILDQ_LOGS.
func EnsureStream(ctx context.Context, js jetstream.JetStream, c StreamConfig) (jetstream.Stream, error) {
	if c.MaxAge <= 0 {
		c.MaxAge = DefaultMaxAge
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = DefaultMaxBytes
	}
	if c.Duplicates <= 0 || c.Duplicates > c.MaxAge {
		c.Duplicates = min(2*time.Minute, c.MaxAge)
	}
	s, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        v1.LogsStream,
		Description: "buildq build logs, one subject per build run (read through the tenant API)",
		Subjects:    []string{v1.LogsPrefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		MaxAge:      c.MaxAge,
		MaxBytes:    c.MaxBytes,
		// A chunk is at most DefaultChunkBytes of lines and its headers.
		MaxMsgSize:  DefaultChunkBytes + 4<<10,
		Storage:     c.Storage,
		Replicas:    c.Replicas,
		Duplicates:  c.Duplicates,
		AllowDirect: true,
	})
	if err != nil {
		return nil, fmt.Errorf("create stream %s: %w", v1.LogsStream, err)
	}
	return s, nil
}

// Chunk is one stored chunk of a run's log.
type Chunk struct {
	Seq  uint64
	Data []byte
	// Bytes is the log's length after this chunk; Ended marks the last.
	Bytes     int64
	Lines     int64
	Truncated bool
	Ended     bool
	State     string
	Reason    string
	Object    string
	Time      time.Time
}

// Reader reads runs' logs from the stream.
type Reader struct {
	js jetstream.JetStream
}

// NewReader returns a reader of BUILDQ_LOGS.
func NewReader(js jetstream.JetStream) *Reader { return &Reader{js: js} }

// Next returns the first chunk of run of key stored after sequence after
// (nil when there is none yet).
func (r *Reader) Next(ctx context.Context, key, run string, after uint64) (*Chunk, error) {
	s, err := r.js.Stream(ctx, v1.LogsStream)
	if err != nil {
		return nil, fmt.Errorf("buildlog: %w", err)
	}
	m, err := s.GetMsg(ctx, after+1, jetstream.WithGetMsgSubject(v1.LogsSubject(key, run)))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("buildlog: read %s after %d: %w", v1.LogsSubject(key, run), after, err)
	}
	st, err := getState(m.Header)
	if err != nil {
		return nil, fmt.Errorf("buildlog: chunk %d of %s: %w", m.Sequence, m.Subject, err)
	}
	return &Chunk{Seq: m.Sequence, Data: m.Data, Bytes: st.bytes, Lines: st.lines, Truncated: st.truncated, Ended: st.ended,
		State: m.Header.Get(hdrEnd), Reason: m.Header.Get(hdrReason), Object: m.Header.Get(hdrObject), Time: m.Time}, nil
}

// First reports whether the stream still holds the start of the run's
// log, and the sequence before it (a chunk aged out makes it false).
func (r *Reader) First(ctx context.Context, key, run string) (*Chunk, error) {
	return r.Next(ctx, key, run, 0)
}

// ErrIncomplete means the stream no longer holds the whole log (it aged out or
// the stream's limits dropped some of it).
var ErrIncomplete = errors.New("buildlog: the stream no longer holds the whole log")

// ErrNotEnded means the log has no end yet.
var ErrNotEnded = errors.New("buildlog: the log has not ended")

// ReadAll returns the whole stored log of run of key and its last chunk;
// ErrNotEnded unless the log has ended, ErrIncomplete when its start is
// gone.
func (r *Reader) ReadAll(ctx context.Context, key, run string) ([]byte, *Chunk, error) {
	var (
		buf  bytes.Buffer
		last *Chunk
		seq  uint64
	)
	for {
		c, err := r.Next(ctx, key, run, seq)
		if err != nil {
			return nil, nil, err
		}
		if c == nil {
			if last == nil || !last.Ended {
				return nil, last, ErrNotEnded
			}
			return buf.Bytes(), last, nil
		}
		if int64(buf.Len())+int64(len(c.Data)) != c.Bytes {
			return nil, nil, ErrIncomplete
		}
		buf.Write(c.Data)
		last, seq = c, c.Seq
		if c.Ended {
			return buf.Bytes(), last, nil
		}
	}
}

// Archive is where finished logs are kept.
type Archive interface {
	// PutLog stores data (a gzip stream) as object, once, and returns
	// the bucket it is in.
	PutLog(ctx context.Context, object string, data []byte) (bucket string, err error)
	// Open reads an object.
	Open(ctx context.Context, bucket, key string) (io.ReadCloser, error)
}

// Compress gzips a log; the same log gives the same bytes (no name, no
// time in the header), so an archive written again is the same object.
func Compress(log []byte) []byte {
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	_, _ = zw.Write(log)
	_ = zw.Close()
	return buf.Bytes()
}

// Store archives the ended log of run of key to object and returns its
// reference; the log's totals come from its chunks.
func Store(ctx context.Context, r *Reader, a Archive, key, run, object string) (*v1.LogRef, error) {
	data, last, err := r.ReadAll(ctx, key, run)
	if err != nil {
		return nil, err
	}
	z := Compress(data)
	bucket, err := a.PutLog(ctx, object, z)
	if err != nil {
		return nil, fmt.Errorf("archive the log of run %s to %s: %w", run, object, err)
	}
	sum := sha256.Sum256(z)
	return &v1.LogRef{Key: key, Run: run, Bucket: bucket, Object: object, Digest: "sha256:" + hex.EncodeToString(sum[:]),
		Bytes: last.Bytes, Lines: last.Lines, Truncated: last.Truncated}, nil
}

// ReadArchive returns the log an archive holds, checking its digest.
func ReadArchive(ctx context.Context, a Archive, ref *v1.LogRef) ([]byte, error) {
	return readArchive(ctx, a, ref, maxArchiveBytes)
}

// readArchive is ReadArchive reading at most limit bytes (compressed, and
// again uncompressed): an archive past it is an error, never a log cut
// short without a word.
func readArchive(ctx context.Context, a Archive, ref *v1.LogRef, limit int64) ([]byte, error) {
	rc, err := a.Open(ctx, ref.Bucket, ref.Object)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	tooLarge := func() error {
		return fmt.Errorf("the log archive %s is larger than the %d MiB a worker reads of one", ref.Object, limit>>20)
	}
	z, err := io.ReadAll(io.LimitReader(rc, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read the log archive %s: %w", ref.Object, err)
	}
	if int64(len(z)) > limit {
		return nil, tooLarge()
	}
	if ref.Digest != "" {
		sum := sha256.Sum256(z)
		if d := "sha256:" + hex.EncodeToString(sum[:]); d != ref.Digest {
			return nil, fmt.Errorf("the log archive %s is %s, not %s as recorded", ref.Object, d, ref.Digest)
		}
	}
	zr, err := gzip.NewReader(bytes.NewReader(z))
	if err != nil {
		return nil, fmt.Errorf("the log archive %s: %w", ref.Object, err)
	}
	data, err := io.ReadAll(io.LimitReader(zr, limit+1))
	if err != nil {
		return nil, fmt.Errorf("the log archive %s: %w", ref.Object, err)
	}
	if int64(len(data)) > limit {
		return nil, tooLarge()
	}
	return data, nil
}

// maxArchiveBytes bounds what is read of an archive (compressed, and
// again uncompressed).
const maxArchiveBytes = 256 << 20
