package naming

import (
	"errors"
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
		{"project mode with a fixed project", Policy{Registry: "ghcr.io", Project: "platform"}, req(""), "ghcr.io/platform/web"},
		{"flat mode", Policy{Registry: "docker.io", Mode: ModeFlat, Prefix: "buildq/"}, req(""), "docker.io/buildq/acme-web"},
		{"flat mode without prefix", Policy{Registry: "127.0.0.1:5000", Mode: ModeFlat}, req(""), "127.0.0.1:5000/acme-web"},
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
	if got, ok := p.HarborProject("harbor.example.com/acme/web"); !ok || got != "acme" {
		t.Errorf("got %q %v", got, ok)
	}
	for _, repo := range []string{"other.example.com/acme/web", "harbor.example.com/web"} {
		if _, ok := p.HarborProject(repo); ok {
			t.Errorf("%s: project ensured outside the policy's registry", repo)
		}
	}
	if _, ok := (Policy{Registry: "harbor.example.com"}).HarborProject("harbor.example.com/acme/web"); ok {
		t.Error("not Harbor, yet a project was ensured")
	}
	if _, ok := (Policy{Registry: "h.example.com", Harbor: true, Mode: ModeFlat}).HarborProject("h.example.com/acme-web"); ok {
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
