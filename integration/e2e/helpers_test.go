//go:build e2e

package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/testcontainers/testcontainers-go"
)

// requireDocker skips the test, in one line, when testcontainers cannot
// reach a Docker engine.
// With BUILDQ_E2E_REQUIRE=1 (make e2e, which started the engine) it fails
// instead: an engine that make e2e started and the suite cannot reach is
// an error, not a reason to skip.
func requireDocker(t *testing.T) {
	t.Helper()
	if reason := dockerUnavailable(); reason != "" {
		fail(t, "e2e: no Docker engine reachable (testcontainers: %s); run make e2e, which starts one (hack/docker/start.sh)", reason)
	}
}

// fail fails the test under make e2e (BUILDQ_E2E_REQUIRE=1) and skips it
// otherwise (a plain go test -tags e2e on a machine without the stack).
func fail(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("BUILDQ_E2E_REQUIRE") == "1" {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
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
