// Package s3store stores build contexts in S3 or MinIO, keyed by their
// digest, and reads them back.
//
// Producers call UploadContext, which packs a directory with contexttar and
// uploads it under ContextKey(digest) unless an object is already there:
// because the key is derived from the content, an existing object is by
// construction the same context, and re-uploading it would only waste
// bandwidth. Workers call Open with the bucket and key a build message
// names. IsTransient tells either side whether a failure is worth a retry.
//
// The store uses path-style addressing (http://host/bucket/key), which MinIO
// needs and AWS still accepts, so one configuration shape serves both.
package s3store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/minio/minio-go/v7/pkg/s3utils"

	"github.com/buildq/buildq/internal/contexttar"
)

const (
	// DefaultRegion is used when Config.Region is empty. Setting a region at
	// all matters: without one, minio-go asks the server for the bucket's
	// location before its first request, an extra round trip (and one more
	// permission) that MinIO and most S3 clones answer with us-east-1
	// anyway.
	DefaultRegion = "us-east-1"
	// DefaultBucket is used when Config.Bucket is empty.
	DefaultBucket = "buildq"
	// DefaultPartSize is used when Config.PartSize is 0: the part size
	// minio-go picks for itself, big enough that a 1 GiB context (the
	// contexttar cap) needs only 64 parts, small enough to buffer.
	DefaultPartSize uint64 = 16 << 20
	// MinPartSize is the smallest Config.PartSize accepted: S3 refuses
	// multipart uploads whose non-final parts are smaller than 5 MiB.
	MinPartSize uint64 = 5 << 20
	// MaxPartSize is the largest Config.PartSize accepted, S3's limit.
	MaxPartSize uint64 = 5 << 30

	// contentType is the Content-Type of stored contexts. The archive is
	// deliberately NOT marked Content-Encoding: gzip, which would invite
	// HTTP clients and proxies to decompress it on the fly and hand Extract
	// a bare tar.
	contentType = "application/gzip"
	// digestMetaKey is the user-metadata key holding the context digest;
	// minio-go sends it as the header x-amz-meta-buildq-digest. The key
	// already encodes the digest, but metadata survives copies and renames
	// and lets an operator audit an object without recomputing it.
	digestMetaKey = "buildq-digest"
	// keyPrefix is where contexts live in the bucket. "sha256/" keeps room
	// for another digest algorithm without a migration.
	keyPrefix = "contexts/sha256/"
)

// ErrNotFound is returned (wrapped, with the bucket, key and the server's
// error) by Open when the object or its bucket does not exist.
var ErrNotFound = errors.New("s3store: object not found")

// ErrContextChanged is returned (wrapped, with both digests) by
// UploadContext when the directory changed between the hashing pass and the
// upload pass, so the bytes being uploaded do not match the key they would
// be stored under. The upload is aborted; calling UploadContext again once
// the directory is stable uploads the new content under its own key.
var ErrContextChanged = errors.New("s3store: build context changed during upload")

// Config configures a Store. Only Endpoint is required.
type Config struct {
	// Endpoint is the server's base URL with scheme, such as
	// http://127.0.0.1:9000 or https://s3.amazonaws.com. The scheme is
	// required because it decides TLS, and guessing it would silently send
	// credentials in clear text or fail the handshake against plain HTTP.
	Endpoint string
	// Region is the signing region (default us-east-1).
	Region string
	// AccessKey and SecretKey are static credentials. Both empty means
	// anonymous requests; exactly one empty is a configuration error.
	AccessKey string
	SecretKey string
	// Bucket is the bucket UploadContext writes to (default "buildq").
	Bucket string
	// PartSize of multipart uploads (default 16 MiB, at least 5 MiB): memory
	// of an upload is bounded by it, whatever the context size, because
	// UploadContext streams and the uploader holds one part at a time.
	PartSize uint64
	// Transport, if set, carries every request (tests count requests
	// through it; deployments may add proxies or custom CAs). Default:
	// minio-go's transport.
	Transport http.RoundTripper
}

