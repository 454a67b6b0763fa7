package s3store

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/minio/minio-go/v7"

	"github.com/buildq/buildq/internal/contexttar"
)

const (
	testAccessKey = "buildq-test"
	testSecretKey = "buildq-test-secret"
	testBucket    = "contexts"
	// smallPart is the part size of tests that want several parts from a
	// context of a few hundred KiB (tuning lowers minio-go's 5 MiB floor;
	// gofakes3 does not enforce S3's).
	smallPart = 64 << 10
)

// request is one HTTP request seen by a recorder.
type request struct {
	Method string
	Path   string // URL path: /bucket/key
	Query  string // raw query: uploads, partNumber=1&uploadId=..., ...
}

func (r request) String() string { return r.Method + " " + r.Path + "?" + r.Query }

// recorder is an http.RoundTripper that records every request before
// passing it on, so tests can assert on what went over the wire.
type recorder struct {
	next http.RoundTripper
	mu   sync.Mutex
	reqs []request
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	r.mu.Lock()
	r.reqs = append(r.reqs, request{req.Method, req.URL.Path, req.URL.RawQuery})
	r.mu.Unlock()
	return r.next.RoundTrip(req)
}

// take returns the requests recorded since the last take and forgets them.
func (r *recorder) take() []request {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.reqs
	r.reqs = nil
	return out
}

// fakeS3 is an in-process S3 server (gofakes3 with the s3mem backend) and
// a recorder in front of it.
type fakeS3 struct {
	srv *httptest.Server
	rec *recorder
}

// newFakeS3 starts a fake S3 server for one test.
//
// It serves plain HTTP, as `buildq dev` does: gofakes3 v1.2.0 does not
// decode the aws-chunked bodies that minio-go sends for signed part uploads
// over plain HTTP (STREAMING-AWS4-HMAC-SHA256-PAYLOAD), so these tests also
// prove that the Store sends unsigned payloads there (a content mismatch
// would fail the round-trip tests).
//
// gofakes3 does not check credentials; the server here checks the access
// key named in the Authorization header (not the signature) and answers
// 403 InvalidAccessKeyId like S3, so that wrong credentials can be tested
// end to end.
func newFakeS3(t testing.TB) *fakeS3 {
	t.Helper()
	fake := gofakes3.New(s3mem.New(), gofakes3.WithoutVersioning()).Server()
	srv := httptest.NewServer(checkAccessKey(fake))
	t.Cleanup(srv.Close)
	return &fakeS3{srv: srv, rec: &recorder{next: srv.Client().Transport}}
}

// checkAccessKey rejects requests not signed with testAccessKey.
func checkAccessKey(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.Contains(r.Header.Get("Authorization"), "Credential="+testAccessKey+"/") {
			w.Header().Set("Content-Type", "application/xml")
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist in our records.</Message><Resource>%s</Resource><RequestId>0</RequestId></Error>`, r.URL.Path)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// config returns a Config for the server, with the test credentials.
func (f *fakeS3) config() Config {
	return Config{
		Endpoint:  f.srv.URL,
		AccessKey: testAccessKey,
		SecretKey: testSecretKey,
		Bucket:    testBucket,
		Transport: f.rec,
	}
}

// store returns a Store on the server with its bucket created, and forgets
// the requests made so far.
func (f *fakeS3) store(t testing.TB, cfg Config, tn tuning) *Store {
	t.Helper()
	s, err := newStore(cfg, tn)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.EnsureBucket(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.rec.take()
	return s
}

// writeTree creates files (slash path -> content) under dir; a path ending
// in "/" is an empty directory. Every path gets mtime.
func writeTree(t testing.TB, dir string, files map[string]string, mtime time.Time) {
	t.Helper()
	for name, content := range files {
		p := filepath.Join(dir, filepath.FromSlash(strings.TrimSuffix(name, "/")))
		if strings.HasSuffix(name, "/") {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	err := filepath.WalkDir(dir, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Chtimes(p, mtime, mtime)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// randomText returns n bytes that gzip cannot shrink, seeded for
// reproducibility.
func randomText(seed uint64, n int) string {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return string(b)
}

// digestOf returns contexttar's digest of dir.
func digestOf(t testing.TB, dir string) string {
	t.Helper()
	res, err := contexttar.Write(context.Background(), dir, io.Discard, contexttar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return res.Digest
}

// readArchive reads the object at key back through Open, gunzips and
// untars it, and returns its entries: name -> content (directories map to
// "").
func readArchive(t testing.TB, s *Store, key string) map[string]string {
	t.Helper()
	body, err := s.Open(context.Background(), s.Bucket(), key)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer body.Close()
	zr, err := gzip.NewReader(body)
	if err != nil {
		t.Fatalf("gzip: %v", err)
	}
	tr := tar.NewReader(zr)
	got := map[string]string{}
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("tar: %v", err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("tar: %v", err)
		}
		got[hdr.Name] = string(b)
	}
	return got
}

// incompleteUploads lists the multipart uploads left open in the bucket.
func incompleteUploads(t testing.TB, s *Store) []string {
	t.Helper()
	var keys []string
	for u := range s.client.ListIncompleteUploads(context.Background(), s.Bucket(), "", true) {
		if u.Err != nil {
			t.Fatalf("ListIncompleteUploads: %v", u.Err)
		}
		keys = append(keys, u.Key)
	}
	return keys
}

// objects lists the keys in the bucket.
func objects(t testing.TB, s *Store) []string {
	t.Helper()
	var keys []string
	for o := range s.client.ListObjects(context.Background(), s.Bucket(), minio.ListObjectsOptions{Recursive: true}) {
		if o.Err != nil {
			t.Fatalf("ListObjects: %v", o.Err)
		}
		keys = append(keys, o.Key)
	}
	slices.Sort(keys)
	return keys
}

// countWrites counts the requests that can create or change data.
func countWrites(reqs []request) int {
	n := 0
	for _, r := range reqs {
		if r.Method == http.MethodPut || r.Method == http.MethodPost {
			n++
		}
	}
	return n
}
