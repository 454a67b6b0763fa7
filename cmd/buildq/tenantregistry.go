package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"

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
// by its handler), so a tenant's client is kept while its file stays the
// same one: a stat per request, where reading and parsing the file was
// about 0.1 ms on the path from publish to Job (P1 in docs/benchmarks.md).
// A mounted Secret is updated by swapping the file for a new one, and a
// file written in place changes its size or modification time: either
// way the next request reads it again.
func tenantRegistries(shared *registry.Client, dir string, kc kaniko.Config) func(string) (worker.Registry, error) {
	type kept struct {
		file os.FileInfo
		reg  tenantRegistry
	}
	var (
		mu    sync.Mutex
		cache = map[string]kept{}
	)
	return func(tenant string) (worker.Registry, error) {
		p := filepath.Join(dir, tenant, "config.json")
		fi, err := os.Stat(p)
		if err != nil {
			mu.Lock()
			delete(cache, tenant)
			mu.Unlock()
			return nil, fmt.Errorf("tenant %q has no registry credentials: %s is missing (create the Secret %s in the build namespace and mount it there)", tenant, p, kc.RegistrySecretFor(tenant))
		}
		mu.Lock()
		k, ok := cache[tenant]
		mu.Unlock()
		if ok && sameVersion(k.file, fi) {
			return k.reg, nil
		}
		own, err := registry.New(registry.Options{DockerConfig: p, Insecure: kc.InsecureRegistries})
		if err != nil {
			return nil, fmt.Errorf("tenant %q registry credentials: %w", tenant, err)
		}
		reg := tenantRegistry{shared: shared, own: own}
		mu.Lock()
		if len(cache) >= maxKeptTenantRegistries {
			clear(cache)
		}
		cache[tenant] = kept{file: fi, reg: reg}
		mu.Unlock()
		return reg, nil
	}
}

// maxKeptTenantRegistries bounds the tenants whose clients are kept.
const maxKeptTenantRegistries = 4096

// sameVersion reports whether a and b are one version of one file: the
// same file (a Secret's update swaps it for a new one), its size and
// modification time unchanged.
func sameVersion(a, b os.FileInfo) bool {
	return os.SameFile(a, b) && a.Size() == b.Size() && a.ModTime().Equal(b.ModTime())
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