// tuning holds knobs that production must not turn but tests need: fewer
// retries so that a refused connection fails fast, and a smaller minimum
// part size so that multipart behaviour shows on small test contexts.
// Zero values mean minio-go's defaults.
type tuning struct {
	maxRetries  int
	minPartSize int64
}

// Store uploads and reads build contexts. It is safe for concurrent use.
type Store struct {
	client   *minio.Client
	core     minio.Core // same client; exposes the eager GetObject Open needs
	bucket   string
	region   string
	partSize uint64
	// unsignedPayload: send UNSIGNED-PAYLOAD instead of streaming
	// signatures (plain-HTTP endpoints).
	unsignedPayload bool
	// tenant, when set, puts uploads under the tenant's own prefix
	// (ForTenant).
	tenant string
}

// ForTenant returns a Store that uploads contexts under tenant's own prefix,
// contexts/<tenant>/sha256/<hex>.tar.gz: an object another tenant planted
// under a digest can never stand in for this tenant's upload, which is
// skipped only when the tenant's own object exists.
func (s *Store) ForTenant(tenant string) *Store {
	c := *s
	c.tenant = tenant
	return &c
}

// New validates cfg and returns a Store. It does not contact the server:
// call EnsureBucket (or any other method) to find out whether the endpoint
// and credentials work.
func New(cfg Config) (*Store, error) {
	return newStore(cfg, tuning{})
}

func newStore(cfg Config, tn tuning) (*Store, error) {
	u, err := url.Parse(cfg.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("s3store: endpoint %q must be a URL starting with http:// or https://", cfg.Endpoint)
	}
	if u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		// minio-go addresses buckets from the host's root; a path prefix
		// would be silently dropped.
		return nil, fmt.Errorf("s3store: endpoint %q must not have user info, a path, a query or a fragment", cfg.Endpoint)
	}
	if (cfg.AccessKey == "") != (cfg.SecretKey == "") {
		// Half a key pair is a broken secret mount, not a wish for
		// anonymous access: minio-go would silently go anonymous.
		return nil, errors.New("s3store: access key and secret key must both be set, or both be empty for anonymous access")
	}
	region := cfg.Region
	if region == "" {
		region = DefaultRegion
	}
	bucket := cfg.Bucket
	if bucket == "" {
		bucket = DefaultBucket
	}
	if err := s3utils.CheckValidBucketNameStrict(bucket); err != nil {
		return nil, fmt.Errorf("s3store: bucket %q: %w", bucket, err)
	}
	partSize := cfg.PartSize
	if partSize == 0 {
		partSize = DefaultPartSize
	}
	minPart := MinPartSize
	if tn.minPartSize > 0 {
		minPart = uint64(tn.minPartSize)
	}
	if partSize < minPart || partSize > MaxPartSize {
		return nil, fmt.Errorf("s3store: part size %d outside [%d, %d]", partSize, minPart, MaxPartSize)
	}

	opts := &minio.Options{
		// NewStaticV4 with two empty keys yields anonymous requests.
		Creds:        credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, ""),
		Secure:       u.Scheme == "https",
		Transport:    cfg.Transport,
		Region:       region,
		BucketLookup: minio.BucketLookupPath,
		MaxRetries:   tn.maxRetries,
	}
	if tn.minPartSize > 0 {
		opts.UploadLimits = &minio.UploadLimits{MinPartSize: tn.minPartSize}
	}
	client, err := minio.New(u.Host, opts)
	if err != nil {
		return nil, fmt.Errorf("s3store: %w", err)
	}
	return &Store{
		client:   client,
		core:     minio.Core{Client: client},
		bucket:   bucket,
		region:   region,
		partSize: partSize,
		// Over plain HTTP minio-go signs each part in aws-chunked
		// streaming form, which some S3 implementations (the dev store
		// among them) store verbatim. An unsigned payload is sent as is;
		// over HTTPS, TLS protects the body anyway.
		unsignedPayload: u.Scheme == "http",
	}, nil
}

// Bucket returns the bucket UploadContext writes to.
func (s *Store) Bucket() string { return s.bucket }

