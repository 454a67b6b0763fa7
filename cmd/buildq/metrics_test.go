package main

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// With --pprof the metrics server serves Go's profiles, but never the
// command line: it would show flags such as --s3-secret-key.
func TestMetricsServerPprof(t *testing.T) {
	t.Parallel()
	get := func(addr, path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, withPprof := range []bool{true, false} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		stop, err := serveMetrics(addr, prometheus.NewRegistry(), func() error { return nil }, withPprof, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		code, body := get(addr, "/debug/pprof/goroutine?debug=1")
		switch {
		case withPprof && (code != http.StatusOK || !strings.Contains(body, "goroutine")):
			t.Errorf("--pprof: goroutine profile: %d %.100s", code, body)
		case !withPprof && code != http.StatusNotFound:
			t.Errorf("without --pprof: goroutine profile answered %d", code)
		}
		if code, body := get(addr, "/debug/pprof/cmdline"); code == http.StatusOK {
			t.Errorf("pprof=%v: /debug/pprof/cmdline answered 200: %.100s", withPprof, body)
		}
		if code, _ := get(addr, "/healthz"); code != http.StatusOK {
			t.Errorf("pprof=%v: /healthz %d", withPprof, code)
		}
		stop()
	}
}
