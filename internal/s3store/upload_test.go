package s3store

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/buildq/buildq/internal/contexttar"
)

// sampleFiles is a small context: a Dockerfile, nested files and an empty
// directory.
var sampleFiles = map[string]string{
	"Dockerfile":   "FROM scratch\nCOPY . /\n",
	"src/main.go":  "package main\n\nfunc main() {}\n",
	"src/data.txt": strings.Repeat("some data\n", 1000),
	"empty/":       "",
}

// sampleEntries is what the archive of sampleFiles holds.
var sampleEntries = map[string]string{
	"Dockerfile":   sampleFiles["Dockerfile"],
	"src/":         "",
	"src/main.go":  sampleFiles["src/main.go"],
	"src/data.txt": sampleFiles["src/data.txt"],
	"empty/":       "",
}

func TestUploadContext(t *testing.T) {
	t.Parallel()

	t.Run("first upload stores the archive under its digest", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		s := f.store(t, f.config(), tuning{})
		dir := t.TempDir()
		writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))

		res, err := s.UploadContext(context.Background(), dir, contexttar.Options{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		want := digestOf(t, dir)
		if res.Digest != want || res.Key != ContextKey(want) || res.Bucket != testBucket || res.Skipped {
			t.Errorf("result = %+v, want digest %s at %s/%s, not skipped", res, want, testBucket, ContextKey(want))
		}
		if res.Files != len(sampleEntries) || res.Size <= 0 {
			t.Errorf("result files, size = %d, %d; want %d files and a size", res.Files, res.Size, len(sampleEntries))
		}
		reqs := f.rec.take()
		if len(reqs) == 0 || reqs[0].Method != http.MethodHead || reqs[0].Path != "/"+testBucket+"/"+res.Key {
			t.Errorf("requests = %v; want a HEAD of the key first", reqs)
		}
		if got := readArchive(t, s, res.Key); !maps.Equal(got, sampleEntries) {
			t.Errorf("archive holds %v, want %v", keysOf(got), keysOf(sampleEntries))
		}
		info, err := s.client.StatObject(context.Background(), testBucket, res.Key, minio.StatObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got := info.Metadata.Get("X-Amz-Meta-Buildq-Digest"); got != want {
			t.Errorf("x-amz-meta-buildq-digest = %q, want %q", got, want)
		}
		if info.ContentType != "application/gzip" {
			t.Errorf("Content-Type = %q, want application/gzip", info.ContentType)
		}
		if got := objects(t, s); !slices.Equal(got, []string{res.Key}) {
			t.Errorf("bucket holds %v, want only %s", got, res.Key)
		}
	})

	t.Run("same content again is skipped with only a HEAD", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		s := f.store(t, f.config(), tuning{})
		dir := t.TempDir()
		writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))
		first, err := s.UploadContext(context.Background(), dir, contexttar.Options{}, nil)
		if err != nil {
			t.Fatal(err)
		}

		// A copy with other mtimes has the same digest, hence the same key.
		copyDir := t.TempDir()
		writeTree(t, copyDir, sampleFiles, time.Unix(2e9, 0))
		for _, d := range []string{dir, copyDir} {
			f.rec.take()
			var phases []string
			res, err := s.UploadContext(context.Background(), d, contexttar.Options{}, func(phase string, _, _ int64) {
				phases = append(phases, phase)
			})
			if err != nil {
				t.Fatal(err)
			}
			if !res.Skipped || res.Digest != first.Digest || res.Key != first.Key || res.Size != first.Size || res.Files != first.Files {
				t.Errorf("%s: result = %+v, want %+v skipped", d, res, first)
			}
			want := []request{{Method: http.MethodHead, Path: "/" + testBucket + "/" + first.Key}}
			if got := f.rec.take(); !slices.Equal(got, want) {
				t.Errorf("%s: requests = %v, want only %v", d, got, want)
			}
			if slices.Contains(phases, PhaseUploading) {
				t.Errorf("%s: skipped upload reported phases %v", d, slices.Compact(phases))
			}
		}
	})

	t.Run("large context goes up in several parts and reads back intact", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		cfg := f.config()
		cfg.PartSize = smallPart
		s := f.store(t, cfg, tuning{minPartSize: smallPart})
		files := map[string]string{
			"Dockerfile": "FROM scratch\n",
			"blob.bin":   randomText(1, 5*smallPart+123),
		}
		dir := t.TempDir()
		writeTree(t, dir, files, time.Unix(1e9, 0))

		res, err := s.UploadContext(context.Background(), dir, contexttar.Options{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		parts := 0
		for _, r := range f.rec.take() {
			if r.Method == http.MethodPut && strings.Contains(r.Query, "partNumber=") {
				parts++
			}
		}
		if parts < 5 {
			t.Errorf("uploaded %d parts, want at least 5 parts of %d bytes", parts, smallPart)
		}
		if got := readArchive(t, s, res.Key); !maps.Equal(got, files) {
			t.Errorf("archive holds %v, want %v with their content", keysOf(got), keysOf(files))
		}
		if res.Digest != digestOf(t, dir) {
			t.Errorf("digest %s differs from contexttar's", res.Digest)
		}
	})

	t.Run("files changed between passes abort the upload", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		cfg := f.config()
		cfg.PartSize = smallPart
		s := f.store(t, cfg, tuning{minPartSize: smallPart})
		dir := t.TempDir()
		writeTree(t, dir, map[string]string{
			"a.bin": randomText(2, 4*smallPart),
			"z.txt": "last in the archive\n",
		}, time.Unix(1e9, 0))
		hashed := digestOf(t, dir)

		// Once hashed, change the last file: the second pass streams
		// several parts before its digest, known only at the end, differs.
		changed := false
		res, err := s.UploadContext(context.Background(), dir, contexttar.Options{}, func(phase string, done, total int64) {
			if phase == PhaseHashing && done == total && !changed {
				changed = true
				if err := os.WriteFile(filepath.Join(dir, "z.txt"), []byte("edited meanwhile\n"), 0o644); err != nil {
					t.Error(err)
				}
			}
		})
		if !errors.Is(err, ErrContextChanged) {
			t.Fatalf("UploadContext = %+v, %v; want ErrContextChanged", res, err)
		}
		if IsTransient(err) {
			t.Errorf("IsTransient(%v) = true", err)
		}
		reqs := f.rec.take()
		parts, aborted := 0, false
		for _, r := range reqs {
			parts += btoi(r.Method == http.MethodPut && strings.Contains(r.Query, "partNumber="))
			aborted = aborted || (r.Method == http.MethodDelete && strings.Contains(r.Query, "uploadId="))
		}
		if parts < 2 || !aborted {
			t.Errorf("requests = %v; want parts uploaded, then the multipart upload aborted", reqs)
		}
		if got := objects(t, s); len(got) != 0 {
			t.Errorf("bucket holds %v after an aborted upload, want nothing", got)
		}
		if got := incompleteUploads(t, s); len(got) != 0 {
			t.Errorf("incomplete uploads left: %v", got)
		}

		// Once stable, the new content goes up under its own key.
		res, err = s.UploadContext(context.Background(), dir, contexttar.Options{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if res.Skipped || res.Digest == hashed || res.Digest != digestOf(t, dir) {
			t.Errorf("retry = %+v; want a fresh upload of the new digest", res)
		}
	})

	t.Run("cancelled context aborts the upload", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		cfg := f.config()
		cfg.PartSize = smallPart
		s := f.store(t, cfg, tuning{minPartSize: smallPart})
		dir := t.TempDir()
		writeTree(t, dir, map[string]string{
			"a.bin": randomText(3, 4*smallPart),
			"b.txt": "b", "c.txt": "c", "d/e.txt": "e",
		}, time.Unix(1e9, 0))

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		// Cancel once a.bin has gone through the pipe: by then the
		// multipart upload exists and parts are on the server.
		_, err := s.UploadContext(ctx, dir, contexttar.Options{}, func(phase string, done, _ int64) {
			if phase == PhaseUploading && done > 3*smallPart {
				cancel()
			}
		})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("UploadContext = %v, want context.Canceled", err)
		}
		if IsTransient(err) {
			t.Errorf("IsTransient(%v) = true", err)
		}
		if got := objects(t, s); len(got) != 0 {
			t.Errorf("bucket holds %v after a cancelled upload, want nothing", got)
		}
		if got := incompleteUploads(t, s); len(got) != 0 {
			t.Errorf("incomplete uploads left: %v", got)
		}
	})

	t.Run("progress reports hashing then uploading up to the total", func(t *testing.T) {
		t.Parallel()
		f := newFakeS3(t)
		s := f.store(t, f.config(), tuning{})
		dir := t.TempDir()
		writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))

		type call struct {
			phase       string
			done, total int64
		}
		var (
			mu    sync.Mutex // calls come from two goroutines, one at a time
			calls []call
		)
		callerCalls := 0
		opts := contexttar.Options{Progress: func(int64, int) { callerCalls++ }}
		res, err := s.UploadContext(context.Background(), dir, opts, func(phase string, done, total int64) {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, call{phase, done, total})
		})
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()

		split := slices.IndexFunc(calls, func(c call) bool { return c.phase == PhaseUploading })
		if split <= 0 {
			t.Fatalf("calls = %v; want hashing calls, then uploading calls", calls)
		}
		hashing, uploading := calls[:split], calls[split:]
		for i, c := range hashing {
			last := i == len(hashing)-1
			switch {
			case c.phase != PhaseHashing:
				t.Errorf("call %v interleaved with uploading calls", c)
			case !last && c.total != -1:
				t.Errorf("hashing call %v: total should be -1 until the end", c)
			case i > 0 && c.done < hashing[i-1].done:
				t.Errorf("hashing call %v went backwards from %v", c, hashing[i-1])
			case last && (c.done != res.Size || c.total != res.Size):
				t.Errorf("last hashing call %v, want done = total = %d", c, res.Size)
			}
		}
		for i, c := range uploading {
			switch {
			case c.phase != PhaseUploading:
				t.Errorf("call %v after uploading began", c)
			case c.total != res.Size:
				t.Errorf("uploading call %v, want total %d", c, res.Size)
			case i > 0 && c.done < uploading[i-1].done:
				t.Errorf("uploading call %v went backwards from %v", c, uploading[i-1])
			}
		}
		if last := uploading[len(uploading)-1]; last.done != res.Size {
			t.Errorf("last uploading call %v, want done = %d", last, res.Size)
		}
		if callerCalls != 2*res.Files {
			t.Errorf("opts.Progress called %d times, want once per entry in each pass (%d)", callerCalls, 2*res.Files)
		}
	})
}