// EnsureBucket creates the store's bucket if it does not exist. It checks
// first, so that the usual case (the bucket exists) needs neither a write
// nor the permission to create buckets.
func (s *Store) EnsureBucket(ctx context.Context) error {
	exists, err := s.client.BucketExists(ctx, s.bucket)
	if err != nil {
		return fmt.Errorf("s3store: check bucket %q: %w", s.bucket, err)
	}
	if exists {
		return nil
	}
	err = s.client.MakeBucket(ctx, s.bucket, minio.MakeBucketOptions{Region: s.region})
	if err == nil {
		return nil
	}
	er, _ := asErrorResponse(err)
	switch er.Code {
	case minio.BucketAlreadyOwnedByYou:
		// Created by a concurrent EnsureBucket: what we wanted.
		return nil
	case minio.BucketAlreadyExists:
		// On AWS this means another account owns the name; some servers
		// (gofakes3) also say it for our own bucket, and it is what a
		// concurrent creation can look like. Whether we can see the bucket
		// now tells which.
		if exists, herr := s.client.BucketExists(ctx, s.bucket); herr == nil && exists {
			return nil
		}
	}
	return fmt.Errorf("s3store: create bucket %q: %w", s.bucket, err)
}

// ContextKey returns the object key of a context: "contexts/sha256/<hex>.tar.gz"
// for digest "sha256:<hex>". It returns "" for anything but a sha256 digest
// of 64 lowercase hex digits (the form contexttar produces), which every
// Store method refuses as an object name: a malformed digest from a message
// must not become a key that happens to exist.
func ContextKey(digest string) string {
	hexDigest, ok := strings.CutPrefix(digest, "sha256:")
	if !ok || len(hexDigest) != 64 {
		return ""
	}
	for _, c := range hexDigest {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return ""
		}
	}
	return keyPrefix + hexDigest + ".tar.gz"
}

// TenantContextKey is ContextKey under a tenant's prefix:
// "contexts/<tenant>/sha256/<hex>.tar.gz"; "" for a malformed digest or a
// tenant that is not a DNS label.
func TenantContextKey(tenant, digest string) string {
	k := ContextKey(digest)
	if k == "" || tenant == "" || len(tenant) > 63 || strings.Trim(tenant, "abcdefghijklmnopqrstuvwxyz0123456789-") != "" ||
		strings.HasPrefix(tenant, "-") || strings.HasSuffix(tenant, "-") {
		return ""
	}
	return "contexts/" + tenant + "/" + strings.TrimPrefix(k, "contexts/")
}

func (s *Store) contextKey(digest string) string {
	if s.tenant != "" {
		return TenantContextKey(s.tenant, digest)
	}
	return ContextKey(digest)
}

// Phases reported to a Progress callback.
const (
	PhaseHashing   = "hashing"
	PhaseUploading = "uploading"
)

// Progress receives UploadContext's progress. phase is PhaseHashing or
// PhaseUploading; done and total count bytes of the uncompressed tar, the
// unit of contexttar.Result.Size, so both phases share a scale.
//
// Within a phase, done never decreases. While hashing, total is -1 (the
// size is what the pass computes). Intermediate values of done are an
// estimate that contexttar's per-entry callback allows (file content read
// plus 512 bytes of header per entry: it lags the exact count by padding,
// PAX records and the end-of-archive blocks), and while uploading they
// count bytes handed to the uploader, which runs up to one part ahead of
// the network. The last call of each phase is exact: done == total ==
// UploadResult.Size, the uploading one made only once the object is stored.
// A skipped upload has no uploading phase.
//
// Calls never overlap, but the uploading ones come from a goroutine of
// UploadContext: the callback must not block for long, since it stalls the
// upload.
type Progress func(phase string, done, total int64)

