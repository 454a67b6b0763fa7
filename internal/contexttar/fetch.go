package contexttar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// ErrFetchRefused matches the error of Fetch when the server refuses the
// URL for good (404: no such object; 403: an expired or wrong signature).
var ErrFetchRefused = errors.New("contexttar: the context URL was refused")

// Fetch downloads the context archive at rawURL (a presigned GET URL, so no
// credentials are involved), extracts it into dir and checks that its bytes
// are the ones digest names ("sha256:<hex>", as Write reports it). On a
// mismatch it empties dir and fails with ErrDigestMismatch: nothing that
// does not match the request is ever left to build. Network errors and 5xx
// answers are retried a few times; 403 and 404 are ErrFetchRefused.
// Errors never contain the URL's query (its signature).
func Fetch(ctx context.Context, client *http.Client, rawURL, digest, dir string, maxBytes int64) error {
	if digest == "" {
		return errors.New("contexttar: fetch needs the context's digest")
	}
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return errors.New("contexttar: the context URL must be an http(s) URL")
	}
	shown := u.Scheme + "://" + u.Host + u.Path
	if client == nil {
		client = http.DefaultClient
	}
	var last error
	for attempt := range 4 {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return errors.Join(ctx.Err(), clearDir(dir))
			case <-time.After(time.Duration(attempt) * time.Second):
			}
			if err := clearDir(dir); err != nil {
				return err
			}
		}
		err := fetchOnce(ctx, client, rawURL, shown, digest, dir, maxBytes)
		var again retryable
		if !errors.As(err, &again) || ctx.Err() != nil {
			if err != nil {
				if cerr := clearDir(dir); cerr != nil {
					return errors.Join(err, cerr)
				}
			}
			return err
		}
		last = again.error
	}
	if err := clearDir(dir); err != nil {
		return errors.Join(last, err)
	}
	return last
}

// retryable marks an error another attempt may cure.
type retryable struct{ error }

func (r retryable) Unwrap() error { return r.error }

func fetchOnce(ctx context.Context, client *http.Client, rawURL, shown, digest, dir string, maxBytes int64) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	if err != nil {
		return fmt.Errorf("contexttar: GET %s: %w", shown, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return retryable{fmt.Errorf("contexttar: GET %s: %w", shown, err)}
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound, http.StatusForbidden:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return fmt.Errorf("%w: GET %s answered %s (no such object, or the URL expired)", ErrFetchRefused, shown, resp.Status)
	default:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return retryable{fmt.Errorf("contexttar: GET %s answered %s", shown, resp.Status)}
	}
	if err := ExtractVerified(ctx, resp.Body, dir, maxBytes, digest); err != nil {
		// A download cut short is worth another try; a malformed,
		// oversized or mismatching archive is not.
		var ne net.Error
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.As(err, &ne) {
			return retryable{err}
		}
		return err
	}
	return nil
}

// ClearDir removes dir's contents, not dir (an emptyDir mount point).
func ClearDir(dir string) error { return clearDir(dir) }

// clearDir removes dir's contents, not dir (an emptyDir mount point).
func clearDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("contexttar: %w", err)
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return fmt.Errorf("contexttar: %w", err)
		}
	}
	return nil
}
