package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Every flag of worker and dev is under a heading of --help and in a
// section of --config: a new flag without a group fails here.
func TestEveryServeFlagHasAGroup(t *testing.T) {
	for _, cmd := range []*cobra.Command{newWorkerCmd(), newDevCmd()} {
		cmd.Flags().VisitAll(func(f *pflag.Flag) {
			if f.Name == "help" || f.Deprecated != "" {
				return
			}
			if groupOf(f.Name) == "" {
				t.Errorf("%s --%s has no group in flagGroups", cmd.Name(), f.Name)
			}
		})
	}
	seen := map[string]string{}
	for _, g := range flagGroups {
		for _, f := range g.flags {
			if prev, ok := seen[f]; ok {
				t.Errorf("--%s is in groups %s and %s", f, prev, g.name)
			}
			seen[f] = g.name
		}
	}
}

func TestWorkerHelpGroupsFlags(t *testing.T) {
	code, out, _ := cli(t, "worker", "--help")
	if code != 0 {
		t.Fatalf("worker --help: exit %d", code)
	}
	_, usage, ok := strings.Cut(out, "Usage:")
	if !ok {
		t.Fatalf("worker --help has no Usage:\n%s", out)
	}
	out = usage
	at := func(s string) int {
		i := strings.Index(out, s)
		if i < 0 {
			t.Fatalf("worker --help lacks %q:\n%s", s, out)
		}
		return i
	}
	// Each flag under its own heading, the headings in order.
	if !(at("NATS and JetStream flags:") < at("--nats-url") && at("--nats-url") < at("Kubernetes flags:") &&
		at("Kubernetes flags:") < at("--executor-image") && at("--executor-image") < at("Storage (S3) flags:") &&
		at("Storage (S3) flags:") < at("--s3-credentials-secret") && at("Tenants flags:") < at("--tenant-weight")) {
		t.Errorf("flags not under their headings:\n%s", out)
	}
	// The old names work but are not offered.
	for _, old := range []string{"--s3-secret ", "--s3-access-key-field", "--s3-secret-key-field", "--allow-unverified-contexts"} {
		if strings.Contains(out, old) {
			t.Errorf("--help lists the deprecated %s", old)
		}
	}
}

// workerFlags parses args as worker's command line, then completes them
// as the worker does before it validates.
func workerFlags(t *testing.T, args ...string) (*serveConfig, error) {
	t.Helper()
	c := &serveConfig{}
	cmd := &cobra.Command{Use: "worker"}
	c.registerWorker(cmd.Flags())
	var stderr bytes.Buffer
	cmd.SetErr(&stderr)
	cmd.Flags().SetOutput(&stderr)
	if err := cmd.ParseFlags(args); err != nil {
		t.Fatal(err)
	}
	err := c.loadWorker(cmd)
	return c, err
}

func writeConfig(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "buildq.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestConfigFileFlagsAndVariablesOverride(t *testing.T) {
	file := writeConfig(t, `
nats:
  nats-url: nats://file:4222
  replicas: 3
  ack-wait: 45s
kubernetes:
  namespace: from-file
  executor-image: example.com/kaniko@sha256:1111111111111111111111111111111111111111111111111111111111111111
storage:
  s3-credentials-secret: s3-from-file
registry:
  insecure-registry: [a.example:5000, b.example:5000]
tenants:
  tenant-weight: {acme: 3, "*": 1}
limits:
  max-in-flight: 7
logs:
  build-logs: false
`)
	t.Setenv("BUILDQ_NAMESPACE", "from-env")
	c, err := workerFlags(t, "--config", file, "--replicas", "5")
	if err != nil {
		t.Fatal(err)
	}
	w, k := c.worker, c.kaniko
	if c.nats.url != "nats://file:4222" || w.AckWait != 45*time.Second || w.MaxInFlight != 7 || w.Logs.Enabled {
		t.Errorf("file values not applied: url %q ackWait %s maxInFlight %d logs %v", c.nats.url, w.AckWait, w.MaxInFlight, w.Logs.Enabled)
	}
	if w.Replicas != 5 {
		t.Errorf("--replicas 5 on the command line: got %d (the file's 3 must lose)", w.Replicas)
	}
	if k.Namespace != "from-env" {
		t.Errorf("BUILDQ_NAMESPACE: got %q (the file's must lose)", k.Namespace)
	}
	if k.S3Secret != "s3-from-file" || strings.Join(k.InsecureRegistries, ",") != "a.example:5000,b.example:5000" {
		t.Errorf("secret %q insecure %v", k.S3Secret, k.InsecureRegistries)
	}
	if w.Fair.Weights["acme"] != 3 || w.Fair.Weights["*"] != 1 || len(w.Fair.Weights) != 2 {
		t.Errorf("tenant-weight: %v", w.Fair.Weights)
	}
}

