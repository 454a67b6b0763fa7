package naming

import (
	"errors"
	"strings"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

func TestRepository(t *testing.T) {
	t.Parallel()
	req := func(image string) *v1.Request { return &v1.Request{Tenant: "acme", Name: "web", Image: image} }
	cases := []struct {
		name   string
		policy Policy
		req    *v1.Request
		want   string
	}{
		{"explicit repository wins", Policy{Registry: "r.example.com"}, req("other.example.com/x/y"), "other.example.com/x/y"},
		{"project mode uses the tenant", Policy{Registry: "harbor.example.com"}, req(""), "harbor.example.com/acme/web"},
		{"project mode with a fixed project", Policy{Registry: "ghcr.io", Project: "platform"}, req(""), "ghcr.io/platform/acme/web"},
		{"flat mode", Policy{Registry: "docker.io", Mode: ModeFlat, Prefix: "buildq/"}, req(""), "docker.io/buildq/acme_web"},
		{"flat mode without prefix", Policy{Registry: "127.0.0.1:5000", Mode: ModeFlat}, req(""), "127.0.0.1:5000/acme_web"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			got, err := c.policy.Repository(c.req)
			if err != nil || got != c.want {
				t.Fatalf("Repository() = %q, %v; want %q", got, err, c.want)
			}
		})
	}
	if _, err := (Policy{}).Repository(req("")); !errors.Is(err, ErrNoRepository) {
		t.Errorf("no registry, no image: %v", err)
	}
	if _, err := (Policy{Registry: "r.example.com", Mode: ModeFlat, Prefix: "UPPER/"}).Repository(req("")); err == nil {
		t.Error("an invalid generated repository was accepted")
	}
}

func TestHarborProject(t *testing.T) {
	t.Parallel()
	p := Policy{Registry: "harbor.example.com", Harbor: true}
	if got, ok := p.HarborProject("acme", "harbor.example.com/acme/web"); !ok || got != "acme" {
		t.Errorf("got %q %v", got, ok)
	}
	for _, repo := range []string{"other.example.com/acme/web", "harbor.example.com/web"} {
		if _, ok := p.HarborProject("acme", repo); ok {
			t.Errorf("%s: project ensured outside the policy's registry", repo)
		}
	}
	// Another tenant's project is never created on this tenant's behalf.
	if _, ok := p.HarborProject("mallory", "harbor.example.com/acme/web"); ok {
		t.Error("mallory's request would create acme's project")
	}
	fixed := Policy{Registry: "harbor.example.com", Harbor: true, Project: "builds"}
	if got, ok := fixed.HarborProject("acme", "harbor.example.com/builds/acme/web"); !ok || got != "builds" {
		t.Errorf("fixed project: got %q %v", got, ok)
	}
	if _, ok := (Policy{Registry: "harbor.example.com"}).HarborProject("acme", "harbor.example.com/acme/web"); ok {
		t.Error("not Harbor, yet a project was ensured")
	}
	if _, ok := (Policy{Registry: "h.example.com", Harbor: true, Mode: ModeFlat}).HarborProject("acme", "h.example.com/acme_web"); ok {
		t.Error("flat mode has no projects")
	}
	if err := (Policy{Mode: "weird"}).Validate(); err == nil {
		t.Error("unknown mode accepted")
	}
}

func TestDestinations(t *testing.T) {
	t.Parallel()
	key := "0123456789abcdef"
	got := Destinations("r/x", key, []string{"v1", "0123456789ab"})
	if len(got) != 2 || got[0] != "r/x:0123456789ab" || got[1] != "r/x:v1" {
		t.Fatalf("%v", got)
	}
}

func TestCheckDestination(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		policy Policy
		tenant string
		repo   string
		ok     bool
	}{
		{"own project", Policy{Registry: "r.example.com"}, "acme", "r.example.com/acme/web", true},
		{"own project, nested", Policy{Registry: "r.example.com"}, "acme", "r.example.com/acme/team/web", true},
		{"another tenant's project", Policy{Registry: "r.example.com"}, "mallory", "r.example.com/acme/web", false},
		{"a tenant whose name prefixes another's", Policy{Registry: "r.example.com"}, "acm", "r.example.com/acme/web", false},
		{"another registry", Policy{Registry: "r.example.com"}, "acme", "evil.example.com/acme/web", false},
		{"the project itself, no repository", Policy{Registry: "r.example.com"}, "acme", "r.example.com/acme", false},
		{"fixed project", Policy{Registry: "ghcr.io", Project: "p"}, "acme", "ghcr.io/p/acme/web", true},
		{"fixed project, other tenant", Policy{Registry: "ghcr.io", Project: "p"}, "mallory", "ghcr.io/p/acme/web", false},
		{"flat", Policy{Registry: "docker.io", Mode: ModeFlat, Prefix: "org/"}, "acme", "docker.io/org/acme_web", true},
		{"flat, other tenant", Policy{Registry: "docker.io", Mode: ModeFlat, Prefix: "org/"}, "mallory", "docker.io/org/acme_web", false},
		{"flat, no nesting", Policy{Registry: "docker.io", Mode: ModeFlat, Prefix: "org/"}, "acme", "docker.io/org/acme_web/x", false},
		{"no registry allows nothing", Policy{}, "acme", "r.example.com/acme/web", false},
		{"explicit patterns", Policy{Registry: "r.example.com", Allowed: []string{"{registry}/shared/{tenant}-*", "cache.example.com/**"}}, "acme", "cache.example.com/x/y", true},
		{"explicit patterns replace the default", Policy{Registry: "r.example.com", Allowed: []string{"{registry}/shared/{tenant}-*"}}, "acme", "r.example.com/acme/web", false},
		{"a dot in a pattern is literal", Policy{Allowed: []string{"r.example.com/{tenant}/*"}}, "acme", "rxexample.com/acme/web", false},
		{"a pattern's registry outside the allowed registries", Policy{Registry: "r.example.com", Registries: []string{"r.example.com"}, Allowed: []string{"{registry}/{tenant}/**", "10.0.0.5:5000/**"}}, "acme", "10.0.0.5:5000/acme/web", false},
		{"an allowed registry", Policy{Registry: "r.example.com", Registries: []string{"R.example.com"}}, "acme", "r.example.com/acme/web", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			err := c.policy.CheckDestination(c.tenant, c.repo)
			if c.ok != (err == nil) {
				t.Fatalf("CheckDestination(%q, %q) = %v, want ok=%v", c.tenant, c.repo, err, c.ok)
			}
			if err != nil && !errors.Is(err, ErrDestinationNotAllowed) {
				t.Fatalf("error %v does not match ErrDestinationNotAllowed", err)
			}
		})
	}
	err := Policy{Registry: "r.example.com"}.CheckDestination("mallory", "r.example.com/acme/web")
	if err == nil || !strings.Contains(err.Error(), "r.example.com/mallory/**") {
		t.Errorf("the refusal does not name the allowed pattern: %v", err)
	}
	for _, bad := range []Policy{{Allowed: []string{"{registry}/{tenant}/**"}}, {Registry: "r.example.com", Allowed: []string{"{project}/x"}}, {Allowed: []string{""}}} {
		if bad.Validate() == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}
