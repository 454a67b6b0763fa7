package contexttar

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
)

func packed(t *testing.T, files map[string]string) ([]byte, string) {
	t.Helper()
	dir := t.TempDir()
	for p, c := range files {
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	res, err := Write(context.Background(), dir, &buf, Options{})
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), res.Digest
}

func TestFetch(t *testing.T) {
	t.Parallel()
	good, digest := packed(t, map[string]string{"Dockerfile": "FROM scratch\n", "a": "the right bytes"})
	other, _ := packed(t, map[string]string{"Dockerfile": "FROM scratch\n", "a": "planted bytes"})
	cases := []struct {
		name     string
		serve    func(n int32, w http.ResponseWriter)
		want     error // nil: success
		requests int32
	}{
		{name: "the object", serve: func(_ int32, w http.ResponseWriter) { _, _ = w.Write(good) }, requests: 1},
		{name: "bytes that do not match the digest", serve: func(_ int32, w http.ResponseWriter) { _, _ = w.Write(other) },
			want: ErrDigestMismatch, requests: 1},
		{name: "no such object", serve: func(_ int32, w http.ResponseWriter) { w.WriteHeader(http.StatusNotFound) },
			want: ErrFetchRefused, requests: 1},
		{name: "an expired signature", serve: func(_ int32, w http.ResponseWriter) { w.WriteHeader(http.StatusForbidden) },
			want: ErrFetchRefused, requests: 1},
		{name: "server errors are retried", serve: func(n int32, w http.ResponseWriter) {
			if n < 3 {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			_, _ = w.Write(good)
		}, requests: 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var n atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { c.serve(n.Add(1), w) }))
			defer srv.Close()
			dir := t.TempDir()
			err := Fetch(context.Background(), srv.Client(), srv.URL+"/bucket/key?X-Amz-Signature=secret-signature", digest, dir, 0)
			if c.want == nil && err != nil || c.want != nil && !errors.Is(err, c.want) {
				t.Fatalf("Fetch: %v, want %v", err, c.want)
			}
			if got := n.Load(); got != c.requests {
				t.Errorf("%d requests, want %d", got, c.requests)
			}
			entries, _ := os.ReadDir(dir)
			if c.want != nil {
				if len(entries) != 0 {
					t.Errorf("a failed fetch left %d entries to build", len(entries))
				}
				if strings.Contains(err.Error(), "secret-signature") {
					t.Errorf("the error shows the URL's signature: %v", err)
				}
				return
			}
			b, err := os.ReadFile(filepath.Join(dir, "a"))
			if err != nil || string(b) != "the right bytes" {
				t.Fatalf("extracted a = %q, %v", b, err)
			}
		})
	}
}

func TestFetchRefusesBadInput(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ url, digest, want string }{
		{"http://127.0.0.1:1/x", "", "needs the context's digest"},
		{"file:///etc/passwd", "sha256:" + strings.Repeat("0", 64), "must be an http(s) URL"},
	} {
		err := Fetch(context.Background(), nil, c.url, c.digest, t.TempDir(), 0)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Fetch(%q, %q) = %v, want %q", c.url, c.digest, err, c.want)
		}
	}
}

// A download cut short mid-body is a fault of the stream, not of the
// bytes: Fetch tries again and never calls it a mismatch (which fails the
// Job at once). Found by an adversarial review.
func TestFetchRetriesADownloadCutShort(t *testing.T) {
	t.Parallel()
	b := make([]byte, 256<<10)
	_, _ = rand.Read(b)
	good, digest := packed(t, map[string]string{"Dockerfile": "FROM scratch\n", "a": hex.EncodeToString(b)})
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if n.Add(1) == 1 {
			w.Header().Set("Content-Length", strconv.Itoa(len(good)))
			_, _ = w.Write(good[:len(good)/2]) // and the connection ends
			return
		}
		_, _ = w.Write(good)
	}))
	defer srv.Close()
	if err := Fetch(context.Background(), srv.Client(), srv.URL+"/b/k", digest, t.TempDir(), 0); err != nil || n.Load() != 2 {
		t.Fatalf("Fetch after one cut download: %v, %d requests; want success on the second", err, n.Load())
	}
}

// Every fault of the context a digest names — its bytes are the named
// ones — is ErrBadContext (shared by every request for it), whatever the
// fault; and bytes after the end of the archive past the tar padding are
// not a context.
func TestExtractVerifiedClassifiesEveryFaultOfTheNamedContext(t *testing.T) {
	t.Parallel()
	cases := map[string][]byte{
		"file then child":  makeTar(t, tarEntry{name: "a", body: "x"}, tarEntry{name: "a/b", body: "y"}),
		"empty link":       makeTar(t, tarEntry{name: "l", typ: tar.TypeSymlink, linkname: ""}),
		"unsupported type": makeTar(t, tarEntry{name: "s", typ: 'Z'}),
	}
	for name, raw := range cases {
		sum := sha256.Sum256(raw)
		want := "sha256:" + hex.EncodeToString(sum[:])
		if err := ExtractVerified(context.Background(), bytes.NewReader(gz(t, raw)), t.TempDir(), 0, want); !errors.Is(err, ErrBadContext) {
			t.Errorf("%s: %v, want ErrBadContext", name, err)
		}
	}
	raw := append(makeTar(t, tarEntry{name: "a", body: "x"}), make([]byte, 2<<20)...)
	sum := sha256.Sum256(raw)
	if err := ExtractVerified(context.Background(), bytes.NewReader(gz(t, raw)), t.TempDir(), 0, "sha256:"+hex.EncodeToString(sum[:])); !errors.Is(err, ErrDigestMismatch) {
		t.Errorf("2 MiB after the end of the archive: %v, want a mismatch", err)
	}
}