func TestConfigFileFromVariable(t *testing.T) {
	t.Setenv("BUILDQ_CONFIG", writeConfig(t, "limits:\n  max-in-flight: 9\n"))
	c, err := workerFlags(t)
	if err != nil {
		t.Fatal(err)
	}
	if c.worker.MaxInFlight != 9 {
		t.Errorf("BUILDQ_CONFIG's file not read: max-in-flight %d", c.worker.MaxInFlight)
	}
}

func TestConfigFileMistakesAreNamed(t *testing.T) {
	for _, tc := range []struct{ name, body, want string }{
		{"unknown key", "nats:\n  nats-ulr: x\n", "nats.nats-ulr: not a setting"},
		{"wrong section", "nats:\n  namespace: x\n", "nats.namespace: belongs in section kubernetes"},
		{"unknown section", "s3:\n  s3-endpoint: x\n", "s3: not a section"},
		{"old name", "storage:\n  s3-secret: x\n", "storage.s3-secret: renamed; use s3-credentials-secret"},
		{"bad value", "nats:\n  replicas: three\n", "nats.replicas:"},
		{"list for a scalar", "kubernetes:\n  namespace: [a, b]\n", "a list, but --namespace"},
		{"not YAML sections", "nats-url: x\n", "want sections of flag: value"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := workerFlags(t, "--config", writeConfig(t, tc.body))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
	if _, err := workerFlags(t, "--config", filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "--config") {
		t.Errorf("missing file: %v", err)
	}
}

// The renamed flags' old names set the same value, from the command
// line and from their variables, and the new names win.
func TestRenamedFlagsKeepTheirOldNames(t *testing.T) {
	c, err := workerFlags(t, "--s3-secret", "old", "--s3-access-key-field", "ID")
	if err != nil {
		t.Fatal(err)
	}
	if c.kaniko.S3Secret != "old" || c.kaniko.S3AccessKeyField != "ID" {
		t.Errorf("old names: secret %q field %q", c.kaniko.S3Secret, c.kaniko.S3AccessKeyField)
	}
	t.Setenv("BUILDQ_S3_CREDENTIALS_SECRET", "new-env")
	c, err = workerFlags(t, "--s3-secret", "old-flag")
	if err != nil {
		t.Fatal(err)
	}
	if c.kaniko.S3Secret != "old-flag" {
		t.Errorf("the command line's old name must beat the variable: %q", c.kaniko.S3Secret)
	}
	t.Setenv("BUILDQ_S3_SECRET", "old-env")
	c, err = workerFlags(t)
	if err != nil {
		t.Fatal(err)
	}
	if c.kaniko.S3Secret != "new-env" {
		t.Errorf("BUILDQ_S3_CREDENTIALS_SECRET must beat BUILDQ_S3_SECRET: %q", c.kaniko.S3Secret)
	}
	os.Unsetenv("BUILDQ_S3_CREDENTIALS_SECRET")
	c, err = workerFlags(t)
	if err != nil {
		t.Fatal(err)
	}
	if c.kaniko.S3Secret != "old-env" {
		t.Errorf("BUILDQ_S3_SECRET alone: %q", c.kaniko.S3Secret)
	}
}

// The README's example file is one the worker reads.
func TestREADMEConfigFileExampleLoads(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "buildq worker --config")
	if !ok {
		t.Fatal("README does not show buildq worker --config")
	}
	_, rest, ok = strings.Cut(rest, "```yaml\n")
	block, _, ok2 := strings.Cut(rest, "```")
	if !ok || !ok2 {
		t.Fatal("no yaml block after the README's --config paragraph")
	}
	c, err := workerFlags(t, "--config", writeConfig(t, block))
	if err != nil {
		t.Fatalf("README's example: %v", err)
	}
	if c.naming.Registry != "registry.example.com" || c.worker.Fair.Weights["acme"] != 2 || c.metricsAddr != ":9090" {
		t.Errorf("README's example not applied: registry %q weights %v metrics %q", c.naming.Registry, c.worker.Fair.Weights, c.metricsAddr)
	}
}

// --record-first (the first rollout of an upgrade from workers that
// record every decision first) reaches the worker's configuration, from
// the command line and from the file's NATS section; it is off by default.
func TestRecordFirstReachesTheWorker(t *testing.T) {
	c, err := workerFlags(t)
	if err != nil {
		t.Fatal(err)
	}
	if c.worker.RecordFirst {
		t.Error("RecordFirst set without --record-first; want publish-first by default")
	}
	if c, err = workerFlags(t, "--record-first"); err != nil {
		t.Fatal(err)
	}
	if !c.worker.RecordFirst {
		t.Error("--record-first did not set RecordFirst")
	}
	if c, err = workerFlags(t, "--config", writeConfig(t, "nats:\n  record-first: true\n")); err != nil {
		t.Fatal(err)
	}
	if !c.worker.RecordFirst {
		t.Error("record-first: true in the file's nats section did not set RecordFirst")
	}
}