func keysOf(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// A tenant's uploads live under its own prefix: an object planted under
// the shared key, or under another tenant's, never makes the upload skip.
func TestTenantUploadIgnoresOthersObjects(t *testing.T) {
	t.Parallel()
	f := newFakeS3(t)
	s := f.store(t, f.config(), tuning{})
	dir := t.TempDir()
	writeTree(t, dir, sampleFiles, time.Unix(1e9, 0))
	want := digestOf(t, dir)
	// Mallory plants bytes under the shared key and under her own prefix.
	other := t.TempDir()
	writeTree(t, other, map[string]string{"evil": "planted"}, time.Unix(1e9, 0))
	if _, err := s.UploadContext(context.Background(), other, contexttar.Options{}, nil); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, k := range []string{ContextKey(want), TenantContextKey("mallory", want)} {
		if _, err := s.client.PutObject(ctx, testBucket, k, strings.NewReader("planted"), 7, minio.PutObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	res, err := s.ForTenant("acme").UploadContext(ctx, dir, contexttar.Options{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Skipped || res.Key != "contexts/acme/sha256/"+strings.TrimPrefix(want, "sha256:")+".tar.gz" {
		t.Fatalf("result %+v", res)
	}
	again, err := s.ForTenant("acme").UploadContext(ctx, dir, contexttar.Options{}, nil)
	if err != nil || !again.Skipped {
		t.Fatalf("the tenant's own object does not make the second upload skip: %+v %v", again, err)
	}
	for _, bad := range []string{"", "UPPER", "a/b", "-x"} {
		if TenantContextKey(bad, want) != "" {
			t.Errorf("tenant %q gave a key", bad)
		}
	}
}
