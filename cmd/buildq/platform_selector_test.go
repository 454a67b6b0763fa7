package main

import (
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// Issue 29: --platform-node-selector is one of the Job-shaping flags the
// worker, dev --kubeconfig and render share; a bad entry is a usage error
// (exit 2) that names it, the same from each command.
func TestPlatformNodeSelectorIsCheckedByEveryCommand(t *testing.T) {
	t.Parallel()
	bad := map[string]struct{ entry, want string }{
		"unknown platform": {"linux/sparc=kubernetes.io/arch=amd64", `--platform-node-selector "linux/sparc=kubernetes.io/arch=amd64": "linux/sparc" is not a known platform`},
		"no selector":      {"linux/386", `--platform-node-selector "linux/386" is not PLATFORM=KEY=VALUE`},
		"bad label value":  {"linux/386=kubernetes.io/arch=amd 64", `"amd 64" is not a label value`},
	}
	for name, b := range bad {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c := sharedRuleArgs(t)
			messages := map[string]string{}
			for cmd, base := range map[string][]string{"worker": c.worker, "dev": c.dev, "render": c.render} {
				code, stdout, stderr := cli(t, with(base, "--platform-node-selector", b.entry)...)
				if code != exitInvalid || stdout != "" || !strings.Contains(stderr, b.want) {
					t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit 2 saying %q", cmd, code, stdout, stderr, b.want)
				}
				messages[cmd] = stderr
			}
			for cmd, msg := range messages {
				if msg != messages["worker"] {
					t.Errorf("%s says %q, the worker %q", cmd, msg, messages["worker"])
				}
			}
			assertNothingStarted(t, c.devData)
		})
	}
}

// render prints the Job a worker would create: on the nodes the flag
// names, with BuildKit's platform arguments.
func TestRenderPlacesAPlatformWhereTheFlagSays(t *testing.T) {
	t.Parallel()
	c := sharedRuleArgs(t)
	code, stdout, stderr := cli(t, with(c.render, "--platform", "linux/386",
		"--platform-node-selector", "linux/386=kubernetes.io/arch=amd64,pool=builds")...)
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"--custom-platform=linux/386", "--build-arg=TARGETPLATFORM=linux/386", "--build-arg=TARGETARCH=386",
		"--build-arg=BUILDPLATFORM=linux/amd64", "kubernetes.io/arch: amd64", "pool: builds"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("the Job does not say %q:\n%s", want, stdout)
		}
	}
	if strings.Contains(stdout, "kubernetes.io/arch: \"386\"") || strings.Contains(stdout, "kubernetes.io/arch: 386") {
		t.Errorf("the default selector is still there:\n%s", stdout)
	}
}

// Validate puts the parsed selectors into the Job configuration; a list
// split at its commas (BUILDQ_PLATFORM_NODE_SELECTOR) reads the same.
func TestPlatformNodeSelectorReachesTheJobConfig(t *testing.T) {
	t.Parallel()
	var w serveConfig
	fs := pflag.NewFlagSet("worker", pflag.ContinueOnError)
	w.registerWorker(fs)
	if err := fs.Parse([]string{"--single-tenant", "--executor-image", testExecutor, "--storage", "memory",
		"--registry", "registry.example.com", "--kubeconfig", "kc",
		"--platform-node-selector", "linux/386=kubernetes.io/arch=amd64", "--platform-node-selector", "pool=builds",
		"--platform-node-selector", "linux/arm/v7=kubernetes.io/arch=arm64"}); err != nil {
		t.Fatal(err)
	}
	if err := w.Validate(); err != nil {
		t.Fatal(err)
	}
	got := w.job.PlatformNodeSelectors
	if len(got) != 2 || got["linux/386"]["kubernetes.io/arch"] != "amd64" || got["linux/386"]["pool"] != "builds" ||
		got["linux/arm/v7"]["kubernetes.io/arch"] != "arm64" {
		t.Fatalf("selectors %v", got)
	}

	var d serveConfig
	fs = pflag.NewFlagSet("dev", pflag.ContinueOnError)
	d.registerDev(fs)
	if err := fs.Parse([]string{"--platform-node-selector", "linux/386=kubernetes.io/arch=amd64"}); err != nil {
		t.Fatal(err)
	}
	if err := d.Validate(); err == nil || !strings.Contains(err.Error(), "--platform-node-selector places kaniko Jobs: it needs --kubeconfig") {
		t.Errorf("dev without a cluster: %v", err)
	}
}
