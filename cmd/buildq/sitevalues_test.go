package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

func TestSiteValuesExamplesAreRefusedByName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  []string
		want []string // keys the error names; none: accepted
	}{
		{env: []string{"BUILDQ_REGISTRY=registry.example"}, want: []string{"BUILDQ_REGISTRY"}},
		{env: []string{"BUILDQ_EXECUTOR_IMAGE=registry.example/kaniko/executor@sha256:" + strings.Repeat("ab", 32)}, want: []string{"BUILDQ_EXECUTOR_IMAGE"}},
		{env: []string{"BUILDQ_S3_ENDPOINT=https://s3.example:9000"}, want: []string{"BUILDQ_S3_ENDPOINT"}},
		{env: []string{"NATS_URL=nats://user@nats.example:4222,nats://nats.nats:4222"}, want: []string{"NATS_URL"}},
		{env: []string{"SITE_API_SERVER_CIDR=192.0.2.1/32", "SITE_BASE_IMAGE_CIDR=198.51.100.0/24"}, want: []string{"SITE_API_SERVER_CIDR", "SITE_BASE_IMAGE_CIDR"}},
		{env: []string{"SITE_X=2001:db8::1"}, want: []string{"SITE_X"}},
		{env: []string{"SITE_X=[2001:db8::1]:443"}, want: []string{"SITE_X"}},
		// Real values, and variables that are not site values.
		{env: []string{
			"NATS_URL=nats://nats.nats:4222", "BUILDQ_REGISTRY=registry.acme.com:5000",
			"BUILDQ_EXECUTOR_IMAGE=ghcr.io/example/kaniko@sha256:" + strings.Repeat("ab", 32),
			"SITE_API_SERVER_CIDR=10.0.0.1/32", "SITE_BASE_IMAGE_CIDR=0.0.0.0/0", "SITE_BASE_IMAGE_PORT=443",
			"BUILDQ_S3_ENDPOINT=http://minio.minio:9000", "BUILDQ_TENANT_REGISTRY_SECRET=buildq-registry-{tenant}",
			"HOSTNAME=registry.example", "OTHER=192.0.2.1",
		}},
	} {
		err := checkSiteValues(tc.env)
		if len(tc.want) == 0 {
			if err != nil {
				t.Errorf("%v: %v, want accepted", tc.env, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%v: accepted, want refused naming %v", tc.env, tc.want)
			continue
		}
		for _, k := range tc.want {
			if !strings.Contains(err.Error(), k+"=") || !strings.Contains(err.Error(), "site.env") {
				t.Errorf("%v: %v, want it to name %s and site.env", tc.env, err, k)
			}
		}
	}
}

// readSiteEnv reads a site.env file: KEY=VALUE lines, # comments.
func readSiteEnv(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			t.Fatalf("%s: %q is no KEY=VALUE line", path, l)
		}
		out[k] = v
	}
	return out
}

// Every overlay's site.env holds only variables the worker reads (it gets
// the file as its environment) or SITE_* values for kustomize, and its
// shipped examples are exactly what the worker refuses: the overlay renders
// and applies as shipped, and a worker started with it names what to set.
func TestDeploySiteValuesAreFlagsAndRefusedAsShipped(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../../deploy/overlays/*/site.env")
	if err != nil || len(files) < 2 {
		t.Fatalf("site.env of the overlays: %v %v", files, err)
	}
	known := workerEnvNames(t)
	for _, f := range files {
		vals := readSiteEnv(t, f)
		var env []string
		for k, v := range vals {
			if !strings.HasPrefix(k, "SITE_") && !known[k] {
				t.Errorf("%s: %s is neither a worker variable nor SITE_*", f, k)
			}
			env = append(env, k+"="+v)
		}
		err := checkSiteValues(env)
		if err == nil {
			t.Errorf("%s: the worker accepts the shipped examples", f)
			continue
		}
		for _, k := range []string{"SITE_WORKER_IMAGE", "SITE_NATS_IMAGE", "BUILDQ_EXECUTOR_IMAGE"} {
			if !strings.Contains(err.Error(), k+"=") {
				t.Errorf("%s: the worker does not refuse the example %s: %v", f, k, err)
			}
		}
	}
}

// /healthz answers while /readyz still says what the worker waits for.
func TestHealthServedBeforeReady(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	stop, err := serveMetrics(addr, prometheus.NewRegistry(), func() error {
		return errString("not taking requests: waiting for the Job and Pod caches")
	}, false, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz %d while waiting, want 200", code)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "Job and Pod caches") {
		t.Errorf("/readyz %d %q while waiting, want 503 naming what it waits for", code, body)
	}
}

type errString string

func (e errString) Error() string { return string(e) }

// A worker serves /healthz from its start: while its Job and Pod informers
// wait for an API server that does not answer, liveness is 200 and
// readiness 503 naming the wait (a liveness probe must not restart a
// worker that is only waiting; issue 28).
func TestWorkerHealthBeforeInformersSync(t *testing.T) {
	t.Parallel()
	hang := make(chan struct{})
	api := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	defer api.Close()
	defer close(hang)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+api.URL+`"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	args := with(sharedRuleArgs(t).worker, "--metrics-addr", addr)
	for i, a := range args {
		if a == "--kubeconfig" {
			args[i+1] = kubeconfig
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, io.Discard, io.Discard) }()
	defer func() { cancel(); <-done }()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, _ := get("/healthz")
		if code == http.StatusOK {
			break
		}
		select {
		case c := <-done:
			t.Fatalf("the worker exited (%d) before serving /healthz", c)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("no /healthz while the informers wait")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "Job and Pod caches") {
		t.Errorf("/readyz %d %q while the informers wait, want 503 naming the caches", code, body)
	}
}
