package s3store

import (
	"encoding/base64"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"testing"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// fakeS3ServerEnv, when set, makes the test binary serve gofakes3 instead
// of running tests. BenchmarkUploadContext runs its server that way, in a
// child process, so that the heap it measures is the client's alone: s3mem
// keeps every part and object in memory, which would otherwise swamp the
// number the benchmark exists to show.
const fakeS3ServerEnv = "BUILDQ_S3STORE_FAKES3_SERVER"

func TestMain(m *testing.M) {
	if os.Getenv(fakeS3ServerEnv) != "" {
		serveFakeS3()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// serveFakeS3 serves gofakes3 over TLS (see newFakeS3 for why TLS) on a
// loopback port, prints "<url> <base64 DER certificate>" on stdout, and
// exits when stdin reaches EOF, that is when the parent closes it or dies.
func serveFakeS3() {
	srv := httptest.NewTLSServer(checkAccessKey(gofakes3.New(s3mem.New(), gofakes3.WithoutVersioning()).Server()))
	fmt.Println(srv.URL, base64.StdEncoding.EncodeToString(srv.Certificate().Raw))
	_, _ = io.Copy(io.Discard, os.Stdin)
	srv.Close()
}
