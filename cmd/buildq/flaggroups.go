package main

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// A flag group is a heading of `--help` and a section of `buildq worker
// --config`'s file. Every flag of worker and dev belongs to one
// (flaggroups_test.go holds it).
type flagGroup struct {
	name  string // the config file's section
	title string // the --help heading
	flags []string
}

// flagGroups is the order --help prints them in.
var flagGroups = []flagGroup{
	{"worker", "Worker", []string{
		"config", "id", "log-level", "log-format", "metrics-addr", "pprof",
		"data", "nats-addr", "s3-addr", "registry-addr", "unsafe-listen", "gateway-addr", "gateway-config",
	}},
	{"nats", "NATS and JetStream", []string{
		"nats-url", "nats-creds", "nats-nkey", "nats-tls-ca", "nats-tls-cert", "nats-tls-key", "inbox-prefix",
		"storage", "replicas", "ack-wait", "lease", "max-deliver", "results-max-age", "index-ttl", "record-first",
	}},
	{"kubernetes", "Kubernetes", []string{
		"kubeconfig", "kube-api-qps", "kube-api-burst", "namespace", "executor-image", "fetch-image",
		"job-template", "service-account", "backoff-limit", "ttl-after-finished", "keep-jobs", "push-retry",
		"cache-repo", "cache-ttl", "platform-node-selector",
	}},
	{"storage", "Storage (S3)", []string{
		"s3-endpoint", "s3-region", "s3-access-key", "s3-secret-key",
		"s3-credentials-secret", "s3-credentials-access-key-field", "s3-credentials-secret-key-field",
		"context-bucket", "context-prefix",
	}},
	{"registry", "Registry and image names", []string{
		"registry", "registry-config", "registry-secret", "insecure-registry", "allowed-registry",
		"allowed-destination", "naming-mode", "naming-project", "naming-prefix", "harbor",
	}},
	{"attestation", "Provenance and SBOMs (signed, attached to the image)", []string{
		"signing-key", "builder-id", "sbom-scanner", "sbom-timeout", "sbom-max-bytes",
	}},
	{"tenants", "Tenants", []string{
		"single-tenant", "tenant-weight", "tenant-concurrency", "tenant-queue-limit",
		"tenant-registry-secret", "tenant-registry-configs", "tenant-git-secret", "tenant-git-configs",
	}},
	{"limits", "Limits", []string{
		"max-in-flight", "default-timeout", "max-timeout", "queue-ttl", "hold-at-intake",
	}},
	{"git", "Git sources", []string{
		"allowed-git-host", "insecure-git-host", "git-timeout", "git-max-concurrent", "git-max-depth",
		"git-max-fetch-bytes", "git-max-objects",
	}},
	{"logs", "Build logs", []string{
		"build-logs", "build-log-cap", "build-log-stream-max-age", "build-log-stream-max-bytes", "build-log-retention",
	}},
}

// groupOf returns the group of a flag, or "" when it has none.
func groupOf(flag string) string {
	for _, g := range flagGroups {
		if slices.Contains(g.flags, flag) {
			return g.name
		}
	}
	return ""
}

// groupedUsage makes cmd's --help list its flags under the groups'
// headings; flags of no group (help) come last.
func groupedUsage(cmd *cobra.Command) {
	cmd.SetUsageFunc(func(c *cobra.Command) error {
		w := c.OutOrStderr()
		fmt.Fprintf(w, "Usage:\n  %s\n", c.UseLine())
		if c.HasExample() {
			fmt.Fprintf(w, "\nExamples:\n%s\n", c.Example)
		}
		printGroupedFlags(w, c.Flags())
		return nil
	})
}

func printGroupedFlags(w io.Writer, all *pflag.FlagSet) {
	seen := map[string]bool{}
	section := func(title string, names []string) {
		fs := pflag.NewFlagSet(title, pflag.ContinueOnError)
		for _, n := range names {
			if f := all.Lookup(n); f != nil && !f.Hidden && f.Deprecated == "" {
				fs.AddFlag(f)
				seen[n] = true
			}
		}
		if fs.HasFlags() {
			fmt.Fprintf(w, "\n%s:\n%s", title, fs.FlagUsages())
		}
	}
	for _, g := range flagGroups {
		section(g.title+" flags", g.flags)
	}
	var rest []string
	all.VisitAll(func(f *pflag.Flag) {
		if !seen[f.Name] {
			rest = append(rest, f.Name)
		}
	})
	section("Other flags", rest)
}

// renameFlag keeps old as a deprecated, hidden alias of the flag now
// called name, for one release: it sets the same value.
func renameFlag(fs *pflag.FlagSet, old, name string) {
	f := fs.Lookup(name)
	alias := *f
	alias.Name = old
	alias.Shorthand = ""
	alias.Usage = "old name of --" + name
	fs.AddFlag(&alias)
	_ = fs.MarkDeprecated(old, "use --"+name)
}

// deprecatedNames lists each renamed flag's old name.
func deprecatedNames(fs *pflag.FlagSet) map[string]string {
	out := map[string]string{}
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Deprecated != "" {
			out[f.Name] = strings.TrimPrefix(f.Deprecated, "use --")
		}
	})
	return out
}