// UploadResult describes the outcome of UploadContext.
type UploadResult struct {
	// Digest is the context's digest, contexttar.Result.Digest.
	Digest string
	// Bucket and Key locate the stored archive; Key is ContextKey(Digest).
	Bucket string
	Key    string
	// Size is the length of the uncompressed tar (contexttar.Result.Size),
	// known even when the upload was skipped. The stored object is that tar
	// gzipped, usually smaller.
	Size int64
	// Files counts the archive's entries (contexttar.Result.Files).
	Files int
	// Skipped is true when an object already existed under Key, so nothing
	// was uploaded.
	Skipped bool
}

// UploadContext packs dir with contexttar.Write and uploads the archive to
// the store's bucket under ContextKey(digest), unless an object already
// exists there (checked with a HEAD): contexts are content-addressed, so an
// existing object holds the same bytes, and a re-submitted build costs one
// hashing pass and one request.
//
// It streams in two passes, so memory stays bounded by Config.PartSize
// whatever the context size, and no temporary file is written:
//
//  1. contexttar.Digest, only for the digest that names the key (nothing
//     is compressed or uploaded, so an existing context costs no upload);
//  2. if the object is absent, contexttar.Write again into an io.Pipe that
//     feeds a multipart PutObject of unknown size (-1), one part at a time.
//
// The unknown size is what makes the second pass safe: minio-go completes a
// multipart upload only after reading EOF, and the pipe reaches EOF only
// after this pass's digest has been compared with the first. If they differ
// (files changed in between), the pipe fails with ErrContextChanged
// instead, minio-go aborts the multipart upload (deleting the parts already
// sent), and no object ever appears under a key that does not match its
// content. Any other failure, or cancelling ctx, aborts the same way. The
// price is that even a tiny context takes three requests (initiate, one
// part, complete) instead of one PUT.
//
// The object gets Content-Type application/gzip and the user metadata
// x-amz-meta-buildq-digest = digest.
//
// opts is passed to both passes; opts.Progress, if set, is therefore called
// through both (restarting from zero), in addition to progress. progress
// may be nil. A contexttar error on the second pass (for example a file
// that changed size while read) is returned as is.
func (s *Store) UploadContext(ctx context.Context, dir string, opts contexttar.Options, progress Progress) (UploadResult, error) {
	report := func(string, int64, int64) {}
	if progress != nil {
		report = progress
	}

	first, err := contexttar.Digest(ctx, dir, withProgress(opts, func(est int64) {
		report(PhaseHashing, est, -1)
	}))
	if err != nil {
		return UploadResult{}, err
	}
	report(PhaseHashing, first.Size, first.Size)

	res := UploadResult{
		Digest: first.Digest,
		Bucket: s.bucket,
		Key:    s.contextKey(first.Digest),
		Size:   first.Size,
		Files:  first.Files,
	}
	exists, err := s.Exists(ctx, s.bucket, res.Key)
	if err != nil {
		return UploadResult{}, err
	}
	if exists {
		res.Skipped = true
		return res, nil
	}

	if err := s.upload(ctx, dir, opts, first, res.Key, report); err != nil {
		return UploadResult{}, err
	}
	report(PhaseUploading, first.Size, first.Size)
	return res, nil
}

// PutArchive stores an archive contexttar already made (a git source the
// worker packed) under the store's key for digest, unless an object is
// already there, as UploadContext does. size is the archive's length; r
// is read to its end. The digest is the caller's word: a wrong one only
// ever fails the builds that read this object (their fetch verifies it).
func (s *Store) PutArchive(ctx context.Context, digest string, r io.Reader, size int64) (UploadResult, error) {
	key := s.contextKey(digest)
	if key == "" {
		return UploadResult{}, fmt.Errorf("s3store: %q is not a sha256 context digest", digest)
	}
	res := UploadResult{Digest: digest, Bucket: s.bucket, Key: key}
	exists, err := s.Exists(ctx, s.bucket, key)
	if err != nil {
		return UploadResult{}, err
	}
	if exists {
		res.Skipped = true
		return res, nil
	}
	if _, err := s.client.PutObject(ctx, s.bucket, key, r, size, minio.PutObjectOptions{
		ContentType:          contentType,
		UserMetadata:         map[string]string{digestMetaKey: digest},
		PartSize:             s.partSize,
		DisableContentSha256: s.unsignedPayload,
	}); err != nil {
		return UploadResult{}, fmt.Errorf("s3store: upload %s/%s: %w", s.bucket, key, err)
	}
	return res, nil
}

