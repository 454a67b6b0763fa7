package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/gitsource"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/worker"
)

// gitFlagsConfig holds the flags of git sources (`buildq worker`, `buildq
// dev`): which servers the worker may fetch from, with which tenants'
// credentials, within which limits.
type gitFlagsConfig struct {
	allowedHosts  []string
	insecureHosts []string
	// tenantSecret names each tenant's git Secret ({tenant}); its keys
	// are mounted under tenantConfigs/<tenant>/.
	tenantSecret  string
	tenantConfigs string
	limits        gitsource.Limits
	concurrent    int
}

func (g *gitFlagsConfig) register(fs *pflag.FlagSet, dev bool) {
	hostsHelp := "git server a request's source.git may be fetched from: a host name, *.example.com, an IP or a CIDR (repeatable); none: git sources are refused. Private, loopback and link-local addresses (169.254.169.254 among them) are refused after DNS and on every redirect unless an IP or CIDR entry contains them"
	if dev {
		hostsHelp = "git server a request's source.git may be fetched from (repeatable; default: any host, loopback and private addresses included)"
	}
	fs.StringArrayVar(&g.allowedHosts, "allowed-git-host", nil, hostsHelp)
	fs.StringArrayVar(&g.insecureHosts, "insecure-git-host", nil, "git server that may be reached over plain http:// (same syntax; repeatable)")
	fs.StringVar(&g.tenantSecret, "tenant-git-secret", "", "name of each tenant's git credentials Secret, with {tenant} (e.g. buildq-git-{tenant}); keys username+password (a token) or ssh-privatekey+known_hosts, and insecure-ignore-host-key: \"true\" to accept any SSH host key. Only the worker reads them, never a build Pod")
	fs.StringVar(&g.tenantConfigs, "tenant-git-configs", "", "with --tenant-git-secret: directory holding <tenant>/, each tenant's Secret mounted; a tenant without one fetches anonymously")
	fs.Int64Var(&g.limits.MaxFetchBytes, "git-max-fetch-bytes", gitsource.DefaultMaxFetchBytes, "bytes a git source's fetch may receive")
	fs.IntVar(&g.limits.MaxObjects, "git-max-objects", gitsource.DefaultMaxObjects, "objects a git source's fetch may receive")
	fs.DurationVar(&g.limits.Timeout, "git-timeout", gitsource.DefaultTimeout, "how long resolving, fetching and packing a git source may take")
	fs.IntVar(&g.limits.MaxDepth, "git-max-depth", gitsource.DefaultMaxDepth, "commits of history fetched to find a commit that is not its ref's tip")
	fs.IntVar(&g.concurrent, "git-max-concurrent", 2, "git sources this process fetches at once; more wait (each may hold up to about 160 MiB in memory, an object of up to 64 MiB and go-git's delta cache, and its checkout in the temporary directory)")
}

// validate checks the git flags.
func (g *gitFlagsConfig) validate() error {
	if (g.tenantSecret == "") != (g.tenantConfigs == "") {
		return usageErr("--tenant-git-secret and --tenant-git-configs go together: the Secret of each tenant, and where the worker has them mounted")
	}
	if g.tenantSecret != "" && !strings.Contains(g.tenantSecret, "{tenant}") {
		return usageErr("--tenant-git-secret %q must contain {tenant}: each tenant's credentials are its own", g.tenantSecret)
	}
	if err := (gitsource.Policy{AllowedHosts: g.allowedHosts, InsecureHosts: g.insecureHosts}).Validate(); err != nil {
		return usageErr("%v", err)
	}
	if g.limits.MaxFetchBytes <= 0 || g.limits.MaxObjects <= 0 || g.limits.Timeout <= 0 || g.limits.MaxDepth <= 0 || g.concurrent <= 0 {
		return usageErr("--git-max-fetch-bytes, --git-max-objects, --git-timeout, --git-max-depth and --git-max-concurrent must be positive")
	}
	return nil
}

// packer is the worker's GitSources, or nil when no git server is
// allowed; store receives the packed contexts. dev allows any host.
func (g *gitFlagsConfig) packer(store *s3store.Store, dev bool, tempDir string) worker.GitSources {
	policy := gitsource.Policy{AllowedHosts: g.allowedHosts, InsecureHosts: g.insecureHosts}
	if dev {
		policy.AllowPrivate = true
		if len(policy.AllowedHosts) == 0 {
			policy.AllowedHosts = []string{"*"}
		}
		if len(policy.InsecureHosts) == 0 {
			policy.InsecureHosts = []string{"*"}
		}
	}
	if len(policy.AllowedHosts) == 0 {
		return nil
	}
	f := &gitsource.Fetcher{Policy: policy, Limits: g.limits, TempDir: tempDir}
	if g.tenantConfigs != "" {
		f.Credentials = tenantGitCredentials(g.tenantConfigs)
	}
	return worker.NewGitPacker(f, tenantArchives{store}, g.concurrent)
}

// tenantGitCredentials reads a tenant's git credentials from
// dir/<tenant>/, its Secret mounted: Kubernetes' basic-auth keys
// (username, password) or ssh-auth keys (ssh-privatekey, with
// known_hosts), and insecure-ignore-host-key. No directory: anonymous.
func tenantGitCredentials(dir string) func(string) (*gitsource.Credentials, error) {
	return func(tenant string) (*gitsource.Credentials, error) {
		root := filepath.Join(dir, tenant)
		read := func(key string) ([]byte, error) {
			b, err := os.ReadFile(filepath.Join(root, key))
			if errors.Is(err, fs.ErrNotExist) {
				return nil, nil
			}
			return b, err
		}
		if _, err := os.Stat(root); errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		var c gitsource.Credentials
		var errs []error
		for key, dst := range map[string]*[]byte{"ssh-privatekey": &c.SSHKey, "known_hosts": &c.KnownHosts} {
			b, err := read(key)
			errs = append(errs, err)
			*dst = b
		}
		user, err := read("username")
		errs = append(errs, err)
		pass, err := read("password")
		errs = append(errs, err)
		insecure, err := read("insecure-ignore-host-key")
		errs = append(errs, err)
		if err := errors.Join(errs...); err != nil {
			// Names the file, never its content.
			return nil, fmt.Errorf("tenant %q git credentials in %s: %w", tenant, root, err)
		}
		c.Username, c.Password = strings.TrimSpace(string(user)), strings.TrimSpace(string(pass))
		c.InsecureIgnoreHostKey = strings.TrimSpace(string(insecure)) == "true"
		return &c, nil
	}
}

// tenantArchives stores packed contexts under each tenant's own prefix.
type tenantArchives struct{ store *s3store.Store }

func (t tenantArchives) PutArchive(ctx context.Context, tenant, digest string, r io.Reader, size int64) (v1.S3Source, error) {
	res, err := t.store.ForTenant(tenant).PutArchive(ctx, digest, r, size)
	if err != nil {
		return v1.S3Source{}, err
	}
	return v1.S3Source{Bucket: res.Bucket, Key: res.Key}, nil
}
