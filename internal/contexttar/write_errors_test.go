package contexttar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteMaxBytes(t *testing.T) {
	t.Parallel()
	files := tree{
		"a":             file(strings.Repeat("a", 100)),
		"b":             file(strings.Repeat("b", 200)),
		"big.iso":       file(strings.Repeat("x", 5000)),
		".dockerignore": file("*.iso\n"),
	}
	total := int64(100 + 200 + len("*.iso\n"))
	dir := newTree(t, files, buildOpts{})
	tests := []struct {
		name     string
		maxBytes int64
		wantErr  error // nil: success
	}{
		{"one byte under the total", total - 1, ErrTooLarge},
		{"far under the total", 1, ErrTooLarge},
		{"exactly the total (excluded files do not count)", total, nil},
		{"zero means the 1 GiB default", 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Write(context.Background(), dir, io.Discard, Options{MaxBytes: tt.maxBytes})
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Write(MaxBytes=%d) error = %v, want %v", tt.maxBytes, err, tt.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), fmt.Sprint(tt.maxBytes)) {
				t.Errorf("error %q does not name the limit %d", err, tt.maxBytes)
			}
		})
	}
	t.Run("negative is refused", func(t *testing.T) {
		t.Parallel()
		_, err := Write(context.Background(), dir, io.Discard, Options{MaxBytes: -1})
		if err == nil || errors.Is(err, ErrTooLarge) {
			t.Fatalf("Write(MaxBytes=-1) error = %v, want a non-ErrTooLarge error", err)
		}
	})
}

func TestWriteRefusesBadInput(t *testing.T) {
	t.Parallel()
	dir := newTree(t, tree{"Dockerfile": file("FROM scratch"), "f": file("x")}, buildOpts{})
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		dir     string
		opts    Options
		wantErr error // nil: any error
	}{
		{name: "Dockerfile outside the context", dir: dir, opts: Options{Dockerfile: "../Dockerfile"}},
		{name: "absolute Dockerfile path", dir: dir, opts: Options{Dockerfile: filepath.Join(dir, "Dockerfile")}},
		{name: "missing directory", dir: filepath.Join(dir, "nope")},
		{name: "regular file instead of a directory", dir: filepath.Join(dir, "f")},
		{name: "cancelled context", ctx: cancelled, dir: dir, wantErr: context.Canceled},
		{name: "invalid pattern in .dockerignore", dir: newTree(t, tree{".dockerignore": file("[\n")}, buildOpts{})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := tt.ctx
			if ctx == nil {
				ctx = context.Background()
			}
			_, err := Write(ctx, tt.dir, io.Discard, tt.opts)
			if err == nil || (tt.wantErr != nil && !errors.Is(err, tt.wantErr)) {
				t.Fatalf("Write error = %v, want %v", err, tt.wantErr)
			}
		})
	}
}

func TestWriteStopsWhenCancelledMidWalk(t *testing.T) {
	t.Parallel()
	dir := newTree(t, sample, buildOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	calls := 0
	_, err := Write(ctx, dir, io.Discard, Options{Progress: func(int64, int) {
		calls++
		cancel()
	}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Write error = %v, want context.Canceled", err)
	}
	if calls != 1 {
		t.Errorf("%d entries written after cancellation, want it to stop after the first", calls-1)
	}
}

// failingWriter fails every write, like an upload whose connection died.
type failingWriter struct{}

var errUpload = errors.New("upload failed")

func (failingWriter) Write([]byte) (int, error) { return 0, errUpload }

func TestWriteReturnsWriterErrors(t *testing.T) {
	t.Parallel()
	_, err := Write(context.Background(), newTree(t, sample, buildOpts{}), failingWriter{}, Options{})
	if !errors.Is(err, errUpload) {
		t.Fatalf("Write error = %v, want the writer's error", err)
	}
}

func TestZeroLimitMeansTheDefault(t *testing.T) {
	t.Parallel()
	if got, err := limit(0); err != nil || got != DefaultMaxBytes {
		t.Fatalf("limit(0) = %d, %v; want %d", got, err, DefaultMaxBytes)
	}
	if got, err := limit(42); err != nil || got != 42 {
		t.Fatalf("limit(42) = %d, %v", got, err)
	}
	if _, err := limit(-1); err == nil {
		t.Fatal("a negative limit was accepted")
	}
}
