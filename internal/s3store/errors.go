package s3store

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"syscall"

	"github.com/minio/minio-go/v7"
)

// transientCodes are S3 error codes that describe the server's state, not
// the request: the same request may succeed later. Codes absent from this
// list (NoSuchKey, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch,
// ExpiredToken, ...) need a different request or different credentials.
var transientCodes = map[string]bool{
	"InternalError":              true,
	"ServiceUnavailable":         true,
	"SlowDown":                   true,
	"SlowDownRead":               true,
	"SlowDownWrite":              true,
	"Throttling":                 true,
	"ThrottlingException":        true,
	"RequestLimitExceeded":       true,
	"RequestThrottled":           true,
	"RequestTimeout":             true,
	"OperationAborted":           true, // a conflicting operation is in progress
	"XMinioServerNotInitialized": true, // MinIO still starting
}

// IsTransient reports whether err is a failure worth retrying unchanged:
// a network error (refused or reset connection, DNS failure, timeout,
// connection closed mid-response) or a server-side condition (any 5xx such
// as 503 SlowDown, 408, 429, and the throttling codes in transientCodes).
// Errors the server returns about the request itself (NoSuchKey,
// AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, any other 4xx)
// are not, nor are TLS certificate errors, a cancelled context,
// ErrNotFound, ErrContextChanged (retry only once the directory is stable)
// or contexttar errors.
//
// minio-go already retries transient failures internally (up to 10
// attempts with backoff), so a transient error here means they persisted:
// the caller should retry later (requeue), not in a tight loop. A deadline
// counts as transient because the server or network was too slow; a caller
// retrying under its own expired context will see that context's error.
//
// The S3 error is found with errors.As, since minio.ToErrorResponse only
// recognises an unwrapped minio.ErrorResponse and this package's errors
// wrap it with the bucket and key.
func IsTransient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if er, ok := asErrorResponse(err); ok {
		switch {
		case transientCodes[er.Code]:
			return true
		case er.StatusCode >= 500,
			er.StatusCode == http.StatusRequestTimeout,
			er.StatusCode == http.StatusTooManyRequests,
			er.StatusCode == 499: // nginx: client closed request
			return true
		default:
			return false
		}
	}
	if isTLSConfigError(err) {
		// Wrong CA or host name: a configuration problem that retries
		// cannot fix, though it surfaces as a network error.
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNABORTED) ||
		errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ETIMEDOUT) {
		return true
	}
	var opErr *net.OpError
	var dnsErr *net.DNSError
	if errors.As(err, &opErr) || errors.As(err, &dnsErr) {
		return true
	}
	var urlErr *url.Error
	if errors.As(err, &urlErr) && (errors.Is(urlErr.Err, io.EOF) || urlErr.Timeout()) {
		// The server closed the connection before answering.
		return true
	}
	// Deliberately not "any net.Error": every *url.Error is one, including
	// those wrapping malformed requests or protocol mismatches.
	var netErr net.Error
	return errors.As(err, &netErr) && netErr.Timeout()
}

// isTLSConfigError reports whether err is a certificate or TLS protocol
// error, which a retry cannot fix.
func isTLSConfigError(err error) bool {
	var (
		unknownAuthority x509.UnknownAuthorityError
		invalidCert      x509.CertificateInvalidError
		hostname         x509.HostnameError
		verification     *tls.CertificateVerificationError
		recordHeader     tls.RecordHeaderError
	)
	return errors.As(err, &unknownAuthority) || errors.As(err, &invalidCert) ||
		errors.As(err, &hostname) || errors.As(err, &verification) ||
		errors.As(err, &recordHeader)
}

// asErrorResponse returns the S3 error response in err's chain, if any.
// minio.ToErrorResponse does the same for an unwrapped error only.
func asErrorResponse(err error) (minio.ErrorResponse, bool) {
	if er := minio.ToErrorResponse(err); er.Code != "" || er.StatusCode != 0 {
		return er, true
	}
	var er minio.ErrorResponse
	if errors.As(err, &er) && (er.Code != "" || er.StatusCode != 0) {
		return er, true
	}
	var erp *minio.ErrorResponse
	if errors.As(err, &erp) && erp != nil {
		return *erp, true
	}
	return minio.ErrorResponse{}, false
}
