package s3store

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/buildq/buildq/internal/contexttar"
)

// BenchmarkUploadContext packs and uploads generated contexts to gofakes3
// (running in a child process, see fakeS3ServerEnv) and reports:
//
//   - MB/s: bytes of uncompressed tar per UploadContext (which packs twice:
//     the hashing pass, then the upload pass);
//   - peak-heap-MiB: the high-water mark of runtime.MemStats.HeapInuse,
//     sampled every 2 ms during the timed loop, garbage awaiting collection
//     included;
//   - object-MiB: the size of the stored (gzipped) object.
//
// The content is random, so gzip cannot shrink it: every byte of the
// context passes through the uploader's part buffer, the worst case for
// memory. The cases show that the peak follows Config.PartSize (about two
// parts, with GC slack) and not the context's size.
//
// Each iteration deletes the object afterwards (untimed) so that the next
// one uploads instead of being skipped.
func BenchmarkUploadContext(b *testing.B) {
	endpoint, transport := startFakeS3Process(b)
	dirs := map[int]string{}
	for _, mib := range []int{8, 32} {
		dirs[mib] = generateContext(b, mib)
	}

	cases := []struct {
		ctxMiB   int
		partSize uint64
	}{
		{8, MinPartSize},
		{32, MinPartSize},
		{32, DefaultPartSize},
	}
	for _, c := range cases {
		b.Run(fmt.Sprintf("ctx=%dMiB/part=%dMiB", c.ctxMiB, c.partSize>>20), func(b *testing.B) {
			dir := dirs[c.ctxMiB]
			s, err := New(Config{
				Endpoint:  endpoint,
				AccessKey: testAccessKey,
				SecretKey: testSecretKey,
				Bucket:    testBucket,
				PartSize:  c.partSize,
				Transport: transport,
			})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			if err := s.EnsureBucket(ctx); err != nil {
				b.Fatal(err)
			}
			packed, err := contexttar.Write(ctx, dir, io.Discard, contexttar.Options{})
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(packed.Size)

			runtime.GC()
			stop := sampleHeapInuse()
			var objectSize int64
			for b.Loop() {
				res, err := s.UploadContext(ctx, dir, contexttar.Options{}, nil)
				if err != nil {
					b.Fatal(err)
				}
				if res.Skipped {
					b.Fatal("upload skipped: the previous iteration's object is still there")
				}
				b.StopTimer()
				info, err := s.client.StatObject(ctx, testBucket, res.Key, minio.StatObjectOptions{})
				if err != nil {
					b.Fatal(err)
				}
				objectSize = info.Size
				if err := s.client.RemoveObject(ctx, testBucket, res.Key, minio.RemoveObjectOptions{}); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			peak := stop()
			b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
			b.ReportMetric(float64(objectSize)/(1<<20), "object-MiB")
		})
	}
}

// sampleHeapInuse samples HeapInuse until the returned function is called,
// which returns the highest value seen.
func sampleHeapInuse() (stop func() uint64) {
	var (
		wg   sync.WaitGroup
		peak uint64
		done = make(chan struct{})
	)
	sample := func() {
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		peak = max(peak, ms.HeapInuse)
	}
	wg.Go(func() {
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		for {
			sample()
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	})
	return func() uint64 {
		close(done)
		wg.Wait()
		return peak
	}
}

// generateContext writes a context of mib MiB of random content, as files
// of 1 MiB plus a Dockerfile, and returns its directory.
func generateContext(b *testing.B, mib int) string {
	b.Helper()
	dir := b.TempDir()
	rng := rand.NewChaCha8([32]byte{byte(mib)})
	buf := make([]byte, 1<<20)
	for i := range mib {
		_, _ = rng.Read(buf)
		p := filepath.Join(dir, fmt.Sprintf("dir%d", i%4), fmt.Sprintf("blob%03d.bin", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(p, buf, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM scratch\nCOPY . /\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	return dir
}

// startFakeS3Process starts this test binary as a gofakes3 server (see
// TestMain) and returns its URL and a transport trusting its certificate.
// The child exits when the benchmark ends and closes its stdin.
func startFakeS3Process(b *testing.B) (string, http.RoundTripper) {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fakeS3ServerEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})

	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatalf("fake S3 server did not start: %v", err)
	}
	endpoint, certB64, ok := strings.Cut(strings.TrimSpace(line), " ")
	if !ok {
		b.Fatalf("fake S3 server said %q", line)
	}
	der, err := base64.StdEncoding.DecodeString(certB64)
	if err != nil {
		b.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		b.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.TLSClientConfig = &tls.Config{RootCAs: pool}
	b.Cleanup(transport.CloseIdleConnections)
	return endpoint, transport
}
