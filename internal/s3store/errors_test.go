package s3store

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/buildq/buildq/internal/contexttar"
)

func TestErrors(t *testing.T) {
	t.Parallel()

	t.Run("wrong access key is a permanent error and writes nothing", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		f.store(t, f.config(), tuning{}) // the bucket exists
		cfg := f.config()
		cfg.AccessKey = "intruder"
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))

		_, err = s.UploadContext(context.Background(), dir, contexttar.Options{}, nil)
		if err == nil || IsTransient(err) {
			t.Errorf("UploadContext = %v; want a non-transient error", err)
		}
		if n := countWrites(f.rec.take()); n != 0 {
			t.Errorf("made %d PUT/POST requests with rejected credentials", n)
		}
		// A GET carries the server's error document.
		_, err = s.Open(context.Background(), testBucket, "any")
		if code := errCode(err); code != "InvalidAccessKeyId" || IsTransient(err) || errors.Is(err, ErrNotFound) {
			t.Errorf("Open = %v (code %q, transient %v); want permanent InvalidAccessKeyId", err, code, IsTransient(err))
		}
		if err := s.EnsureBucket(context.Background()); err == nil || IsTransient(err) {
			t.Errorf("EnsureBucket = %v; want a non-transient error", err)
		}
	})

	t.Run("refused connection is transient", func(t *testing.T) {
		t.Parallel()
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close() // nothing listens there now
		// One attempt: minio-go would otherwise retry with backoff for
		// seconds before giving up.
		s, err := newStore(Config{Endpoint: "http://" + addr, AccessKey: "a", SecretKey: "b"}, tuning{maxRetries: 1})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if _, err := s.Exists(ctx, "bucket", "key"); !IsTransient(err) {
			t.Errorf("Exists = %v; want a transient error", err)
		}
		if _, err := s.Open(ctx, "bucket", "key"); !IsTransient(err) || errors.Is(err, ErrNotFound) {
			t.Errorf("Open = %v; want a transient error", err)
		}
		dir := t.TempDir()
		writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))
		if _, err := s.UploadContext(ctx, dir, contexttar.Options{}, nil); !IsTransient(err) {
			t.Errorf("UploadContext = %v; want a transient error", err)
		}
	})

	t.Run("upload to a missing bucket is a permanent error", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		cfg := f.config()
		cfg.Bucket = "never-created"
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))
		_, err = s.UploadContext(context.Background(), dir, contexttar.Options{}, nil)
		if code := errCode(err); code != minio.NoSuchBucket || IsTransient(err) {
			t.Errorf("UploadContext = %v (code %q); want permanent NoSuchBucket", err, code)
		}
	})

	t.Run("packing errors are returned as is", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		s := f.store(t, f.config(), tuning{})
		dir := t.TempDir()
		writeTree(t, dir, map[string]string{"big": strings.Repeat("x", 100)}, time.Unix(1e9, 0))
		_, err := s.UploadContext(context.Background(), dir, contexttar.Options{MaxBytes: 10}, nil)
		if !errors.Is(err, contexttar.ErrTooLarge) || IsTransient(err) {
			t.Errorf("UploadContext = %v; want permanent contexttar.ErrTooLarge", err)
		}
		if reqs := f.rec.take(); len(reqs) != 0 {
			t.Errorf("requests = %v; want none for a context that cannot be packed", reqs)
		}
	})
}

// TestIsTransient checks the classification of errors gofakes3 cannot
// produce (it checks no signatures and never throttles), on the values
// minio-go builds from S3 responses.
func TestIsTransient(t *testing.T) {
	t.Parallel()
	s3err := func(status int, code string) error {
		return minio.ErrorResponse{StatusCode: status, Code: code, Message: code}
	}
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"NoSuchKey", s3err(404, "NoSuchKey"), false},
		{"AccessDenied", s3err(403, "AccessDenied"), false},
		{"InvalidAccessKeyId", s3err(403, "InvalidAccessKeyId"), false},
		{"SignatureDoesNotMatch", s3err(403, "SignatureDoesNotMatch"), false},
		{"ExpiredToken", s3err(400, "ExpiredToken"), false},
		{"NoSuchBucket", s3err(404, "NoSuchBucket"), false},
		{"503 SlowDown", s3err(503, "SlowDown"), true},
		{"500 InternalError", s3err(500, "InternalError"), true},
		{"502 without code", s3err(502, "502 Bad Gateway"), true},
		{"429", s3err(429, "TooManyRequests"), true},
		{"SlowDown without status", s3err(0, "SlowDown"), true},
		{"wrapped 503", errors.Join(errors.New("context"), s3err(503, "ServiceUnavailable")), true},
		{"wrapped AccessDenied", errors.Join(errors.New("context"), s3err(403, "AccessDenied")), false},
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, true},
		{"reset mid-response", io.ErrUnexpectedEOF, true},
		{"deadline", context.DeadlineExceeded, true},
		{"cancelled", context.Canceled, false},
		{"changed context", ErrContextChanged, false},
		{"not found", ErrNotFound, false},
		{"plain error", errors.New("boom"), false},
	}
	for _, tt := range tests {
		if got := IsTransient(tt.err); got != tt.want {
			t.Errorf("%s: IsTransient(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// errCode returns the S3 error code in err's chain, or "".
func errCode(err error) string {
	er, _ := asErrorResponse(err)
	return er.Code
}