// errUploaderStopped is what the packing goroutine's writes fail with once
// the uploader has stopped reading.
var errUploaderStopped = errors.New("s3store: uploader stopped reading")

// upload runs the second pass: it packs dir again into a pipe read by
// PutObject, and lets the upload complete only if the digest still equals
// first.Digest.
func (s *Store) upload(ctx context.Context, dir string, opts contexttar.Options, first contexttar.Result, key string, report Progress) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	pr, pw := io.Pipe()
	packErr := make(chan error, 1)
	go func() {
		second, err := contexttar.Write(ctx, dir, pw, withProgress(opts, func(est int64) {
			report(PhaseUploading, min(est, first.Size), first.Size)
		}))
		if err == nil && second.Digest != first.Digest {
			err = fmt.Errorf("%w: %s hashed as %s, then packed as %s", ErrContextChanged, dir, first.Digest, second.Digest)
		}
		// nil gives the uploader its EOF, and only now may it complete.
		pw.CloseWithError(err)
		packErr <- err
	}()

	_, putErr := s.client.PutObject(ctx, s.bucket, key, pr, -1, minio.PutObjectOptions{
		ContentType:  contentType,
		UserMetadata: map[string]string{digestMetaKey: first.Digest},
		PartSize:     s.partSize,
		// See Store.unsignedPayload.
		DisableContentSha256: s.unsignedPayload,
	})
	// If PutObject gave up early, the packer is blocked writing to the
	// pipe or still walking: unblock it and stop it.
	pr.CloseWithError(errUploaderStopped)
	cancel()
	err := <-packErr

	switch {
	case putErr == nil && err == nil:
		return nil
	case err != nil && (putErr == nil || errors.Is(putErr, err)):
		// Packing failed first (or the context changed): PutObject read
		// this very error from the pipe and aborted; report the cause.
		// (PutObject cannot have succeeded then, as it completes only on
		// EOF; the putErr == nil case is belt and braces.)
		return err
	default:
		return fmt.Errorf("s3store: upload %s/%s: %w", s.bucket, key, putErr)
	}
}

// withProgress returns opts with a Progress callback that also reports, to
// est, an estimate of the tar bytes written so far (see Progress), while
// still calling the caller's own opts.Progress.
func withProgress(opts contexttar.Options, est func(int64)) contexttar.Options {
	callers := opts.Progress
	opts.Progress = func(bytesRead int64, files int) {
		if callers != nil {
			callers(bytesRead, files)
		}
		// Every entry has at least a 512-byte header and its content, so
		// this never exceeds the exact count.
		est(bytesRead + 512*int64(files))
	}
	return opts
}

// Exists reports whether bucket/key exists, with a HEAD request. A missing
// key or bucket (NoSuchKey, NoSuchBucket, or any 404) is (false, nil); any
// other failure, including access denied, is an error, since "absent"
// would send UploadContext into an upload it cannot make either.
func (s *Store) Exists(ctx context.Context, bucket, key string) (bool, error) {
	_, err := s.client.StatObject(ctx, bucket, key, minio.StatObjectOptions{})
	switch {
	case err == nil:
		return true, nil
	case isNotFound(err):
		return false, nil
	default:
		return false, fmt.Errorf("s3store: stat %s/%s: %w", bucket, key, err)
	}
}

// Version returns the version of bucket/key's bytes as the server tells it
// with a HEAD (its ETag, and its version id in a versioned bucket): equal
// versions hold equal bytes, so what was computed from them can be reused
// without reading them again. A missing object is an error matching
// ErrNotFound.
func (s *Store) Version(ctx context.Context, bucket, key string) (string, error) {
	info, err := s.client.StatObject(ctx, bucket, key, minio.StatObjectOptions{})
	switch {
	case err == nil:
		return info.ETag + "/" + info.VersionID + "/" + strconv.FormatInt(info.Size, 10), nil
	case isNotFound(err):
		return "", fmt.Errorf("%w: %s/%s: %w", ErrNotFound, bucket, key, err)
	default:
		return "", fmt.Errorf("s3store: stat %s/%s: %w", bucket, key, err)
	}
}

