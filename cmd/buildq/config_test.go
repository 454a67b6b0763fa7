package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/pflag"

	"github.com/buildq/buildq/internal/attest"
)

// The commands under test, each with flags that pass every rule
// (sharedRuleArgs); a rule's own flags are appended, and a later flag
// overrides an earlier one.
type ruleCommands struct {
	worker, dev, render []string
	// devData is dev's --data: it stays empty unless the stack starts.
	devData string
}

const (
	testExecutor = "gcr.io/kaniko-project/executor@sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	testFetch    = "ghcr.io/buildq/buildq@sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

// sharedRuleArgs gives a multi-tenant worker with per-tenant registry
// Secrets, dev launching Jobs with per-tenant Secrets, and render for the
// same Job flags. The worker's and dev's cluster does not exist: a
// configuration that passes every rule fails there, with exit 1, before
// anything starts (see TestSharedRuleArgsPassEveryRule).
func sharedRuleArgs(t *testing.T) ruleCommands {
	t.Helper()
	noCluster := filepath.Join(t.TempDir(), "no-kubeconfig")
	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\n"})
	c := ruleCommands{devData: t.TempDir()}
	c.worker = []string{"worker", "--kubeconfig", noCluster, "--nats-url", "nats://127.0.0.1:1", "--log-level", "error",
		"--executor-image", testExecutor, "--fetch-image", testFetch,
		"--s3-endpoint", "http://127.0.0.1:1", "--s3-access-key", "ak", "--s3-secret-key", "sk",
		"--tenant-registry-secret", "buildq-registry-{tenant}", "--tenant-registry-configs", t.TempDir(),
		"--registry", "registry.example.com"}
	c.dev = []string{"dev", "--kubeconfig", noCluster, "--data", c.devData, "--log-level", "error",
		"--nats-addr", "127.0.0.1:0", "--s3-addr", "127.0.0.1:0", "--registry-addr", "127.0.0.1:0",
		"--executor-image", testExecutor,
		"--tenant-registry-secret", "buildq-registry-{tenant}",
		"--registry", "registry.example.com"}
	c.render = []string{"render", dir, "--tenant", "acme", "--name", "web",
		"--executor-image", testExecutor, "--fetch-image", testFetch, "--s3-endpoint", "http://127.0.0.1:1",
		"--tenant-registry-secret", "buildq-registry-{tenant}",
		"--registry", "registry.example.com"}
	return c
}

func with(base []string, extra ...string) []string {
	return append(append([]string{}, base...), extra...)
}

// assertNothingStarted fails when dev's --data holds anything: a refused
// configuration must stop dev before its stack starts.
func assertNothingStarted(t *testing.T, data string) {
	t.Helper()
	entries, err := os.ReadDir(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) > 0 {
		t.Errorf("dev started its stack before refusing: --data holds %v", entries)
	}
}

// The control for every refusal below: the base flags pass every rule, so
// a refusal is the rule's own. The worker and dev stop at the missing
// cluster (exit 1), render prints the Job.
func TestSharedRuleArgsPassEveryRule(t *testing.T) {
	t.Parallel()
	c := sharedRuleArgs(t)
	for name, args := range map[string][]string{"worker": c.worker, "dev": c.dev} {
		code, _, stderr := cli(t, args...)
		if code != exitFailed || !strings.Contains(stderr, "kubernetes config") {
			t.Errorf("%s: exit %d, %q; want exit 1 at the missing cluster", name, code, stderr)
		}
	}
	assertNothingStarted(t, c.devData)
	if code, stdout, stderr := cli(t, c.render...); code != exitOK || !strings.Contains(stdout, "kind: Job") {
		t.Errorf("render: exit %d, %q %q; want the Job", code, stdout, stderr)
	}
}

// Issue 25: the cross-flag rules live in one validated configuration
// that worker, dev and render share. `buildq dev --kubeconfig` skipped
// them: with per-tenant registry Secrets it accepted a --cache-repo
// without {tenant}, which `buildq worker` refuses. Each command refuses
// each combination with exit 2 and the same message.
func TestWorkerDevAndRenderShareCrossFlagRules(t *testing.T) {
	t.Parallel()
	rules := map[string]struct {
		args   []string
		want   string
		render bool // a rule on the Job-shaping flags, render's too
	}{
		"shared cache repository with per-tenant Secrets": {[]string{"--cache-repo", "registry.example.com/cache"},
			`--cache-repo "registry.example.com/cache" must contain {tenant} with --tenant-registry-secret`, true},
		"per-tenant Secret without {tenant}": {[]string{"--tenant-registry-secret", "buildq-registry"},
			`--tenant-registry-secret "buildq-registry" must contain {tenant}`, true},
		"executor image by tag": {[]string{"--executor-image", "gcr.io/kaniko-project/executor:latest"},
			`--executor-image "gcr.io/kaniko-project/executor:latest" is not pinned by digest`, true},
		"fetch image by tag": {[]string{"--fetch-image", "ghcr.io/buildq/buildq:latest"},
			`--fetch-image "ghcr.io/buildq/buildq:latest" is not pinned by digest`, true},
		"missing job template": {[]string{"--job-template", "/nonexistent/job-template.yaml"},
			"--job-template: open /nonexistent/job-template.yaml", true},
		"S3 endpoint without scheme": {[]string{"--s3-endpoint", "minio:9000"},
			`S3 endpoint "minio:9000" needs a scheme`, true},
		"default timeout over the maximum": {[]string{"--default-timeout", "3h"},
			"default timeout 3h0m0s exceeds the maximum 2h0m0s", true},
		"unknown naming mode": {[]string{"--naming-mode", "nested"},
			`naming mode must be "project" or "flat", got "nested"`, true},
		"{project} without a naming project": {[]string{"--allowed-destination", "{registry}/{project}/**"},
			`allowed destination "{registry}/{project}/**" uses {project} but no naming project is configured`, true},
		"no build slots":  {[]string{"--max-in-flight", "-1"}, "max in flight must be at least 1, got -1", false},
		"tenant weight 0": {[]string{"--tenant-weight", "acme=0"}, "tenant weight of acme must be at least 1, got 0", false},
		"bad log level":   {[]string{"--log-level", "loud"}, "--log-level: unrecognized level", false},
		"bad log format":  {[]string{"--log-format", "xml"}, `--log-format must be json or console, got "xml"`, false},
		"build log cap over the stream": {[]string{"--build-log-cap", "2097152", "--build-log-stream-max-bytes", "1048576"},
			"--build-log-cap (2097152 bytes) must not exceed --build-log-stream-max-bytes (1048576)", false},
	}
	for name, r := range rules {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c := sharedRuleArgs(t)
			cmds := map[string][]string{"worker": c.worker, "dev": c.dev}
			if r.render {
				cmds["render"] = c.render
			}
			messages := map[string]string{}
			for cmd, base := range cmds {
				code, stdout, stderr := cli(t, with(base, r.args...)...)
				if code != exitInvalid || stdout != "" || !strings.Contains(stderr, r.want) {
					t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit 2 saying %q", cmd, code, stdout, stderr, r.want)
				}
				messages[cmd] = stderr
			}
			for cmd, msg := range messages {
				if msg != messages["worker"] {
					t.Errorf("%s says %q, the worker %q: one rule, one message", cmd, msg, messages["worker"])
				}
			}
			assertNothingStarted(t, c.devData)
		})
	}
}

