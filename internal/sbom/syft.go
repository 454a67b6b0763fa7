// Package sbom makes the SBOM of a built image with syft
// (github.com/anchore/syft), run as its own, pinned binary: the worker's
// binary carries no scanner.
//
// syft never reaches a network. The worker reads the image from the
// registry itself, with the tenant's credentials, and writes it to an OCI
// image layout in a directory of its own; syft is then run with that
// directory as its only source (--from oci-dir), with a configuration
// that turns off every lookup syft could make over the network (update
// checks, remote licence and package lookups), and with an environment
// that holds no credentials and no proxy.
package sbom

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/buildq/buildq/internal/attest"
)

// DefaultTimeout bounds one scan when Syft.Timeout is zero;
// DefaultMaxBytes bounds the image written to disk for it when
// Syft.MaxBytes is zero.
const (
	DefaultTimeout  = 10 * time.Minute
	DefaultMaxBytes = 4 << 30
)

// Syft scans images with the syft binary at Path.
type Syft struct {
	// Path is the syft binary.
	Path string
	// Timeout bounds one scan (DefaultTimeout when zero).
	Timeout time.Duration
	// TempDir is where images are unpacked for a scan (os.TempDir when
	// empty).
	TempDir string
	// MaxBytes bounds the image (its compressed layers and config) the
	// worker writes to TempDir for a scan (DefaultMaxBytes when zero): a
	// larger image is not scanned.
	MaxBytes int64
	// MaxDocumentBytes bounds the SBOM syft writes that is read back
	// (attest.MaxSBOMBytes when zero: nothing larger can be attached).
	MaxDocumentBytes int64

	// once makes slots; slots bounds the scans run at once (one: each
	// scan copies an image to disk and syft unpacks it there).
	once  sync.Once
	slots chan struct{}
}

// config is syft's configuration for a scan: nothing syft does reaches a
// network. Written to a file and named with --config, so no
// configuration file of the worker's user or directory is read.
const config = `check-for-app-update: false
golang:
  search-local-mod-cache-licenses: false
  search-local-vendor-licenses: false
  search-remote-licenses: false
  main-module-version:
    from-ld-flags: true
java:
  use-network: false
  use-maven-local-repository: false
javascript:
  search-remote-licenses: false
python:
  search-remote-licenses: false
linux-kernel:
  catalog-modules: false
`

// ScanError is a scan syft could not make: its exit, and the last lines
// it wrote.
type ScanError struct {
	Err    error
	Output string
}

func (e *ScanError) Error() string {
	if e.Output == "" {
		return "syft: " + e.Err.Error()
	}
	return "syft: " + e.Err.Error() + ": " + e.Output
}

func (e *ScanError) Unwrap() error { return e.Err }

