package natsconf

import (
	"strings"
	"testing"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

func TestCheckTenantsRefuses(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		tenants []string
		want    string
	}{
		"empty list":      {nil, "no tenants"},
		"empty name":      {[]string{"acme", ""}, "tenant is required"},
		"dot":             {[]string{"a.b"}, "DNS-1123"},
		"wildcard":        {[]string{"*"}, "DNS-1123"},
		"full wildcard":   {[]string{">"}, "DNS-1123"},
		"upper case":      {[]string{"Acme"}, "DNS-1123"},
		"underscore":      {[]string{"a_b"}, "DNS-1123"},
		"space":           {[]string{"a b"}, "DNS-1123"},
		"leading dash":    {[]string{"-acme"}, "DNS-1123"},
		"too long":        {[]string{strings.Repeat("a", 64)}, "more than 63"},
		"duplicate":       {[]string{"acme", "globex", "acme"}, `"acme" is given twice`},
		"reserved worker": {[]string{"worker"}, "taken"},
		"reserved admin":  {[]string{"admin"}, "taken"},
		"reserved sys":    {[]string{"sys"}, "taken"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			err := CheckTenants(c.tenants)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("CheckTenants(%q) = %v, want an error with %q", c.tenants, err, c.want)
			}
			if _, err := ServerConfig(ConfigOptions{Tenants: c.tenants}); err == nil {
				t.Errorf("ServerConfig(%q) made a configuration", c.tenants)
			}
			if _, err := NewJWTSetup(c.tenants); err == nil {
				t.Errorf("NewJWTSetup(%q) made a setup", c.tenants)
			}
		})
	}
	if err := CheckTenants([]string{"acme", "a-b", "x", strings.Repeat("a", 63), "0"}); err != nil {
		t.Fatal(err)
	}
}

func TestNKeyVar(t *testing.T) {
	t.Parallel()
	for user, want := range map[string]string{
		"worker": "BUILDQ_WORKER_NKEY", "acme": "BUILDQ_ACME_NKEY", "my-tenant-2": "BUILDQ_MY_TENANT_2_NKEY",
	} {
		if got := NKeyVar(user); got != want {
			t.Errorf("NKeyVar(%q) = %q, want %q", user, got, want)
		}
	}
}

func TestServerConfigRefusesBadKeys(t *testing.T) {
	t.Parallel()
	keys, err := NewUserKeys([]string{"acme"})
	if err != nil {
		t.Fatal(err)
	}
	acct, _ := nkeys.CreateAccount()
	acctPub, _ := acct.PublicKey()
	for name, nk := range map[string]map[string]string{
		"unknown user":   {"globex": keys[0].Public},
		"account key":    {"acme": acctPub},
		"seed":           {"acme": string(keys[0].Seed)},
		"not a key":      {"acme": "hello"},
		"quote breakout": {"acme": `U" } { nkey: "x`},
	} {
		if _, err := ServerConfig(ConfigOptions{Tenants: []string{"acme"}, NKeys: nk}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestServerConfigLiteralKeys(t *testing.T) {
	t.Parallel()
	tenants := []string{"acme", "globex"}
	keys, err := NewUserKeys(Users(tenants))
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		kp, err := nkeys.FromSeed(k.Seed)
		if err != nil {
			t.Fatal(err)
		}
		if pub, _ := kp.PublicKey(); pub != k.Public || !nkeys.IsValidPublicUserKey(pub) {
			t.Fatalf("%s: seed's public key %s, key %s", k.User, pub, k.Public)
		}
	}
	b, err := ServerConfig(ConfigOptions{Tenants: tenants, NKeys: PublicKeys(keys)})
	if err != nil {
		t.Fatal(err)
	}
	conf := string(b)
	for _, k := range keys {
		if strings.Count(conf, `nkey: "`+k.Public+`"`) != 1 {
			t.Errorf("%s's public key is not in the configuration once", k.User)
		}
		if strings.Contains(conf, string(k.Seed)) {
			t.Errorf("%s's seed is in the configuration", k.User)
		}
	}
	if strings.Contains(conf, "nkey: $") {
		t.Errorf("variables left:\n%s", conf)
	}
}

func TestJWTSetupRoundTrip(t *testing.T) {
	t.Parallel()
	s, err := NewJWTSetup([]string{"acme", "globex"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.AddTenants([]string{"acme"}); err == nil {
		t.Fatal("acme added twice")
	}
	files, err := s.Files()
	if err != nil {
		t.Fatal(err)
	}
	m := map[string][]byte{}
	for _, f := range files {
		if strings.HasSuffix(f.Path, ".nk") != f.Secret {
			t.Errorf("%s: secret %v", f.Path, f.Secret)
		}
		m[f.Path] = f.Data
	}
	if !IsSetup(m) {
		t.Fatal("IsSetup: false")
	}
	got, err := LoadJWTSetup(m)
	if err != nil {
		t.Fatal(err)
	}
	if got.OperatorJWT != s.OperatorJWT || got.Buildq.JWT != s.Buildq.JWT || got.System.JWT != s.System.JWT ||
		strings.Join(got.TenantNames(), ",") != "acme,globex" {
		t.Fatalf("loaded %+v, want %+v", got, s)
	}
	// BUILDQ's JWT does not change when a tenant is added.
	before := got.Buildq.JWT
	added, err := got.AddTenants([]string{"initech"})
	if err != nil || len(added) != 1 || got.Buildq.JWT != before {
		t.Fatalf("AddTenants: %v %v", added, err)
	}
	ac, err := jwt.DecodeAccountClaims(added[0].JWT)
	if err != nil {
		t.Fatal(err)
	}
	vr := jwt.CreateValidationResults()
	ac.Validate(vr)
	if vr.IsBlocking(true) || len(ac.Imports) != len(TenantServices("initech"))+len(TenantStreams("initech")) || ac.Name != "tenant-initech" {
		t.Fatalf("initech's account: %v %+v", vr.Errors(), ac)
	}
	for _, imp := range ac.Imports {
		if !strings.Contains(string(imp.Subject), ".initech") || imp.Token == "" || imp.Account != got.Buildq.PublicKey() {
			t.Errorf("import %+v", imp)
		}
	}
	// A JWT that is not the key's is refused.
	m["accounts/tenant-acme.jwt"] = []byte(got.Buildq.JWT)
	if _, err := LoadJWTSetup(m); err == nil {
		t.Fatal("loaded a setup whose acme JWT is BUILDQ's")
	}
	delete(m, "keys/operator.nk")
	if IsSetup(m) {
		t.Fatal("IsSetup without the operator's key")
	}
	if _, err := s.UserCreds("nobody"); err == nil {
		t.Fatal("creds of an unknown user")
	}
}

func TestWrap(t *testing.T) {
	t.Parallel()
	got := wrap("aaa bbb ccc dddddddddddd e", 9, "> ", "  ")
	want := []string{"> aaa bbb", "  ccc", "  dddddddddddd", "  e"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("%q", got)
	}
}
