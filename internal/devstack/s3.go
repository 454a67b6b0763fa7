package devstack

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3bolt"
	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
	"go.uber.org/zap"
)

// s3Server is gofakes3 on a bbolt file, served by net/http.
type s3Server struct {
	db      *bolt.DB
	handler http.Handler
	log     *zap.Logger

	http *httpServer
}

// openS3 opens (or creates) the bbolt store, makes sure the bucket exists and
// prepares the handler. It does not listen yet.
func openS3(dir, bucket string, log *zap.Logger) (*s3Server, error) {
	if err := gofakes3.ValidateBucketName(bucket); err != nil {
		return nil, fmt.Errorf("s3: bucket %q: %w", bucket, err)
	}
	path := filepath.Join(dir, "s3.bolt")
	// bbolt takes an exclusive flock on the file and by default waits for
	// it forever; a timeout turns "another buildq dev uses this data dir"
	// into an error instead of a hang.
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, fmt.Errorf("s3: %s is locked — another buildq dev is using data dir %s; stop it or use another data dir",
				path, filepath.Dir(dir))
		}
		return nil, fmt.Errorf("s3: open %s: %w", path, err)
	}
	backend := s3bolt.New(db)
	exists, err := backend.BucketExists(bucket)
	if err == nil && !exists {
		err = backend.CreateBucket(bucket)
	}
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("s3: create bucket %q: %w", bucket, err)
	}

	l := log.Named("s3")
	faker := gofakes3.New(backend, gofakes3.WithLogger(s3Logger{l}))
	return &s3Server{
		db:      db,
		handler: decodeAWSChunked(faker.Server()),
		log:     l,
	}, nil
}

// serve starts the HTTP server on ln in the background.
func (s *s3Server) serve(ln net.Listener) {
	s.http = serveHTTP("s3", ln, s.handler, s.log)
}

// shutdown stops the HTTP server; the store is closed by closeStore, which
// runs after it (closers run in reverse order).
func (s *s3Server) shutdown() error {
	return s.http.shutdown()
}

func (s *s3Server) closeStore() error {
	return s.db.Close()
}

// s3Logger routes gofakes3's per-request log lines to zap at debug level.
type s3Logger struct{ log *zap.Logger }

func (l s3Logger) Print(level gofakes3.LogLevel, v ...any) {
	if l.log.Core().Enabled(zap.DebugLevel) {
		l.log.Debug(strings.TrimSuffix(fmt.Sprintln(v...), "\n"), zap.String("s3_level", string(level)))
	}
}

// decodeAWSChunked strips the aws-chunked framing that SigV4 streaming
// uploads use, before gofakes3 sees the request.
//
// minio-go signs every PUT over plain HTTP with
// "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", which frames the body in
// signed chunks. gofakes3 v1.2.0 unwraps that framing for PutObject but not
// for UploadPart, so every multipart upload (minio-go uses one for any
// object over 16 MiB and for every upload of unknown size) would store the
// framing bytes inside the object. It also does not know the -TRAILER
// variants. Decoding here, for every PUT, fixes all of them; signatures are
// not checked anyway.
func decodeAWSChunked(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sha := r.Header.Get("X-Amz-Content-Sha256")
		if r.Method != http.MethodPut || !strings.HasPrefix(sha, "STREAMING-") {
			next.ServeHTTP(w, r)
			return
		}
		size, err := strconv.ParseInt(r.Header.Get("X-Amz-Decoded-Content-Length"), 10, 64)
		if err != nil || size < 0 {
			http.Error(w, "missing or bad x-amz-decoded-content-length", http.StatusBadRequest)
			return
		}
		r.Body = &awsChunkedReader{br: bufio.NewReader(r.Body), body: r.Body, total: size}
		r.ContentLength = size
		r.Header.Set("Content-Length", strconv.FormatInt(size, 10))
		r.Header.Set("X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD")
		r.Header.Del("X-Amz-Decoded-Content-Length")
		r.Header.Del("X-Amz-Trailer")
		if enc := withoutAWSChunked(r.Header.Values("Content-Encoding")); len(enc) > 0 {
			r.Header["Content-Encoding"] = enc
		} else {
			r.Header.Del("Content-Encoding")
		}
		next.ServeHTTP(w, r)
	})
}

func withoutAWSChunked(values []string) []string {
	var out []string
	for _, v := range values {
		for _, e := range strings.Split(v, ",") {
			if e = strings.TrimSpace(e); e != "" && !strings.EqualFold(e, "aws-chunked") {
				out = append(out, e)
			}
		}
	}
	return out
}

// awsChunkedReader decodes an aws-chunked body:
//
//	hex-size[;chunk-signature=...]\r\n <size bytes> \r\n ... 0[;...]\r\n [trailers] \r\n
//
// It stops at the zero-size chunk and ignores trailers (checksums and their
// signature), and checks that the decoded size matches the declared one.
type awsChunkedReader struct {
	br      *bufio.Reader
	body    io.Closer
	total   int64 // declared decoded length
	read    int64 // decoded bytes returned so far
	remain  int64 // bytes left in the current chunk
	started bool  // a chunk has been read, so a CRLF precedes the next header
	err     error // sticky
}

func (c *awsChunkedReader) Read(p []byte) (int, error) {
	for c.remain == 0 {
		if c.err != nil {
			return 0, c.err
		}
		c.err = c.nextChunk()
	}
	if int64(len(p)) > c.remain {
		p = p[:c.remain]
	}
	n, err := c.br.Read(p)
	c.remain -= int64(n)
	c.read += int64(n)
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		c.err = err
	}
	return n, err
}

// nextChunk reads the next chunk header. It returns io.EOF at the final
// chunk, after checking the decoded length.
func (c *awsChunkedReader) nextChunk() error {
	if c.started {
		if err := c.expectCRLF(); err != nil {
			return err
		}
	}
	c.started = true
	// ReadSlice fails on lines longer than the buffer (4 KiB), which bounds
	// what a malformed header can make us buffer.
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		return fmt.Errorf("aws-chunked: read chunk header: %w", noEOF(err))
	}
	hdr := strings.TrimRight(string(line), "\r\n")
	if i := strings.IndexByte(hdr, ';'); i >= 0 {
		hdr = hdr[:i]
	}
	size, err := strconv.ParseInt(strings.TrimSpace(hdr), 16, 64)
	if err != nil || size < 0 {
		return fmt.Errorf("aws-chunked: bad chunk size %q", hdr)
	}
	if size == 0 {
		if c.read != c.total {
			return fmt.Errorf("aws-chunked: decoded %d bytes, x-amz-decoded-content-length says %d", c.read, c.total)
		}
		return io.EOF
	}
	if c.read+size > c.total {
		return fmt.Errorf("aws-chunked: body longer than x-amz-decoded-content-length %d", c.total)
	}
	c.remain = size
	return nil
}

func (c *awsChunkedReader) expectCRLF() error {
	var b [2]byte
	if _, err := io.ReadFull(c.br, b[:]); err != nil {
		return fmt.Errorf("aws-chunked: %w", noEOF(err))
	}
	if b != [2]byte{'\r', '\n'} {
		return errors.New("aws-chunked: missing CRLF after chunk data")
	}
	return nil
}

func (c *awsChunkedReader) Close() error { return c.body.Close() }

func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
