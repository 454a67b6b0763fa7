package naming

import (
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

// Attack: in flat mode a tenant's repositories are
// {registry}/{prefix}{tenant}-{name}, and the default allowed pattern is
// {registry}/{prefix}{tenant}-*. Tenant names and build names are DNS-1123
// labels, which may hold '-', so the split is ambiguous: a tenant who
// registers as "acme-web" is allowed {registry}/acme-web-*, which holds
// acme's own repository for its build "web-api" (acme-web-api) — she pushes
// there, moves its tags, and answers acme's preflight with her image.
// Breaks invariant 8 ("a request writes only where its tenant may write").
func TestAttackFlatModeTenantPrefixReachesAnotherTenantsRepository(t *testing.T) {
	t.Parallel()
	for _, p := range []Policy{
		{Registry: "127.0.0.1:5000", Mode: ModeFlat},
		{Registry: "docker.io", Mode: ModeFlat, Prefix: "buildq/"},
	} {
		victim, err := p.Repository(&v1.Request{Tenant: "acme", Name: "web-api"})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.CheckDestination("acme", victim); err != nil {
			t.Fatalf("acme may not push to its own %s: %v", victim, err)
		}
		if err := p.CheckDestination("acme-web", victim); err == nil {
			t.Errorf("%+v: tenant acme-web may push to %s, acme's repository for its build web-api", p, victim)
		}
	}
}
