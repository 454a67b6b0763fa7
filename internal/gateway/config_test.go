package gateway

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/nats-io/nkeys"
	"github.com/nats-io/nuid"
)

// configDir is a directory with the files a configuration names: secrets,
// a seed, a creds file.
func configDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "key"), strings.Repeat("x", 32)+"\n")
	writeFile(t, filepath.Join(dir, "short"), "tooshort")
	writeFile(t, filepath.Join(dir, "hook"), "s3cr3t-hook-value\n")
	writeFile(t, filepath.Join(dir, "empty"), "\n\n")
	writeFile(t, filepath.Join(dir, "password"), "pa55w0rd-value\n")
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	writeFile(t, filepath.Join(dir, "acme.seed"), string(seed))
	acct, _ := nkeys.CreateAccount()
	aseed, _ := acct.Seed()
	writeFile(t, filepath.Join(dir, "account.seed"), string(aseed))
	writeFile(t, filepath.Join(dir, "bad.creds"), "not a creds file")
	return dir
}

// A full configuration loads: secrets read and trimmed, relative paths
// made absolute, and nothing lacking for production.
func TestConfigLoads(t *testing.T) {
	t.Parallel()
	dir := configDir(t)
	writeFile(t, filepath.Join(dir, "gateway.yaml"), `
msgIdKeyFile: key
tenants:
  - name: acme
    auth:
      tokenSHA256: ["`+tokenHash("t1")+`", "sha256:`+strings.ToUpper(tokenHash("t2"))+`"]
      clientCertSubjects: ["CN=ci.acme.example,O=Acme"]
    nats: {nkeySeedFile: acme.seed}
    webhooks:
      github: {secretFile: hook}
      gitlab: {secretFile: `+filepath.Join(dir, "hook")+`}
    triggers:
      - {repository: "https://github.com/acme/web", name: web, branches: [main], tags: ["v*"]}
  - name: globex
    auth: {tokenSHA256: ["`+tokenHash("t3")+`"]}
    nats: {user: globex-gw, passwordFile: password}
`)
	s, err := Load(filepath.Join(dir, "gateway.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ProductionProblems(); err != nil {
		t.Fatalf("production problems: %v", err)
	}
	if len(s.Tenants) != 2 || string(s.MsgIDKey) != strings.Repeat("x", 32) {
		t.Fatalf("settings %+v", s)
	}
	acme, globex := s.Tenants[0], s.Tenants[1]
	if acme.NATS.NKeySeedFile != filepath.Join(dir, "acme.seed") || string(acme.githubSecret) != "s3cr3t-hook-value" || string(acme.gitlabToken) != "s3cr3t-hook-value" {
		t.Errorf("acme %+v", acme)
	}
	if len(acme.tokens) != 2 || len(acme.subjects) != 1 || acme.repos[0] != "github.com/acme/web" || !s.HasClientCertSubjects() {
		t.Errorf("acme's credentials %d tokens %v subjects %v", len(acme.tokens), acme.subjects, acme.repos)
	}
	if globex.password != "pa55w0rd-value" || globex.NATS.User != "globex-gw" {
		t.Errorf("globex %+v", globex.NATS)
	}
	for _, tn := range s.Tenants {
		opts, err := tn.NATSOptions()
		if err != nil || len(opts) != 1 {
			t.Errorf("%s: NATS options %d, %v", tn.Name, len(opts), err)
		}
	}
}

// Every problem of a configuration is reported at once, each with its
// place in the file, and no secret is part of an error.
func TestConfigRefuses(t *testing.T) {
	t.Parallel()
	dir := configDir(t)
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"not YAML of the format", "tenants: [{name: acme, colour: blue}]", []string{`unknown field "colour"`}},
		{"no tenants", "tenants: []", []string{"tenants: is empty"}},
		{"bad names", `
tenants:
  - name: Acme
  - name: worker
  - name: ok
  - name: ok
`, []string{"tenants[0].name: tenant", "DNS-1123", "tenants[1].name: tenant \"worker\": the name is taken", "tenants[3].name: tenant \"ok\" is also tenants[2]"}},
		{"key files", `
msgIdKeyFile: short
tenants: [{name: acme}]
`, []string{"msgIdKeyFile: holds 8 bytes, fewer than 32"}},
		{"missing and empty secrets", `
msgIdKeyFile: nope
tenants:
  - name: acme
    webhooks: {github: {secretFile: empty}, gitlab: {secretFile: ""}}
`, []string{"msgIdKeyFile: open", "webhooks.github.secretFile: empty is empty", "webhooks.gitlab.secretFile: is required"}},
		{"tokens", `
tenants:
  - name: acme
    auth: {tokenSHA256: ["abc", "` + tokenHash("t") + `"], clientCertSubjects: ["CN=x", " CN=y"]}
  - name: globex
    auth: {tokenSHA256: ["` + tokenHash("t") + `"], clientCertSubjects: ["CN=x"]}
`, []string{"tenants[0] (acme).auth.tokenSHA256[0]: is not a SHA-256 hash", "tenants[1] (globex).auth.tokenSHA256[0]: the same token is also given for tenants[0] (acme)",
			"clientCertSubjects[1]: must be a certificate subject", `tenants[1] (globex).auth.clientCertSubjects[0]: "CN=x" is also given`}},
		{"identities", `
tenants:
  - name: a
    nats: {credsFile: bad.creds, nkeySeedFile: acme.seed}
  - name: b
    nats: {credsFile: bad.creds}
  - name: c
    nats: {nkeySeedFile: account.seed}
  - name: d
    nats: {passwordFile: password}
  - name: e
    nats: {nkeySeedFile: hook}
`, []string{"tenants[0] (a).nats: give one of", "tenants[1] (b).nats.credsFile: bad.creds holds no user JWT", "tenants[2] (c).nats.nkeySeedFile: account.seed holds no user seed",
			"tenants[3] (d).nats.user: is required with passwordFile", "tenants[4] (e).nats.nkeySeedFile: hook holds no nkey seed"}},
		{"triggers", `
tenants:
  - name: acme
    webhooks: {github: {secretFile: hook}}
    triggers:
      - {repository: "git@github.com:acme/web.git", name: web}
      - {repository: "https://user:pw@github.com/acme/web", name: web}
      - {repository: "https://github.com/acme/web", name: Web_1, platforms: [plan9/mips], subPath: ../up, dockerfile: /abs, buildArgs: {"1x": y}}
      - {repository: "https://github.com/acme/web", name: web, branches: ["[main"], tags: [""]}
      - {repository: "https://github.com/acme/web.git", name: web}
      - {repository: "https://github.com/", name: web}
      - {name: web}
  - name: globex
    triggers: [{repository: "https://github.com/globex/x", name: x}]
`, []string{"triggers[0].repository: \"git@github.com:acme/web.git\": want an https://, http:// or ssh:// URL",
			"triggers[1].repository: must not hold credentials", "triggers[2].name:", "triggers[2].platforms:", "triggers[2].subPath:", "triggers[2].dockerfile:", "triggers[2].buildArgs:",
			"triggers[3].branches[0]: \"[main\" is not a glob pattern", "triggers[3].tags[0]", "triggers[4]: builds what triggers[3] builds",
			"triggers[5].repository: \"https://github.com/\" names no repository path", "triggers[6].repository: is required",
			"tenants[1] (globex).triggers: are only used by webhooks"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml), dir)
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the error does not say %q:\n%v", w, err)
				}
			}
			for _, secret := range []string{"s3cr3t-hook-value", "pa55w0rd-value", "pw@", "not a creds file"} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("the error holds a secret (%q):\n%v", secret, err)
				}
			}
		})
	}
}