// Open returns the body of bucket/key for streaming; the caller must close
// it. The GET is made before Open returns, so a missing object (or bucket)
// is reported here, as an error matching ErrNotFound, and not at the first
// Read. One GET, rather than a HEAD then a GET, also leaves no window for
// the object to vanish in between.
func (s *Store) Open(ctx context.Context, bucket, key string) (io.ReadCloser, error) {
	body, _, _, err := s.core.GetObject(ctx, bucket, key, minio.GetObjectOptions{})
	switch {
	case err == nil:
		return body, nil
	case isNotFound(err):
		return nil, fmt.Errorf("%w: %s/%s: %w", ErrNotFound, bucket, key, err)
	default:
		return nil, fmt.Errorf("s3store: get %s/%s: %w", bucket, key, err)
	}
}

// isNotFound reports whether err is the server saying the object or its
// bucket does not exist. A HEAD has no body, so minio-go calls any 404 on
// an object NoSuchKey; a GET's body may say NoSuchBucket.
func isNotFound(err error) bool {
	er, ok := asErrorResponse(err)
	if !ok {
		return false
	}
	return er.Code == minio.NoSuchKey || er.Code == minio.NoSuchBucket || er.StatusCode == http.StatusNotFound
}

// PresignGet returns a URL that reads exactly bucket/key, without
// credentials, for ttl: what a build Pod's init container downloads its
// context with, so that no S3 key enters the Pod. Signing is local; the
// server is not contacted. The URL names the Store's endpoint: build a
// Store with the endpoint the Pods reach.
func (s *Store) PresignGet(ctx context.Context, bucket, key string, ttl time.Duration) (string, error) {
	if ttl < time.Second || ttl > 7*24*time.Hour {
		return "", fmt.Errorf("s3store: presigned URL lifetime %s outside [1s, 7d]", ttl)
	}
	u, err := s.client.PresignedGetObject(ctx, bucket, key, ttl, nil)
	if err != nil {
		return "", fmt.Errorf("s3store: presign %s/%s: %w", bucket, key, err)
	}
	return u.String(), nil
}

// LogsPrefix is where build logs are archived (v1.ArchiveObject).
const LogsPrefix = "logs/"

// PutLog stores a build log archive (gzip) as object in the store's
// bucket, in one PutObject, and returns the bucket.
func (s *Store) PutLog(ctx context.Context, object string, data []byte) (string, error) {
	if !strings.HasPrefix(object, LogsPrefix) {
		return "", fmt.Errorf("s3store: log object %q is not under %s", object, LogsPrefix)
	}
	if _, err := s.client.PutObject(ctx, s.bucket, object, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{
		ContentType:          "application/gzip",
		DisableContentSha256: s.unsignedPayload,
	}); err != nil {
		return "", fmt.Errorf("s3store: upload %s/%s: %w", s.bucket, object, err)
	}
	return s.bucket, nil
}

// ExpireLogs deletes the archived logs last written before cutoff and
// returns how many it deleted.
func (s *Store) ExpireLogs(ctx context.Context, cutoff time.Time) (int, error) {
	n := 0
	for obj := range s.client.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: LogsPrefix, Recursive: true}) {
		if obj.Err != nil {
			return n, fmt.Errorf("s3store: list %s/%s: %w", s.bucket, LogsPrefix, obj.Err)
		}
		if !obj.LastModified.Before(cutoff) {
			continue
		}
		if err := s.client.RemoveObject(ctx, s.bucket, obj.Key, minio.RemoveObjectOptions{}); err != nil && !isNotFound(err) {
			return n, fmt.Errorf("s3store: delete %s/%s: %w", s.bucket, obj.Key, err)
		}
		n++
	}
	return n, nil
}
