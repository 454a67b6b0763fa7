package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker"
)

// tenantRegistries gives a tenant's registry client: its own credentials
// from dir/<tenant>/config.json for everything written into its
// repositories, the worker's (shared) for reading the source of a copy.
//
// It is asked on every request's way to its build (twice: at intake and
// by its handler), so a tenant's client is kept while its file is known
// unchanged: a stat per request, where reading and parsing the file was
// about 0.1 ms on the path from publish to Job (P1 in docs/benchmarks.md).
// Known unchanged is the same file (a mounted Secret's update swaps in a
// new one) with the same size, modification time and change time (the
// kernel sets the change time on every write, whatever keeps the
// modification time: cp -p, tar, rsync -t), last changed well before it
// was looked at. A file changed within racyWindow of the look may change
// again within one tick of a coarse clock, leaving every time as it was:
// it is read again on each request, and its client kept only while its
// bytes are those it was made of.
func tenantRegistries(shared *registry.Client, dir string, kc kaniko.Config) func(string) (worker.Registry, error) {
	c := &tenantRegistryCache{shared: shared, dir: dir, kc: kc, now: time.Now, stat: os.Stat, read: os.ReadFile, kept: map[string]keptRegistry{}}
	return c.registryFor
}

// tenantRegistryCache keeps the tenants' registry clients
// (tenantRegistries).
type tenantRegistryCache struct {
	shared *registry.Client
	dir    string
	kc     kaniko.Config
	now    func() time.Time
	stat   func(string) (os.FileInfo, error)
	read   func(string) ([]byte, error)

	mu   sync.Mutex
	kept map[string]keptRegistry
}

// keptRegistry is a tenant's client and the version of its file it was
// made of.
type keptRegistry struct {
	file os.FileInfo
	// settled: the file was last changed more than racyWindow before it
	// was looked at (file), so a later change shows in its times.
	settled bool
	data    []byte
	reg     tenantRegistry
}

func (c *tenantRegistryCache) forget(tenant string) {
	c.mu.Lock()
	delete(c.kept, tenant)
	c.mu.Unlock()
}

func (c *tenantRegistryCache) registryFor(tenant string) (worker.Registry, error) {
	p := filepath.Join(c.dir, tenant, "config.json")
	at := c.now()
	fi, err := c.stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		c.forget(tenant)
		return nil, fmt.Errorf("tenant %q has no registry credentials: %s is missing (create the Secret %s in the build namespace and mount it there)", tenant, p, c.kc.RegistrySecretFor(tenant))
	}
	if err != nil {
		c.forget(tenant)
		return nil, fmt.Errorf("tenant %q registry credentials: %w", tenant, err)
	}
	c.mu.Lock()
	k, ok := c.kept[tenant]
	c.mu.Unlock()
	if ok && k.settled && sameVersion(k.file, fi) {
		return k.reg, nil
	}
	// The stat came first: a change after it shows in the next one.
	data, err := c.read(p)
	if err != nil {
		c.forget(tenant)
		return nil, fmt.Errorf("tenant %q registry credentials: %w", tenant, err)
	}
	reg := k.reg
	if !ok || !bytes.Equal(k.data, data) {
		own, err := registry.New(registry.Options{DockerConfig: p, DockerConfigData: data, Insecure: c.kc.InsecureRegistries})
		if err != nil {
			c.forget(tenant)
			return nil, fmt.Errorf("tenant %q registry credentials: %w", tenant, err)
		}
		reg = tenantRegistry{shared: c.shared, own: own}
	}
	changed, known := changeTime(fi)
	c.mu.Lock()
	if len(c.kept) >= maxKeptTenantRegistries {
		clear(c.kept)
	}
	c.kept[tenant] = keptRegistry{file: fi, settled: known && changed.Before(at.Add(-racyWindow)), data: data, reg: reg}
	c.mu.Unlock()
	return reg, nil
}

// maxKeptTenantRegistries bounds the tenants whose clients are kept.
const maxKeptTenantRegistries = 4096

// racyWindow is more than any file timestamp's granularity: a file last
// changed longer ago than this before a look changes its times with its
// next write.
const racyWindow = 2 * time.Second

// sameVersion reports whether a and b are one version of one file: the
// same file, its size, modification and change times unchanged.
func sameVersion(a, b os.FileInfo) bool {
	ca, oka := changeTime(a)
	cb, okb := changeTime(b)
	return oka && okb && ca.Equal(cb) && os.SameFile(a, b) && a.Size() == b.Size() && a.ModTime().Equal(b.ModTime())
}

// tenantRegistry is worker.Registry for one tenant's requests.
type tenantRegistry struct{ shared, own *registry.Client }

// A worker that attests attaches provenance and resolves base images
// through a tenant's registry: with the tenant's credentials.
var _ worker.RemoteRegistry = tenantRegistry{}

// RemoteOptions are the tenant's own (worker.RemoteRegistry).
func (t tenantRegistry) RemoteOptions(ctx context.Context) []remote.Option {
	return t.own.RemoteOptions(ctx)
}

// ParseReference implements worker.RemoteRegistry.
func (t tenantRegistry) ParseReference(ref string) (name.Reference, error) {
	return t.own.ParseReference(ref)
}

func (t tenantRegistry) Head(ctx context.Context, ref string) (string, error) {
	return t.own.Head(ctx, ref)
}

func (t tenantRegistry) Copy(ctx context.Context, src, dst string) (string, error) {
	return t.shared.CopyTo(ctx, src, dst, t.own)
}

// PushIndex writes into the tenant's repository: the tenant's credentials.
func (t tenantRegistry) PushIndex(ctx context.Context, children []registry.IndexChild, refs []string) (string, error) {
	return t.own.PushIndex(ctx, children, refs)
}

// EnsureHarborProject needs an administrator: the worker's credentials.
func (t tenantRegistry) EnsureHarborProject(ctx context.Context, reg, project string) error {
	return t.shared.EnsureHarborProject(ctx, reg, project)
}