// What `buildq gateway` needs beyond a valid file: a msgIdKeyFile, each
// tenant's own NATS identity, a way in for each tenant.
func TestConfigProductionProblems(t *testing.T) {
	t.Parallel()
	s, err := Parse([]byte("tenants: [{name: acme}]"), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	err = s.ProductionProblems()
	for _, want := range []string{"msgIdKeyFile: is required", "tenant acme: nats: give its own NATS identity", "tenant acme: no way in"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ProductionProblems %v, want %q", err, want)
		}
	}
}

// The example configuration deploy/components/gateway ships is valid once
// its placeholders (the token hashes) are filled in and its Secrets are
// mounted, and is one `buildq gateway` takes.
func TestShippedConfigLoads(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "components", "gateway", "gateway-config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	mount := t.TempDir()
	text := strings.ReplaceAll(string(b), "/etc/buildq/gateway/secrets", mount)
	placeholder := regexp.MustCompile(`"REPLACE-[^"]*"`)
	if n := len(placeholder.FindAllString(text, -1)); n != 2 {
		t.Fatalf("%d placeholders, want the two token hashes", n)
	}
	text = placeholder.ReplaceAllStringFunc(text, func(string) string { return `"` + tokenHash(nuid.Next()) + `"` })
	kp, _ := nkeys.CreateUser()
	seed, _ := kp.Seed()
	for p, content := range map[string]string{"msgid/key": strings.Repeat("r", 44), "acme/nats.seed": string(seed), "acme/github-secret": "s",
		"globex/nats.seed": string(seed)} {
		if err := os.MkdirAll(filepath.Join(mount, filepath.Dir(p)), 0o700); err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(mount, p), content)
	}
	s, err := Parse([]byte(text), t.TempDir())
	if err != nil {
		t.Fatalf("the shipped configuration: %v", err)
	}
	if err := s.ProductionProblems(); err != nil {
		t.Fatalf("the shipped configuration: %v", err)
	}
	// As shipped (placeholders in place) it is refused, naming them.
	if _, err := Parse(b, t.TempDir()); err == nil || !strings.Contains(err.Error(), "tokenSHA256[0]: is not a SHA-256 hash") {
		t.Fatalf("the placeholders were accepted: %v", err)
	}
}
