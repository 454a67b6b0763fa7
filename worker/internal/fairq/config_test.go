package fairq

import (
	"strings"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

func TestWeightDefaultsToOneAndStarAppliesToUnnamedTenants(t *testing.T) {
	var none Config
	if w := none.Weight("acme"); w != 1 {
		t.Fatalf("Weight without rules = %d, want 1", w)
	}
	c := Config{Weights: map[string]int{"acme": 3}}
	if c.Weight("acme") != 3 || c.Weight("other") != 1 {
		t.Fatalf("Weight(acme, other) = %d, %d; want 3, 1", c.Weight("acme"), c.Weight("other"))
	}
	c = Config{Weights: map[string]int{"acme": 3, "*": 2}}
	if c.Weight("acme") != 3 || c.Weight("other") != 2 {
		t.Fatalf("with *: Weight(acme, other) = %d, %d; want 3, 2", c.Weight("acme"), c.Weight("other"))
	}
	// A weight below 1 (refused by Validate) still counts as 1: the
	// dispatcher divides by it.
	c = Config{Weights: map[string]int{"acme": 0, "*": -4}}
	if c.Weight("acme") != 1 || c.Weight("other") != 1 {
		t.Fatalf("Weight of 0 and -4 = %d, %d; want 1, 1", c.Weight("acme"), c.Weight("other"))
	}
}

func TestConcurrencyOfIsTheNamedOrStarLimitAndNoneForInvalidRequests(t *testing.T) {
	var none Config
	if n := none.ConcurrencyOf("acme"); n != 0 {
		t.Fatalf("ConcurrencyOf without rules = %d, want 0 (no limit)", n)
	}
	c := Config{Concurrency: map[string]int{"acme": 2, "*": 5, "free": 0}}
	for tenant, want := range map[string]int{"acme": 2, "other": 5, "free": 0} {
		if got := c.ConcurrencyOf(tenant); got != want {
			t.Errorf("ConcurrencyOf(%s) = %d, want %d", tenant, got, want)
		}
	}
	// Requests whose subject names no tenant are only answered: no limit
	// holds them back.
	if got := c.ConcurrencyOf(invalidTenant); got != 0 {
		t.Fatalf("ConcurrencyOf(%s) = %d, want 0", invalidTenant, got)
	}
	if v1.DNSLabelProblem(invalidTenant) == "" {
		t.Fatalf("%q is a valid tenant name: a tenant could be called it", invalidTenant)
	}
}

func TestQueueLimitOfIsTheNamedOrStarLimit(t *testing.T) {
	var none Config
	if n := none.QueueLimitOf("acme"); n != 0 {
		t.Fatalf("QueueLimitOf without rules = %d, want 0 (no limit)", n)
	}
	c := Config{QueueLimit: map[string]int{"acme": 10, "*": 100, "free": 0}}
	for tenant, want := range map[string]int{"acme": 10, "other": 100, "free": 0} {
		if got := c.QueueLimitOf(tenant); got != want {
			t.Errorf("QueueLimitOf(%s) = %d, want %d", tenant, got, want)
		}
	}
}

func TestValidateAcceptsGoodRules(t *testing.T) {
	for _, c := range []Config{
		{},
		{Weights: map[string]int{"acme": 1, "*": 3, "team-2": 100}},
		{Concurrency: map[string]int{"acme": 0, "*": 4}},
		{QueueLimit: map[string]int{"acme": 0, "*": 1000}},
		{Weights: map[string]int{strings.Repeat("a", 63): 2}},
	} {
		if err := c.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v, want nil", c, err)
		}
	}
}

// Validate refuses weights below 1, negative limits, and keys that are
// neither a tenant (a DNS-1123 label) nor "*" — and reports every one.
func TestValidateRefusesBadRulesAndReportsEach(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
		want []string
	}{
		{"weight 0", Config{Weights: map[string]int{"acme": 0}}, []string{"tenant weight of acme must be at least 1, got 0"}},
		{"negative * weight", Config{Weights: map[string]int{"*": -1}}, []string{"tenant weight of * must be at least 1"}},
		{"negative concurrency", Config{Concurrency: map[string]int{"acme": -1}}, []string{"tenant concurrency of acme must be at least 0, got -1"}},
		{"negative queue limit", Config{QueueLimit: map[string]int{"*": -5}}, []string{"tenant queue limit of * must be at least 0, got -5"}},
		{"uppercase tenant", Config{Weights: map[string]int{"Acme": 1}}, []string{`tenant weight: "Acme" is not a tenant`}},
		{"empty tenant", Config{Concurrency: map[string]int{"": 1}}, []string{`tenant concurrency: "" is not a tenant`}},
		{"dotted tenant", Config{QueueLimit: map[string]int{"a.b": 1}}, []string{`tenant queue limit: "a.b" is not a tenant`}},
		{"wildcard tenant", Config{QueueLimit: map[string]int{">": 1}}, []string{`">" is not a tenant`}},
		{"too long tenant", Config{Weights: map[string]int{strings.Repeat("a", 64): 1}}, []string{"is not a tenant"}},
		{"two of a kind", Config{Weights: map[string]int{"acme": 0, "Bad": 0}}, []string{
			"tenant weight of acme must be at least 1", `"Bad" is not a tenant`, "tenant weight of Bad must be at least 1"}},
		{"all three", Config{Weights: map[string]int{"a": 0}, Concurrency: map[string]int{"b": -1}, QueueLimit: map[string]int{"c": -1}}, []string{
			"tenant weight of a", "tenant concurrency of b", "tenant queue limit of c"}},
	} {
		err := c.cfg.Validate()
		if err == nil {
			t.Errorf("%s: Validate = nil, want an error", c.name)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: Validate = %q, want it to say %q", c.name, err, w)
			}
		}
	}
}

func TestQueueSubjectAndDispatchConsumerNames(t *testing.T) {
	if got := QueueSubject("acme", v1.PriorityHigh); got != "buildq.queue.acme.high" {
		t.Fatalf("QueueSubject = %q", got)
	}
	if !strings.HasPrefix(QueueSubject("acme", "low"), v1.QueuePrefix+".") {
		t.Fatal("a queue subject is not under the queue stream's subjects")
	}
	if got := DispatchConsumer("acme", v1.PriorityLow); got != "buildq-q-low-acme" {
		t.Fatalf("DispatchConsumer = %q", got)
	}
	// Every tenant's priorities have consumers of their own (tenants are
	// DNS labels: no dots, no clash with the priority in front).
	seen := map[string]bool{}
	for _, tenant := range []string{"acme", "low-acme", "a", "normal"} {
		for _, p := range v1.Priorities {
			n := DispatchConsumer(tenant, p)
			if seen[n] || strings.ContainsAny(n, ".*> ") {
				t.Fatalf("DispatchConsumer(%s, %s) = %q: taken already, or not a valid consumer name", tenant, p, n)
			}
			seen[n] = true
		}
	}
}
