package s3store

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
)

func TestNew(t *testing.T) {
	t.Parallel()
	valid := Config{Endpoint: "http://127.0.0.1:9000", AccessKey: "a", SecretKey: "b"}
	tests := []struct {
		name    string
		mutate  func(*Config)
		wantErr string // substring; "" means success
	}{
		{"accepts http endpoint", func(*Config) {}, ""},
		{"accepts https endpoint with trailing slash", func(c *Config) { c.Endpoint = "https://s3.amazonaws.com/" }, ""},
		{"accepts anonymous access", func(c *Config) { c.AccessKey, c.SecretKey = "", "" }, ""},
		{"refuses endpoint without scheme", func(c *Config) { c.Endpoint = "127.0.0.1:9000" }, "http:// or https://"},
		{"refuses host name without scheme", func(c *Config) { c.Endpoint = "minio:9000" }, "http:// or https://"},
		{"refuses other scheme", func(c *Config) { c.Endpoint = "s3://bucket" }, "http:// or https://"},
		{"refuses empty endpoint", func(c *Config) { c.Endpoint = "" }, "http:// or https://"},
		{"refuses endpoint with path", func(c *Config) { c.Endpoint = "http://minio:9000/prefix" }, "path"},
		{"refuses access key without secret", func(c *Config) { c.SecretKey = "" }, "both"},
		{"refuses secret without access key", func(c *Config) { c.AccessKey = "" }, "both"},
		{"refuses invalid bucket name", func(c *Config) { c.Bucket = "Not_A_Bucket" }, "bucket"},
		{"refuses part size below S3 minimum", func(c *Config) { c.PartSize = 1 << 20 }, "part size"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := valid
			tt.mutate(&cfg)
			s, err := New(cfg)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("New = %v, %v; want error containing %q", s, err, tt.wantErr)
			}
		})
	}

	t.Run("applies defaults", func(t *testing.T) {
		t.Parallel()
		s, err := New(valid)
		if err != nil {
			t.Fatal(err)
		}
		if s.Bucket() != DefaultBucket || s.region != DefaultRegion || s.partSize != DefaultPartSize {
			t.Errorf("bucket, region, part size = %q, %q, %d; want %q, %q, %d",
				s.Bucket(), s.region, s.partSize, DefaultBucket, DefaultRegion, DefaultPartSize)
		}
	})
}

func TestContextKey(t *testing.T) {
	t.Parallel()
	hex := strings.Repeat("0123456789abcdef", 4)
	tests := []struct{ digest, want string }{
		{"sha256:" + hex, "contexts/sha256/" + hex + ".tar.gz"},
		{hex, ""},                              // no algorithm
		{"sha512:" + hex, ""},                  // other algorithm
		{"sha256:" + hex[:63], ""},             // too short
		{"sha256:" + strings.ToUpper(hex), ""}, // not contexttar's form
		{"sha256:" + hex[:62] + "/x", ""},      // path characters
		{"sha256:../../" + hex[:58], ""},       // traversal attempt
		{"", ""},
	}
	for _, tt := range tests {
		if got := ContextKey(tt.digest); got != tt.want {
			t.Errorf("ContextKey(%q) = %q, want %q", tt.digest, got, tt.want)
		}
	}
}

func TestExistsAndOpen(t *testing.T) {
	t.Parallel()
	f := newFakeS3(t)
	s := f.store(t, f.config(), tuning{})
	ctx := context.Background()
	key := ContextKey("sha256:" + strings.Repeat("ab", 32))

	t.Run("missing key does not exist", func(t *testing.T) {
		if ok, err := s.Exists(ctx, testBucket, key); ok || err != nil {
			t.Errorf("Exists = %v, %v; want false, nil", ok, err)
		}
	})
	t.Run("missing bucket does not exist", func(t *testing.T) {
		if ok, err := s.Exists(ctx, "no-such-bucket", key); ok || err != nil {
			t.Errorf("Exists = %v, %v; want false, nil", ok, err)
		}
	})
	t.Run("opening a missing key is ErrNotFound at Open time", func(t *testing.T) {
		body, err := s.Open(ctx, testBucket, key)
		if !errors.Is(err, ErrNotFound) {
			t.Fatalf("Open = %v, %v; want ErrNotFound", body, err)
		}
		if IsTransient(err) {
			t.Errorf("IsTransient(%v) = true", err)
		}
	})
	t.Run("opening in a missing bucket is ErrNotFound", func(t *testing.T) {
		if _, err := s.Open(ctx, "no-such-bucket", key); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Open = %v; want ErrNotFound", err)
		}
	})

	const content = "not really a tar.gz"
	if _, err := s.client.PutObject(ctx, testBucket, key, strings.NewReader(content), int64(len(content)), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Run("stored key exists", func(t *testing.T) {
		if ok, err := s.Exists(ctx, testBucket, key); !ok || err != nil {
			t.Errorf("Exists = %v, %v; want true, nil", ok, err)
		}
	})
	t.Run("opening a stored key streams its body", func(t *testing.T) {
		body, err := s.Open(ctx, testBucket, key)
		if err != nil {
			t.Fatal(err)
		}
		defer body.Close()
		if b, err := io.ReadAll(body); err != nil || string(b) != content {
			t.Errorf("body = %q, %v; want %q", b, err, content)
		}
	})
}

