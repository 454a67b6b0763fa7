//go:build e2e

package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/testcontainers/testcontainers-go"
)

// defaultExecutorImage is the kaniko executor the Jobs run unless
// BUILDQ_E2E_EXECUTOR_IMAGE names another (a maintained fork, a mirror).
// Upstream kaniko is archived; v1.23.2 is its last release. The tag is
// resolved to a digest at test start, since workers only take pinned
// images.
const defaultExecutorImage = "gcr.io/kaniko-project/executor:v1.23.2"

// requireDocker skips the test, in one line, when testcontainers cannot
// reach a Docker engine.
func requireDocker(t *testing.T) {
	t.Helper()
	if reason := dockerUnavailable(); reason != "" {
		t.Skipf("e2e: no Docker engine reachable (testcontainers: %s); run make e2e on a Docker host", reason)
	}
}

// dockerUnavailable asks testcontainers' own Docker provider for the
// engine's info; it returns why that failed, or "" when Docker answers.
// testcontainers panics when it finds no Docker host at all, hence the
// recover.
func dockerUnavailable() (reason string) {
	defer func() {
		if r := recover(); r != nil {
			reason = oneLine("no Docker host found: " + fmt.Sprint(r))
		}
	}()
	p, err := testcontainers.NewDockerProvider()
	if err != nil {
		return oneLine(err.Error())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := p.Health(ctx); err != nil { // Health closes the provider
		return oneLine(err.Error())
	}
	return ""
}

// executorImage returns the kaniko executor image as repo@sha256:…: the
// reference in BUILDQ_E2E_EXECUTOR_IMAGE (default defaultExecutorImage),
// resolved with a HEAD request unless it already carries a digest. It
// skips the test, in one line, when the image cannot be resolved.
func executorImage(t *testing.T) string {
	t.Helper()
	ref := strings.TrimSpace(os.Getenv("BUILDQ_E2E_EXECUTOR_IMAGE"))
	if ref == "" {
		ref = defaultExecutorImage
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatalf("e2e: BUILDQ_E2E_EXECUTOR_IMAGE %q is not an image reference: %v", ref, err)
	}
	if d, ok := r.(name.Digest); ok {
		return r.Context().Digest(d.DigestStr()).String()
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	desc, err := remote.Head(r, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain))
	if err != nil {
		t.Skipf("e2e: cannot resolve the kaniko executor image %s to a digest (%s); set BUILDQ_E2E_EXECUTOR_IMAGE to a reachable image or repo@sha256:…", ref, oneLine(err.Error()))
	}
	return r.Context().Digest(desc.Digest.String()).String()
}

// envOr returns the environment variable key, or def when it is unset.
func envOr(key, def string) string {
	if v := strings.TrimSpace(os.Getenv(key)); v != "" {
		return v
	}
	return def
}

// oneLine squeezes an error message onto one short line, for skip messages.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 240 {
		s = s[:240] + "…"
	}
	return s
}

// randomHex returns n random bytes, hex-encoded.
func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// aliasTransport is an HTTP transport for the host side that reaches
// Docker-network addresses (alias:port, as the cluster sees them) through
// their published host ports. Only the dial is redirected: the URL and the
// Host header keep the alias, so registry clients send their credentials
// and compute references exactly as they would inside the cluster.
func aliasTransport(routes map[string]string) http.RoundTripper {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil // the aliases exist only here; no proxy knows them
	var d net.Dialer
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if to, ok := routes[addr]; ok {
			addr = to
		}
		return d.DialContext(ctx, network, addr)
	}
	return tr
}

// writeFile writes data to a new file in a temporary directory of t and
// returns its path.
func writeFile(t *testing.T, name string, data []byte) string {
	t.Helper()
	p := t.TempDir() + string(os.PathSeparator) + name
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
