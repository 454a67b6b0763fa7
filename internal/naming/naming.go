// Package naming decides where a build's image is pushed when the request
// names no repository (DESIGN §5).
package naming

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"

	v1 "github.com/buildq/buildq/api/v1"
)

// Modes of the naming policy.
const (
	// ModeProject: {registry}/{project}/{name}; the project is the tenant
	// unless Project is set (Harbor, GHCR, GCR).
	ModeProject = "project"
	// ModeFlat: {registry}/{prefix}{tenant}-{name} (Docker Hub style, one
	// namespace for everyone).
	ModeFlat = "flat"
)

// Policy is the naming policy.
type Policy struct {
	// Registry host[:port]; empty means requests must name their image.
	Registry string
	// Mode is ModeProject (default) or ModeFlat.
	Mode string
	// Project, in project mode, replaces the tenant as the project.
	Project string
	// Prefix, in flat mode, goes before the tenant (e.g. an organisation
	// "acme/" on Docker Hub).
	Prefix string
	// Harbor: the registry is Harbor, whose projects must exist before a
	// push; the worker creates them on demand (project mode only).
	Harbor bool
}

// HarborProject returns the Harbor project a repository of this policy's
// registry lives in, and whether one must be ensured.
func (p Policy) HarborProject(repo string) (string, bool) {
	if !p.Harbor || p.Mode == ModeFlat || p.Registry == "" || !strings.HasPrefix(repo, p.Registry+"/") {
		return "", false
	}
	rest := strings.TrimPrefix(repo, p.Registry+"/")
	project, _, ok := strings.Cut(rest, "/")
	if !ok || project == "" {
		return "", false
	}
	return project, true
}

// ErrNoRepository is returned for a request without image when no registry
// is configured.
var ErrNoRepository = errors.New("the request names no image and the worker has no default registry")

// Validate checks the policy.
func (p Policy) Validate() error {
	switch p.Mode {
	case "", ModeProject, ModeFlat:
	default:
		return fmt.Errorf("naming mode must be %q or %q, got %q", ModeProject, ModeFlat, p.Mode)
	}
	if p.Registry != "" {
		if _, err := name.NewRegistry(p.Registry, name.StrictValidation); err != nil {
			return fmt.Errorf("naming registry %q: %w", p.Registry, err)
		}
	}
	return nil
}

// Repository returns the repository a request's image goes to.
func (p Policy) Repository(r *v1.Request) (string, error) {
	if r.Image != "" {
		return r.Image, nil
	}
	if p.Registry == "" {
		return "", ErrNoRepository
	}
	var repo string
	switch p.Mode {
	case ModeFlat:
		repo = p.Registry + "/" + p.Prefix + r.Tenant + "-" + r.Name
	default:
		project := p.Project
		if project == "" {
			project = r.Tenant
		}
		repo = p.Registry + "/" + project + "/" + r.Name
	}
	if msg := v1.RepositoryProblem(repo); msg != "" {
		return "", fmt.Errorf("naming policy produced an invalid repository: %s", msg)
	}
	return repo, nil
}

// Destinations are the full references a build pushes: the key's default
// tag first, then the request's tags.
func Destinations(repo, key string, tags []string) []string {
	out := []string{repo + ":" + v1.DefaultTag(key)}
	for _, t := range tags {
		if t != v1.DefaultTag(key) {
			out = append(out, repo+":"+t)
		}
	}
	return out
}
