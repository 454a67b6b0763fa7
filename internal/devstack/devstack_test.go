package devstack

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/validate"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/sirupsen/logrus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// anyPortOptions lets every test run in parallel with the others and with a real
// `buildq dev` on the default ports.
func anyPortOptions(dir string) Options {
	return Options{
		DataDir:      dir,
		NATSAddr:     "127.0.0.1:0",
		S3Addr:       "127.0.0.1:0",
		RegistryAddr: "127.0.0.1:0",
	}
}

func startStack(t *testing.T, opts Options) *Stack {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := Start(ctx, opts)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func minioClient(t *testing.T, s *Stack, region string) *minio.Client {
	t.Helper()
	mc, err := minio.New(strings.TrimPrefix(s.S3Endpoint, "http://"), &minio.Options{
		Creds:  credentials.NewStaticV4(s.S3AccessKey, s.S3SecretKey, ""),
		Secure: false,
		Region: region,
	})
	if err != nil {
		t.Fatalf("minio.New: %v", err)
	}
	return mc
}

func getObject(ctx context.Context, t *testing.T, mc *minio.Client, bucket, key string) []byte {
	t.Helper()
	obj, err := mc.GetObject(ctx, bucket, key, minio.GetObjectOptions{})
	if err != nil {
		t.Fatalf("GetObject %s: %v", key, err)
	}
	defer obj.Close()
	b, err := io.ReadAll(obj)
	if err != nil {
		t.Fatalf("read %s: %v", key, err)
	}
	return b
}

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRestartKeepsState is the main contract: what is written to each
// service survives Close and a new Start on the same DataDir.
func TestRestartKeepsState(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()

	s := startStack(t, anyPortOptions(dir))
	if s.Bucket != DefaultBucket || s.S3AccessKey != DevAccessKey || s.S3SecretKey != DevSecretKey {
		t.Fatalf("unexpected stack fields: %+v", s)
	}
	for _, a := range []string{strings.TrimPrefix(s.NATSURL, "nats://"), strings.TrimPrefix(s.S3Endpoint, "http://"), s.RegistryAddr} {
		host, port, err := net.SplitHostPort(a)
		if err != nil || host != "127.0.0.1" || port == "0" {
			t.Fatalf("address %q: want 127.0.0.1 with a real port (err %v)", a, err)
		}
	}

	// NATS: a stream with one message.
	nc, err := nats.Connect(s.NATSURL)
	if err != nil {
		t.Fatalf("nats connect: %v", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DEVSTACK", Subjects: []string{"devstack.>"}}); err != nil {
		t.Fatalf("create stream: %v", err)
	}
	if _, err := js.Publish(ctx, "devstack.hello", []byte("hi")); err != nil {
		t.Fatalf("publish: %v", err)
	}
	nc.Close()

	// S3: a plain PUT, a PUT of unknown size (minio-go turns that into a
	// multipart upload) and a two-part multipart upload.
	mc := minioClient(t, s, DevRegion)
	small := []byte("hello devstack")
	if _, err := mc.PutObject(ctx, s.Bucket, "small.txt", bytes.NewReader(small), int64(len(small)), minio.PutObjectOptions{}); err != nil {
		t.Fatalf("PutObject: %v", err)
	}
	unknown := randomBytes(t, 100<<10)
	if _, err := mc.PutObject(ctx, s.Bucket, "dir/unknown-size.bin", bytes.NewReader(unknown), -1, minio.PutObjectOptions{PartSize: 5 << 20}); err != nil {
		t.Fatalf("PutObject unknown size: %v", err)
	}
	multi := randomBytes(t, 6<<20)
	if _, err := mc.PutObject(ctx, s.Bucket, "dir/multi.bin", io.NopCloser(bytes.NewReader(multi)), int64(len(multi)), minio.PutObjectOptions{PartSize: 5 << 20}); err != nil {
		t.Fatalf("PutObject multipart: %v", err)
	}

	// Registry: a random image.
	repo := s.RegistryAddr + "/devstack/test:v1"
	ref, err := name.ParseReference(repo, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := random.Image(1024, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, remote.WithContext(ctx)); err != nil {
		t.Fatalf("push: %v", err)
	}
	want, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	// An OCI index too, as multi-platform builds push one; the registry
	// checks that every child manifest exists.
	idxRef, err := name.ParseReference(s.RegistryAddr+"/devstack/multi:v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := random.Index(512, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(idxRef, idx, remote.WithContext(ctx)); err != nil {
		t.Fatalf("push index: %v", err)
	}
	wantIdx, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}

	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if resp, err := http.Get("http://" + s.RegistryAddr + "/v2/"); err == nil {
		resp.Body.Close()
		t.Fatalf("registry still answers after Close")
	}

	// Same DataDir, new ports.
	s2 := startStack(t, anyPortOptions(dir))

	nc2, err := nats.Connect(s2.NATSURL)
	if err != nil {
		t.Fatalf("nats connect after restart: %v", err)
	}
	defer nc2.Close()
	js2, err := jetstream.New(nc2)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js2.Stream(ctx, "DEVSTACK")
	if err != nil {
		t.Fatalf("stream after restart: %v", err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("stream has %d messages after restart, want 1", info.State.Msgs)
	}

	// No region this time: minio-go then asks the server for the bucket
	// location first, which must work too.
	mc2 := minioClient(t, s2, "")
	for key, data := range map[string][]byte{"small.txt": small, "dir/unknown-size.bin": unknown, "dir/multi.bin": multi} {
		if got := getObject(ctx, t, mc2, s2.Bucket, key); !bytes.Equal(got, data) {
			t.Fatalf("object %s after restart: got %d bytes, want %d (content differs)", key, len(got), len(data))
		}
	}

	ref2, err := name.ParseReference(s2.RegistryAddr+"/devstack/test:v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Head(ref2, remote.WithContext(ctx))
	if err != nil {
		t.Fatalf("head after restart: %v", err)
	}
	if desc.Digest != want {
		t.Fatalf("manifest digest after restart = %s, want %s", desc.Digest, want)
	}
	idxRef2, err := name.ParseReference(s2.RegistryAddr+"/devstack/multi:v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if desc, err := remote.Head(idxRef2, remote.WithContext(ctx)); err != nil || desc.Digest != wantIdx {
		t.Fatalf("index after restart: %v, %v; want digest %s", desc, err, wantIdx)
	}
	// Blobs persisted too: pull and verify every layer.
	pulled, err := remote.Image(ref2, remote.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Image(pulled); err != nil {
		t.Fatalf("pulled image invalid: %v", err)
	}
	// Delete is enabled.
	if err := remote.Delete(ref2.Context().Digest(want.String()), remote.WithContext(ctx)); err != nil {
		t.Fatalf("delete manifest: %v", err)
	}
	if _, err := remote.Head(ref2, remote.WithContext(ctx)); err == nil {
		t.Fatalf("manifest still served after delete")
	}
}

// freeAddr returns a loopback address that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

func assertFree(t *testing.T, addr string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("%s is still taken after a failed Start: %v", addr, err)
	}
	_ = ln.Close()
}

func TestBusyPort(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		service, flag string
		set           func(*Options, string)
	}{
		{"nats", "--nats-addr", func(o *Options, a string) { o.NATSAddr = a }},
		{"s3", "--s3-addr", func(o *Options, a string) { o.S3Addr = a }},
		{"registry", "--registry-addr", func(o *Options, a string) { o.RegistryAddr = a }},
	} {
		t.Run(tc.service, func(t *testing.T) {
			t.Parallel()
			busy, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer busy.Close()
			busyAddr := busy.Addr().String()

			dir := t.TempDir()
			opts := Options{DataDir: dir, NATSAddr: freeAddr(t), S3Addr: freeAddr(t), RegistryAddr: freeAddr(t)}
			tc.set(&opts, busyAddr)

			s, err := Start(context.Background(), opts)
			if err == nil {
				_ = s.Close()
				t.Fatal("Start succeeded on a busy port")
			}
			want := tc.service + ": listen " + busyAddr + ": address already in use — another buildq dev running? use " + tc.flag
			if err.Error() != want {
				t.Fatalf("error = %q\nwant    %q", err, want)
			}
			var inUse *AddrInUseError
			if !errors.As(err, &inUse) || inUse.Service != tc.service {
				t.Fatalf("error %T is not an AddrInUseError for %s", err, tc.service)
			}
			if !errors.Is(err, syscall.EADDRINUSE) {
				t.Fatalf("error does not wrap EADDRINUSE")
			}

			// Nothing else is left listening...
			for _, a := range []string{opts.NATSAddr, opts.S3Addr, opts.RegistryAddr} {
				if a != busyAddr {
					assertFree(t, a)
				}
			}
			// ...and the data dir is not left locked.
			s = startStack(t, anyPortOptions(dir))
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestSameDataDirTwice(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	startStack(t, anyPortOptions(dir))
	s, err := Start(context.Background(), anyPortOptions(dir))
	if err == nil {
		_ = s.Close()
		t.Fatal("second Start on the same DataDir succeeded")
	}
	if !strings.Contains(err.Error(), "another buildq dev") {
		t.Fatalf("unclear error: %v", err)
	}
}

func TestOptionsValidation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		opts Options
		want string
	}{
		{Options{}, "DataDir is required"},
		{Options{DataDir: t.TempDir(), NATSAddr: "0.0.0.0:4222"}, "nats: address \"0.0.0.0:4222\" is not a loopback address"},
		{Options{DataDir: t.TempDir(), S3Addr: "192.0.2.1:9000"}, "use --s3-addr 127.0.0.1:PORT, or add --unsafe-listen"},
		{Options{DataDir: t.TempDir(), RegistryAddr: "192.0.2.1:5000"}, "use --registry-addr 127.0.0.1:PORT, or add --unsafe-listen"},
		// --unsafe-listen never exposes NATS, and wants IP addresses.
		{Options{DataDir: t.TempDir(), UnsafeListen: true, NATSAddr: "192.0.2.1:4222"}, "nats: address \"192.0.2.1:4222\" is not a loopback address; buildq dev has no authentication and only listens on 127.0.0.1 (use --nats-addr 127.0.0.1:PORT)"},
		{Options{DataDir: t.TempDir(), UnsafeListen: true, S3Addr: "minio.example:9000"}, "the host must be an IP address"},
		{Options{DataDir: t.TempDir(), RegistryAddr: "5000"}, "registry: bad address"},
		{Options{DataDir: t.TempDir(), NATSAddr: "127.0.0.1:0", S3Addr: "127.0.0.1:0", RegistryAddr: "127.0.0.1:0", Bucket: "Bad_Bucket"}, "s3: bucket \"Bad_Bucket\""},
	} {
		s, err := Start(context.Background(), tc.opts)
		if err == nil {
			_ = s.Close()
			t.Fatalf("Start(%+v) succeeded", tc.opts)
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("Start(%+v) error = %q, want it to contain %q", tc.opts, err, tc.want)
		}
	}
}

func TestLoopbackAddrDefaults(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                DefaultRegistryAddr,
		":5001":           "127.0.0.1:5001",
		"localhost:5002":  "127.0.0.1:5002",
		"127.0.0.2:5003":  "127.0.0.2:5003",
		"[::1]:5004":      "[::1]:5004",
		"127.0.0.1:0":     "127.0.0.1:0",
		"localhost:65535": "127.0.0.1:65535",
	} {
		got, err := loopbackAddr("registry", in, DefaultRegistryAddr, registryFlag, false)
		if err != nil || got != want {
			t.Errorf("loopbackAddr(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	// --unsafe-listen: the address as given (what a kind or k3d bridge's
	// Pods reach).
	if got, err := loopbackAddr("registry", "172.18.0.1:5000", DefaultRegistryAddr, registryFlag, true); err != nil || got != "172.18.0.1:5000" {
		t.Errorf("unsafe loopbackAddr = %q, %v", got, err)
	}
}

// TestLogsGoToZap is not parallel, so it is the only stack running while it
// checks where the services' logs go and that logrus is given back.
func TestLogsGoToZap(t *testing.T) {
	std := logrus.StandardLogger()
	origOut, origLevel := std.Out, std.GetLevel()

	core, logs := observer.New(zap.DebugLevel)
	opts := anyPortOptions(t.TempDir())
	opts.Logger = zap.New(core)
	s := startStack(t, opts)

	if std.Out != io.Discard {
		t.Fatalf("logrus output not redirected while the stack runs")
	}
	// A request for a missing manifest makes the registry log an error.
	resp, err := http.Get("http://" + s.RegistryAddr + "/v2/nope/manifests/latest")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("missing manifest: status %d", resp.StatusCode)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	seen := map[string]bool{}
	for _, e := range logs.All() {
		seen[e.LoggerName] = true
		if e.LoggerName != "" && e.Level != zap.DebugLevel {
			t.Errorf("%s logged at %s, want debug: %s", e.LoggerName, e.Level, e.Message)
		}
	}
	for _, n := range []string{"nats", "registry"} {
		if !seen[n] {
			t.Errorf("no %s logs reached zap (saw %v)", n, seen)
		}
	}
	if std.Out != origOut || std.GetLevel() != origLevel {
		t.Fatalf("logrus not restored after Close")
	}
}

func TestAWSChunkedReader(t *testing.T) {
	t.Parallel()
	sig := ";chunk-signature=" + strings.Repeat("a", 64) + "\r\n"
	body := "5" + sig + "hello\r\n" +
		"6" + sig + " world\r\n" +
		"0" + sig +
		"x-amz-checksum-crc32c:AAAAAA==\r\n" +
		"x-amz-trailer-signature:" + strings.Repeat("b", 64) + "\r\n\r\n"

	r := &awsChunkedReader{br: bufioReader(body), body: io.NopCloser(nil), total: 11}
	got, err := io.ReadAll(r)
	if err != nil || string(got) != "hello world" {
		t.Fatalf("decoded %q, %v", got, err)
	}

	short := &awsChunkedReader{br: bufioReader(body), body: io.NopCloser(nil), total: 12}
	if _, err := io.ReadAll(short); err == nil {
		t.Fatal("length mismatch not detected")
	}
	truncated := &awsChunkedReader{br: bufioReader(body[:20]), body: io.NopCloser(nil), total: 11}
	if _, err := io.ReadAll(truncated); err == nil {
		t.Fatal("truncated body not detected")
	}
}

func bufioReader(s string) *bufio.Reader { return bufio.NewReader(strings.NewReader(s)) }