// Scan returns the SPDX JSON SBOM of img, naming it name (the image's
// repository) at version (its digest).
func (s *Syft) Scan(ctx context.Context, img v1.Image, name, version string) ([]byte, error) {
	if s.Path == "" {
		return nil, errors.New("sbom: no syft binary configured")
	}
	limit := s.MaxBytes
	if limit <= 0 {
		limit = DefaultMaxBytes
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, fmt.Errorf("sbom: read the image's manifest: %w", err)
	}
	size := m.Config.Size
	for _, l := range append([]v1.Descriptor{m.Config}, m.Layers...) {
		if l.Size <= 0 {
			// An unknown (or zero) size would count for nothing, and
			// the blob would be copied whole, however large.
			return nil, &ScanError{Err: fmt.Errorf("the image's manifest gives blob %s no size; nothing is copied to scan it", l.Digest)}
		}
	}
	for _, l := range m.Layers {
		size += l.Size
	}
	if size > limit {
		return nil, &ScanError{Err: fmt.Errorf("the image is %d bytes, more than the %d this worker scans (--sbom-max-bytes)", size, limit)}
	}
	timeout := s.ScanTimeout()
	// One scan at a time; waiting for the slot counts against the
	// caller's context, not the scan's timeout.
	s.once.Do(func() { s.slots = make(chan struct{}, 1) })
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	s.sweep(timeout)
	dir, err := os.MkdirTemp(s.TempDir, scanDirPrefix)
	if err != nil {
		return nil, fmt.Errorf("sbom: %w", err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	oci := filepath.Join(dir, "image")
	p, err := layout.Write(oci, empty.Index)
	if err != nil {
		return nil, fmt.Errorf("sbom: write the image layout: %w", err)
	}
	if err := p.AppendImage(img); err != nil {
		return nil, fmt.Errorf("sbom: read the image into the layout: %w", err)
	}
	cfg := filepath.Join(dir, "syft.yaml")
	if err := os.WriteFile(cfg, []byte(config), 0o600); err != nil {
		return nil, fmt.Errorf("sbom: %w", err)
	}
	out := filepath.Join(dir, "sbom.spdx.json")
	home := filepath.Join(dir, "home")
	if err := os.Mkdir(home, 0o700); err != nil {
		return nil, fmt.Errorf("sbom: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.Path, "scan", oci,
		"--from", "oci-dir",
		"--config", cfg,
		"--output", "spdx-json="+out,
		"--source-name", name,
		"--source-version", version,
		"--quiet")
	// Nothing of the worker's environment: no credentials, no proxy, no
	// configuration of syft's own.
	cmd.Env = []string{
		"HOME=" + home,
		"TMPDIR=" + dir,
		"XDG_CACHE_HOME=" + filepath.Join(home, ".cache"),
		"XDG_CONFIG_HOME=" + filepath.Join(home, ".config"),
		"SYFT_CHECK_FOR_APP_UPDATE=false",
	}
	cmd.Dir = dir
	tail := &tailBuffer{max: 16 << 10}
	cmd.Stdout, cmd.Stderr = tail, tail
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("gave up after %s: %w", timeout, ctx.Err())
		}
		return nil, &ScanError{Err: err, Output: lastLines(tail.String(), 5)}
	}
	maxDoc := s.MaxDocumentBytes
	if maxDoc <= 0 {
		maxDoc = attest.MaxSBOMBytes
	}
	fi, err := os.Stat(out)
	if err != nil {
		return nil, &ScanError{Err: fmt.Errorf("no SBOM written: %w", err), Output: lastLines(tail.String(), 5)}
	}
	if fi.Size() > maxDoc {
		return nil, &ScanError{Err: fmt.Errorf("the SBOM is %d bytes, more than the %d an attachment holds", fi.Size(), maxDoc)}
	}
	f, err := os.Open(out)
	if err != nil {
		return nil, &ScanError{Err: fmt.Errorf("no SBOM written: %w", err)}
	}
	defer f.Close()
	doc, err := io.ReadAll(io.LimitReader(f, maxDoc+1))
	if err != nil {
		return nil, fmt.Errorf("sbom: read the SBOM: %w", err)
	}
	if int64(len(doc)) > maxDoc {
		return nil, &ScanError{Err: fmt.Errorf("the SBOM is more than the %d bytes an attachment holds", maxDoc)}
	}
	return doc, nil
}

// ScanTimeout is the bound on one scan (Timeout, or DefaultTimeout).
func (s *Syft) ScanTimeout() time.Duration {
	if s.Timeout > 0 {
		return s.Timeout
	}
	return DefaultTimeout
}

// scanDirPrefix names the directories scans work in, under TempDir.
const scanDirPrefix = "buildq-sbom-"

// sweep removes the scan directories in TempDir older than twice the
// scan timeout: left by a worker killed during a scan (its deferred
// removal never ran). No scan runs that long.
func (s *Syft) sweep(timeout time.Duration) {
	root := s.TempDir
	if root == "" {
		root = os.TempDir()
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), scanDirPrefix) {
			continue
		}
		fi, err := e.Info()
		if err != nil || time.Since(fi.ModTime()) < 2*timeout {
			continue
		}
		_ = os.RemoveAll(filepath.Join(root, e.Name()))
	}
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

// lastLines is the last n lines of s, without a trailing newline.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.TrimSpace(strings.Join(lines, "\n"))
}
