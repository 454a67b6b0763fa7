package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/worker"
)

// tenantRegistries gives a tenant's registry client: its own credentials
// from dir/<tenant>/config.json for everything written into its
// repositories, the worker's (shared) for reading the source of a copy.
func tenantRegistries(shared *registry.Client, dir string, kc kaniko.Config) func(string) (worker.Registry, error) {
	return func(tenant string) (worker.Registry, error) {
		p := filepath.Join(dir, tenant, "config.json")
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("tenant %q has no registry credentials: %s is missing (create the Secret %s in the build namespace and mount it there)", tenant, p, kc.RegistrySecretFor(tenant))
		}
		own, err := registry.New(registry.Options{DockerConfig: p, Insecure: kc.InsecureRegistries})
		if err != nil {
			return nil, fmt.Errorf("tenant %q registry credentials: %w", tenant, err)
		}
		return tenantRegistry{shared: shared, own: own}, nil
	}
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