// dev serves one user (its stack has no authentication), so it takes the
// single-tenant shortcuts a multi-tenant worker refuses — except a cache
// repository shared by tenants that have per-tenant Secrets, which no
// command accepts.
func TestDevIsOneTenantButPerTenantSecretsNeedATenantCache(t *testing.T) {
	t.Parallel()
	c := sharedRuleArgs(t)
	devShortcuts := with(c.dev, "--tenant-registry-secret", "", "--registry-secret", "buildq-registry",
		"--cache-repo", "registry.example.com/cache")
	code, _, stderr := cli(t, devShortcuts...)
	if code != exitFailed || !strings.Contains(stderr, "kubernetes config") {
		t.Errorf("dev with a shared registry Secret and cache, no --fetch-image: exit %d, %q; want them accepted (exit 1 at the missing cluster)", code, stderr)
	}
	assertNothingStarted(t, c.devData)

	// The same flags make a multi-tenant worker refuse...
	noFetch := with(c.worker, "--fetch-image", "", "--tenant-registry-secret", "", "--tenant-registry-configs", "")
	code, _, stderr = cli(t, with(noFetch, "--registry-secret", "buildq-registry", "--cache-repo", "registry.example.com/cache")...)
	if code != exitInvalid || !strings.Contains(stderr, "--fetch-image") {
		t.Errorf("multi-tenant worker without --fetch-image: exit %d, %q; want exit 2", code, stderr)
	}
	// ... and a --single-tenant one accept them.
	code, _, stderr = cli(t, with(noFetch, "--single-tenant", "--registry-secret", "buildq-registry", "--cache-repo", "registry.example.com/cache")...)
	if code != exitFailed || !strings.Contains(stderr, "kubernetes config") {
		t.Errorf("--single-tenant worker with the shortcuts: exit %d, %q; want them accepted", code, stderr)
	}

	// Per-tenant Secrets with one cache repository: refused by a
	// --single-tenant worker too, with dev's message (the flag's help
	// says {tenant} is required with --tenant-registry-secret).
	_, _, devSays := cli(t, with(c.dev, "--cache-repo", "registry.example.com/cache")...)
	code, _, stderr = cli(t, with(c.worker, "--single-tenant", "--cache-repo", "registry.example.com/cache")...)
	if code != exitInvalid || stderr != devSays || !strings.Contains(stderr, "with --tenant-registry-secret") {
		t.Errorf("--single-tenant worker, per-tenant Secrets, shared cache: exit %d, %q; want exit 2 with dev's %q", code, stderr, devSays)
	}
	assertNothingStarted(t, c.devData)
}