func TestEnsureBucket(t *testing.T) {
	t.Parallel()
	f := newFakeS3(t)
	s, err := newStore(f.config(), tuning{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := range 2 { // the second call finds the bucket there
		if err := s.EnsureBucket(ctx); err != nil {
			t.Fatalf("EnsureBucket #%d: %v", i+1, err)
		}
	}
	if ok, err := s.client.BucketExists(ctx, testBucket); !ok || err != nil {
		t.Errorf("BucketExists = %v, %v; want true", ok, err)
	}
	// Two stores racing to create it both succeed.
	s2, err := newStore(func() Config { c := f.config(); c.Bucket = "raced"; return c }(), tuning{})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = s2.EnsureBucket(ctx) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Errorf("concurrent EnsureBucket: %v", err)
	}
}

// PutArchive stores a packed archive under the tenant's key for its
// digest, once: a second put of the same digest is skipped, and a
// malformed digest never becomes an object name.
func TestPutArchiveStoresUnderTheTenantsKeyOnce(t *testing.T) {
	t.Parallel()
	f := newFakeS3(t)
	s := f.store(t, f.config(), tuning{}).ForTenant("acme")
	ctx := context.Background()
	digest := "sha256:" + strings.Repeat("cd", 32)
	const archive = "packed archive bytes"
	res, err := s.PutArchive(ctx, digest, strings.NewReader(archive), int64(len(archive)))
	if err != nil || res.Skipped || res.Key != TenantContextKey("acme", digest) {
		t.Fatalf("PutArchive = %+v, %v; want a new object under acme's key", res, err)
	}
	body, err := s.Open(ctx, testBucket, res.Key)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(body)
	_ = body.Close()
	if string(b) != archive {
		t.Fatalf("stored %q", b)
	}
	again, err := s.PutArchive(ctx, digest, strings.NewReader("other"), 5)
	if err != nil || !again.Skipped {
		t.Fatalf("second PutArchive = %+v, %v; want skipped", again, err)
	}
	if _, err := s.PutArchive(ctx, "sha256:../../x", strings.NewReader(archive), int64(len(archive))); err == nil {
		t.Fatal("a malformed digest was stored")
	}
}

func TestPutLogAndExpire(t *testing.T) {
	t.Parallel()
	f := newFakeS3(t)
	s := f.store(t, f.config(), tuning{})
	ctx := context.Background()
	if _, err := s.PutLog(ctx, "contexts/x", []byte("z")); err == nil {
		t.Fatal("a log was stored outside logs/")
	}
	bucket, err := s.PutLog(ctx, "logs/acme/k/r1.log.gz", []byte("gz"))
	if err != nil || bucket != testBucket {
		t.Fatalf("PutLog = %q, %v", bucket, err)
	}
	body, err := s.Open(ctx, bucket, "logs/acme/k/r1.log.gz")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(body)
	_ = body.Close()
	if string(b) != "gz" {
		t.Fatalf("stored %q", b)
	}
	if n, err := s.ExpireLogs(ctx, time.Now().Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("ExpireLogs of an hour ago = %d, %v; want nothing deleted", n, err)
	}
	if n, err := s.ExpireLogs(ctx, time.Now().Add(time.Hour)); err != nil || n != 1 {
		t.Fatalf("ExpireLogs = %d, %v; want the one log deleted", n, err)
	}
	if ok, _ := s.Exists(ctx, bucket, "logs/acme/k/r1.log.gz"); ok {
		t.Fatal("the expired log is still there")
	}
}
