// Package naming decides where a build's image is pushed when the request
// names no repository (DESIGN §5), and where a tenant may push at all.
package naming

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"

	v1 "github.com/buildq/buildq/api/v1"
)

// Modes of the naming policy.
const (
	// ModeProject: {registry}/{tenant}/{name}, or with a fixed Project
	// {registry}/{project}/{tenant}/{name} (Harbor, GHCR, GCR).
	ModeProject = "project"
	// ModeFlat: {registry}/{prefix}{tenant}_{name} (Docker Hub style, one
	// namespace for everyone). The separator is "_", which no tenant or
	// name (DNS labels) holds, so one tenant's repositories never match
	// another's pattern (with "-", tenant "acme-web" would own acme's
	// "web-api").
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
	// Allowed replaces the default destination patterns (see
	// AllowedPatterns). A pattern is a repository with the placeholders
	// {registry}, {tenant} and {project}; "*" matches within one path
	// segment, "**" across segments.
	Allowed []string
	// Registries, when not empty, are the only registries (host[:port])
	// the worker contacts for a request: a destination elsewhere is
	// refused whatever the patterns say, and so is a base image elsewhere
	// in the local executor.
	Registries []string
}

// AllowedPatterns are the patterns every destination repository of a
// request must match, placeholders not yet expanded: Allowed, or by
// default the tenant's own part of the registry — {registry}/{tenant}/**
// in project mode ({registry}/{project}/{tenant}/** with a fixed project),
// {registry}/{prefix}{tenant}_* in flat mode, and nothing at all without a
// registry.
func (p Policy) AllowedPatterns() []string {
	switch {
	case len(p.Allowed) > 0:
		return p.Allowed
	case p.Registry == "":
		return nil
	case p.Mode == ModeFlat:
		return []string{"{registry}/" + p.Prefix + "{tenant}_*"}
	case p.Project != "":
		return []string{"{registry}/{project}/{tenant}/**"}
	default:
		return []string{"{registry}/{tenant}/**"}
	}
}

// ErrDestinationNotAllowed matches the error of a destination outside what
// the policy gives the tenant.
var ErrDestinationNotAllowed = errors.New("destination not allowed")

// CheckDestination reports whether tenant may push to repo.
func (p Policy) CheckDestination(tenant, repo string) error {
	if len(p.Registries) > 0 {
		host, _, _ := strings.Cut(repo, "/")
		if !slices.ContainsFunc(p.Registries, func(r string) bool { return strings.EqualFold(r, host) }) {
			return fmt.Errorf("%w: registry %s is not one this worker contacts (--allowed-registry: %s)", ErrDestinationNotAllowed, host, strings.Join(p.Registries, ", "))
		}
	}
	pats := p.AllowedPatterns()
	var shown []string
	for _, pat := range pats {
		exp := p.expand(pat, tenant)
		if matchPattern(exp, repo) {
			return nil
		}
		shown = append(shown, exp)
	}
	if len(shown) == 0 {
		return fmt.Errorf("%w: this worker allows no destination (it has no --registry and no --allowed-destination)", ErrDestinationNotAllowed)
	}
	return fmt.Errorf("%w: tenant %q may push only to %s, not to %s", ErrDestinationNotAllowed, tenant, strings.Join(shown, " or "), repo)
}

func (p Policy) expand(pat, tenant string) string {
	return strings.NewReplacer("{registry}", p.Registry, "{tenant}", tenant, "{project}", p.Project).Replace(pat)
}

// matchPattern reports whether s matches an expanded pattern: "**"
// matches one or more of any character, "*" one or more but "/",
// everything else itself (as the regular expression ^…$ with ".+",
// "[^/]+" and the rest quoted would). Matched directly: a request's
// destination is checked on every request, cache hits at intake
// included, and compiling the pattern each time cost more than the rest
// of the check.
func matchPattern(pat, s string) bool {
	for len(pat) > 0 {
		switch {
		case strings.HasPrefix(pat, "**"):
			for i := 1; i <= len(s); i++ {
				if matchPattern(pat[2:], s[i:]) {
					return true
				}
			}
			return false
		case pat[0] == '*':
			for i := 1; i <= len(s) && s[i-1] != '/'; i++ {
				if matchPattern(pat[1:], s[i:]) {
					return true
				}
			}
			return false
		case len(s) == 0 || s[0] != pat[0]:
			return false
		default:
			pat, s = pat[1:], s[1:]
		}
	}
	return s == ""
}

// HarborProject returns the Harbor project a repository of this policy's
// registry lives in, and whether one must be ensured. Only the tenant's
// own project, or the configured fixed one, is ever created.
func (p Policy) HarborProject(tenant, repo string) (string, bool) {
	if !p.Harbor || p.Mode == ModeFlat || p.Registry == "" || !strings.HasPrefix(repo, p.Registry+"/") {
		return "", false
	}
	rest := strings.TrimPrefix(repo, p.Registry+"/")
	project, _, ok := strings.Cut(rest, "/")
	if !ok || project == "" || (project != tenant && (p.Project == "" || project != p.Project)) {
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
	for _, pat := range p.Allowed {
		if strings.Contains(pat, "{registry}") && p.Registry == "" {
			return fmt.Errorf("allowed destination %q uses {registry} but no registry is configured", pat)
		}
		if strings.Contains(pat, "{project}") && p.Project == "" {
			return fmt.Errorf("allowed destination %q uses {project} but no naming project is configured", pat)
		}
		if strings.Contains(pat, "***") || strings.ContainsAny(pat, " \t\n") || pat == "" {
			return fmt.Errorf("allowed destination %q is not a valid pattern", pat)
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
		repo = p.Registry + "/" + p.Prefix + r.Tenant + "_" + r.Name
	default:
		repo = p.Registry + "/" + r.Tenant + "/" + r.Name
		if p.Project != "" {
			// A shared project still keeps tenants apart, one path
			// segment each.
			repo = p.Registry + "/" + p.Project + "/" + r.Tenant + "/" + r.Name
		}
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