// Without --kubeconfig dev builds in-process: the Job-shaping flags shape
// nothing, and only --job-template is refused, as it says nothing else.
func TestDevWithoutClusterChecksNoJobFlags(t *testing.T) {
	t.Parallel()
	parse := func(t *testing.T, args ...string) *serveConfig {
		t.Helper()
		var c serveConfig
		fs := pflag.NewFlagSet("dev", pflag.ContinueOnError)
		c.registerDev(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return &c
	}
	c := parse(t, "--executor-image", "kaniko:latest", "--tenant-registry-secret", "buildq-registry-{tenant}", "--cache-repo", "registry.example.com/cache")
	if err := c.Validate(); err != nil {
		t.Errorf("local executor with Job flags: %v", err)
	}
	c = parse(t, "--job-template", "job.yaml")
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "--job-template shapes kaniko Jobs: it needs --kubeconfig") {
		t.Errorf("--job-template without --kubeconfig: %v", err)
	}
	// With a cluster the same Job flags are checked.
	c = parse(t, "--kubeconfig", "kc", "--executor-image", testExecutor, "--tenant-registry-secret", "buildq-registry-{tenant}", "--cache-repo", "registry.example.com/cache")
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "must contain {tenant} with --tenant-registry-secret") {
		t.Errorf("dev --kubeconfig, per-tenant Secrets, shared cache: %v", err)
	}
}

// Validate completes what the running code reads: the Job configuration
// with the --job-template applied and kaniko's defaults, the worker's
// storage and naming policy; dev's naming policy is checked against the
// registry it is told to listen on.
func TestValidateCompletesTheConfig(t *testing.T) {
	t.Parallel()
	tmpl := filepath.Join(t.TempDir(), "job.yaml")
	if err := os.WriteFile(tmpl, []byte("priorityClassName: builds\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var w serveConfig
	fs := pflag.NewFlagSet("worker", pflag.ContinueOnError)
	w.registerWorker(fs)
	if err := fs.Parse([]string{"--single-tenant", "--executor-image", testExecutor, "--job-template", tmpl,
		"--storage", "memory", "--registry", "registry.example.com", "--id", "w1"}); err != nil {
		t.Fatal(err)
	}
	if err := w.Validate(); err != nil {
		t.Fatal(err)
	}
	if w.job.PriorityClassName != "builds" || w.job.ExecutorImage != testExecutor || len(w.job.Resources.Limits) == 0 {
		t.Errorf("job config %+v: want the template applied and default resources", w.job)
	}
	if w.worker.Storage != jetstream.MemoryStorage || w.worker.Naming.Registry != "registry.example.com" || w.worker.ID != "w1" {
		t.Errorf("worker config: storage %v, naming %+v, id %q", w.worker.Storage, w.worker.Naming, w.worker.ID)
	}

	var d serveConfig
	fs = pflag.NewFlagSet("dev", pflag.ContinueOnError)
	d.registerDev(fs)
	if err := fs.Parse([]string{"--allowed-destination", "{registry}/**"}); err != nil {
		t.Fatal(err)
	}
	if err := d.Validate(); err != nil {
		t.Fatalf("dev with {registry} patterns and its own registry: %v", err)
	}
	if d.worker.ID != "dev" || d.worker.ContextPrefix != "contexts/{tenant}/" || !d.worker.AnyReply {
		t.Errorf("dev's worker config %+v", d.worker)
	}
}

// --sbom-scanner is checked before the worker connects: SBOMs are signed,
// so it needs --signing-key, and it must name an executable file.
func TestSBOMScannerFlagIsCheckedAtStart(t *testing.T) {
	t.Parallel()
	c := sharedRuleArgs(t)
	dir := t.TempDir()
	exe := filepath.Join(dir, "syft")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "not-executable")
	if err := os.WriteFile(plain, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "signing.key")
	if _, _, err := attest.EnsureKeyPair(dir); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--sbom-scanner", exe}, "--sbom-scanner needs --signing-key"},
		{[]string{"--sbom-scanner", filepath.Join(dir, "missing"), "--signing-key", key}, "no such file"},
		{[]string{"--sbom-scanner", plain, "--signing-key", key}, "not an executable file"},
	} {
		code, _, stderr := cli(t, with(c.worker, tc.args...)...)
		if code != exitInvalid || !strings.Contains(stderr, tc.want) {
			t.Errorf("worker %v: exit %d, %q; want exit 2 saying %q", tc.args, code, stderr, tc.want)
		}
	}
	code, _, stderr := cli(t, with(c.dev, "--sbom-scanner", plain)...)
	if code != exitInvalid || !strings.Contains(stderr, "not an executable file") {
		t.Errorf("dev --sbom-scanner %s: exit %d, %q; want exit 2", plain, code, stderr)
	}
}
