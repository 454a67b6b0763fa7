package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/buildq/buildq/internal/natsconf"
)

// An operator using `buildq nats-config` (and starting workers) as
// deploy/nats/README.md and --help say, with bad inputs, re-runs, failed
// pushes and interrupted runs. Tests whose name says "Attack" demonstrate a
// break and fail on 26b1795; the others are handled and stay as
// regression tests.

// ---- breaks ----

// Attack (a multi-tenant worker that checks nothing of whose object a
// request names): `buildq worker` refuses at start what is safe for one
// trusted tenant only unless --single-tenant (a shared registry Secret, a
// --cache-repo without {tenant}, no --fetch-image), but takes
// --context-prefix "" — "empty: any key" — as it is: a request may then
// name any tenant's context object (the worker's decode), so one tenant
// builds another's private context into its own repository, and the
// possession check reads the other tenant's object as the requester's
// proof (worker/worker_config_test.go,
// TestEmptyContextPrefixIsRefusedWhenPossessionIsChecked).
// Here the worker gets past every start check and fails only on the
// missing cluster, exactly as the same worker with the default prefix.
func TestAttackWorkerAcceptsAnyContextObjectWithoutSingleTenant(t *testing.T) {
	t.Parallel()
	configs := t.TempDir()
	args := []string{"worker",
		"--executor-image", "gcr.io/kaniko-project/executor@sha256:" + strings.Repeat("a", 64),
		"--fetch-image", "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("b", 64),
		"--s3-endpoint", "http://127.0.0.1:1", "--s3-access-key", "ak", "--s3-secret-key", "sk",
		"--tenant-registry-secret", "buildq-registry-{tenant}", "--tenant-registry-configs", configs,
		"--registry", "registry.example.com", "--kubeconfig", filepath.Join(t.TempDir(), "no-kubeconfig"),
		"--nats-url", "nats://127.0.0.1:1", "--log-level", "error"}
	// The control: the same worker with the default prefix also stops at
	// the cluster (its start checks pass: it is a valid multi-tenant
	// worker).
	code, _, controlErr := cli(t, args...)
	if code == 0 || strings.Contains(controlErr, "context-prefix") {
		t.Fatalf("control: exit %d, %s", code, controlErr)
	}
	code, _, stderr := cli(t, append(args, "--context-prefix=")...)
	if code != exitInvalid || !strings.Contains(stderr, "context-prefix") {
		t.Errorf("a multi-tenant worker (no --single-tenant) with an empty context prefix: exit %d, %q; "+
			"want it refused at start (exit %d) like the other single-tenant shortcuts", code, strings.TrimSpace(stderr), exitInvalid)
	}
}

// Attack (an interrupted add cannot be finished): adding tenant T in JWT
// mode writes T's account key and JWT, then creds/T.creds, then
// nats-server.conf, one file at a time (natsconfig.go:325-332). When a
// write after the account's fails — a full disk, an I/O error, the
// process killed; here creds/ is briefly not a directory — the command
// exits 1 having written keys/tenant-T.nk and accounts/tenant-T.jwt only.
// Run again as documented ("a retry is that command again"), T is an
// existing tenant (natsconfig.go:248-268: credentials are written for new
// tenants only): without --push the command refuses ("nothing to add",
// :257), with --push it rewrites the configuration, pushes T and then
// fails because creds/T.creds does not exist (asking whether the server
// runs the right operator); no run ever writes creds/T.creds or a nats-server.conf that
// preloads T. The operator is left deleting the account's files by hand.
func TestAttackNATSConfigInterruptedAddCannotBeFinished(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "nats")
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme"); code != 0 {
		t.Fatal(stderr)
	}
	url := startNATSFile(t, filepath.Join(dir, "nats-server.conf"))
	confBefore, _ := os.ReadFile(filepath.Join(dir, "nats-server.conf"))

	// The write of creds/globex.creds fails.
	creds := filepath.Join(dir, "creds")
	aside := filepath.Join(t.TempDir(), "creds")
	if err := os.Rename(creds, aside); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(creds, []byte("not a directory"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex")
	if code == 0 {
		t.Fatalf("the add succeeded with creds/ not a directory: %s", stderr)
	}
	// The trouble is gone; the operator runs the command again.
	if err := os.Remove(creds); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(aside, creds); err != nil {
		t.Fatal(err)
	}
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex")
	_, credsErr := os.Stat(filepath.Join(creds, "globex.creds"))
	conf, _ := os.ReadFile(filepath.Join(dir, "nats-server.conf"))
	if code != 0 || credsErr != nil || !strings.Contains(string(conf), "# tenant-globex\n") {
		t.Errorf("after a failed add of globex, the same command again: exit %d (%s); creds/globex.creds: %v; nats-server.conf preloads globex: %v (unchanged since before: %v)",
			code, strings.TrimSpace(stderr), credsErr, strings.Contains(string(conf), "# tenant-globex\n"), string(conf) == string(confBefore))
	}
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex", "--push", url)
	if _, err := os.Stat(filepath.Join(creds, "globex.creds")); code != 0 || err != nil {
		t.Errorf("and with --push: exit %d (%s); creds/globex.creds: %v", code, strings.TrimSpace(stderr), err)
	}
}

// Attack (a tenant list with a newline silently loses tenants): --tenant
// is a pflag StringSlice, which parses its value as one CSV record
// (pflag's readAsCSV reads the first record only): "acme\nglobex" — a
// list made from a file of one name per line, --tenant "$(cat tenants)"
// — is the tenant acme alone, with exit 0 and nothing on stderr. In
// config-file mode the file printed has no account for globex: put in
// place and the server restarted, as README says for adding a tenant,
// every tenant after the first line loses its account and user (its
// clients are refused, its requests stop). In JWT mode only acme's
// account is made. The names are checked one by one (CheckTenants), but
// never see the dropped ones.
func TestAttackNATSConfigNewlineInTenantListDropsTenants(t *testing.T) {
	t.Parallel()
	list := "acme\nglobex\ninitech"
	code, stdout, stderr := cli(t, "nats-config", "--tenant", list)
	if code == 0 && (!strings.Contains(stdout, `"tenant-globex" {`) || !strings.Contains(stdout, `"tenant-initech" {`)) {
		t.Errorf("--tenant %q: exit 0, stderr %q, and the configuration has accounts for %v only", list, stderr, accountsIn(stdout))
	}
	dir := filepath.Join(t.TempDir(), "nats")
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", list)
	if code == 0 {
		if _, err := os.Stat(filepath.Join(dir, "creds", "globex.creds")); err != nil {
			t.Errorf("--mode jwt --tenant %q: exit 0, stderr %q, and no globex: %v", list, strings.TrimSpace(stderr), err)
		}
	}
}

// accountsIn lists the tenant accounts of a config-file mode configuration.
func accountsIn(conf string) []string {
	var out []string
	for _, line := range strings.Split(conf, "\n") {
		if l := strings.TrimSpace(line); strings.HasPrefix(l, `"tenant-`) && strings.HasSuffix(l, `" {`) {
			out = append(out, strings.TrimSuffix(strings.TrimPrefix(l, `"`), `" {`))
		}
	}
	return out
}

// ---- handled: regression tests ----

// Bad names, modes and paths are refused before anything is written, and
// a path that is a file is left as it was.
func TestNATSConfigAttackBadInputs(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "a-file")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := map[string][]string{
		"leading dash":       {"--tenant", "-acme"},
		"trailing dash":      {"--tenant", "acme-"},
		"64 characters":      {"--tenant", strings.Repeat("a", 64)},
		"underscore":         {"--tenant", "ac_me"},
		"dot":                {"--tenant", "acme."},
		"non-ascii":          {"--tenant", "ácme"},
		"space":              {"--tenant", " acme"},
		"subject wildcard":   {"--tenant", "acme>"},
		"reserved in a list": {"--tenant", "acme,admin"},
		"reserved sys":       {"--tenant", "sys"},
		"upper-case mode":    {"--mode", "JWT", "--tenant", "acme"},
		"empty mode":         {"--mode", "", "--tenant", "acme"},
		"jwt dir is a file":  {"--mode", "jwt", "--dir", file, "--tenant", "acme"},
		"nkeys dir is file":  {"--nkeys", file, "--tenant", "acme"},
		"push to a new file": {"--mode", "jwt", "--dir", file, "--tenant", "acme", "--push", "nats://127.0.0.1:1"},
	}
	for name, args := range cases {
		t.Run(name, func(t *testing.T) {
			code, stdout, stderr := cli(t, append([]string{"nats-config"}, args...)...)
			if code == 0 || stdout != "" || !strings.HasPrefix(stderr, "buildq: ") {
				t.Fatalf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
			}
		})
	}
	if b, _ := os.ReadFile(file); string(b) != "keep me" {
		t.Fatalf("the file was changed: %q", b)
	}
}

// Seeds, keys and credentials are 0600 and their directories 0700 even
// under a umask of 0, in both modes, on the first run and when a tenant is
// added.
func TestNATSConfigAttackSecretsArePrivateUnderAnyUmask(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	base := t.TempDir()
	nk := filepath.Join(base, "deep", "keys")
	for _, tenants := range []string{"acme", "acme,globex"} {
		if code, _, stderr := cli(t, "nats-config", "--nkeys", nk, "--tenant", tenants); code != 0 {
			t.Fatal(stderr)
		}
	}
	dir := filepath.Join(base, "jwt", "nats")
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme"); code != 0 {
		t.Fatal(stderr)
	}
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex"); code != 0 {
		t.Fatal(stderr)
	}
	checked := 0
	for _, root := range []string{nk, dir} {
		err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			secret := strings.HasSuffix(p, ".seed") || strings.HasSuffix(p, ".nk") || strings.HasSuffix(p, ".creds")
			switch {
			case fi.IsDir() && rel != "." && fi.Mode().Perm() != 0o700:
				t.Errorf("%s: directory mode %v", p, fi.Mode().Perm())
			case secret && fi.Mode().Perm() != 0o600:
				t.Errorf("%s: mode %v", p, fi.Mode().Perm())
			case !fi.IsDir() && !secret && fi.Mode().Perm()&0o022 != 0:
				t.Errorf("%s: writable by others: %v", p, fi.Mode().Perm())
			}
			if secret {
				checked++
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// 4 seeds; operator, SYS, BUILDQ, acme, globex keys; worker, admin,
	// sys, acme, globex creds.
	if checked != 4+5+5 {
		t.Fatalf("%d secret files", checked)
	}
	if st, err := os.Stat(nk); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("--nkeys directory: %v %v", st, err)
	}
}

// A push to a server that is down (or a mistyped URL) fails with exit 1
// after the tenant's files are written; the same command with the right
// URL pushes it, and again is harmless.
func TestNATSConfigAttackPushToADownServerThenRetry(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "nats")
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme"); code != 0 {
		t.Fatal(stderr)
	}
	url := startNATSFile(t, filepath.Join(dir, "nats-server.conf"))
	creds := func(u string) nats.Option { return nats.UserCredentials(filepath.Join(dir, "creds", u+".creds")) }
	requestsStream(t, natsConnect(t, url, creds("worker")))

	down := "nats://" + freeAddr(t)
	code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex", "--push", down)
	if code != 1 || !strings.Contains(stderr, "connect to NATS at "+down) {
		t.Fatalf("push to a server that is down: exit %d, %s", code, stderr)
	}
	for _, bad := range []string{"nats://", "not a url at all"} {
		if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex", "--push", bad); code == 0 {
			t.Fatalf("push to %q: exit 0, %s", bad, stderr)
		}
	}
	for range 2 {
		code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex", "--push", url)
		if code != 0 || len(pushedRe.FindAllString(stderr, -1)) != 1 {
			t.Fatalf("retry: exit %d, %s", code, stderr)
		}
	}
	publishAcked(t, natsConnect(t, url, creds("globex")), "globex")
	publishAcked(t, natsConnect(t, url, creds("acme")), "acme")
}

// Valid but odd tenant names — a digit first, a digit only, a dash, 63
// characters — make configurations a real nats-server runs, in both modes,
// and each tenant's request gets its PubAck.
func TestNATSConfigAttackOddTenantNamesRunOnAServer(t *testing.T) {
	tenants := []string{"0", "1a", "a-b", "x" + strings.Repeat("9", 62)}
	list := strings.Join(tenants, ",")

	nk := filepath.Join(t.TempDir(), "keys")
	code, stdout, stderr := cli(t, "nats-config", "--nkeys", nk, "--tenant", list)
	if code != 0 {
		t.Fatal(stderr)
	}
	conf := filepath.Join(t.TempDir(), "buildq.conf")
	if err := os.WriteFile(conf, []byte(stdout), 0o600); err != nil {
		t.Fatal(err)
	}
	url := startNATSFile(t, conf)
	seed := func(u string) nats.Option {
		o, err := nats.NkeyOptionFromSeed(filepath.Join(nk, u+".seed"))
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	requestsStream(t, natsConnect(t, url, seed("worker")))
	for _, tn := range tenants {
		publishAcked(t, natsConnect(t, url, seed(tn)), tn)
	}

	// The variables' form: the same names as variables.
	code, stdout, stderr = cli(t, "nats-config", "--tenant", list)
	if code != 0 {
		t.Fatal(stderr)
	}
	envConf := filepath.Join(t.TempDir(), "env.conf")
	if err := os.WriteFile(envConf, []byte(stdout), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, u := range append([]string{"worker", "admin"}, tenants...) {
		b, _ := os.ReadFile(filepath.Join(nk, u+".seed"))
		kp, err := nkeys.ParseDecoratedNKey(b)
		if err != nil {
			t.Fatal(err)
		}
		pub, _ := kp.PublicKey()
		if !strings.Contains(stdout, "$"+natsconf.NKeyVar(u)) {
			t.Fatalf("%s's variable %s is not in the file", u, natsconf.NKeyVar(u))
		}
		t.Setenv(natsconf.NKeyVar(u), pub) // read by ProcessConfigFile
	}
	if _, err := server.ProcessConfigFile(envConf); err != nil {
		t.Fatalf("the variables' form: %v", err)
	}

	dir := filepath.Join(t.TempDir(), "nats")
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", list); code != 0 {
		t.Fatal(stderr)
	}
	jurl := startNATSFile(t, filepath.Join(dir, "nats-server.conf"))
	creds := func(u string) nats.Option { return nats.UserCredentials(filepath.Join(dir, "creds", u+".creds")) }
	requestsStream(t, natsConnect(t, jurl, creds("worker")))
	for _, tn := range tenants {
		publishAcked(t, natsConnect(t, jurl, creds(tn)), tn)
	}
}

// A seed file copied from another user's (so two users would share one
// key, and one could log in as the other) never yields a configuration a
// server runs.
func TestNATSConfigAttackCopiedSeedIsRefused(t *testing.T) {
	t.Parallel()
	for _, from := range []string{"acme", "worker"} {
		nk := filepath.Join(t.TempDir(), "keys")
		if code, _, stderr := cli(t, "nats-config", "--nkeys", nk, "--tenant", "acme"); code != 0 {
			t.Fatal(stderr)
		}
		b, err := os.ReadFile(filepath.Join(nk, from+".seed"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(nk, "globex.seed"), b, 0o600); err != nil {
			t.Fatal(err)
		}
		code, stdout, _ := cli(t, "nats-config", "--nkeys", nk, "--tenant", "acme,globex")
		if code != 0 {
			continue // refused by the command
		}
		conf := filepath.Join(t.TempDir(), "buildq.conf")
		if err := os.WriteFile(conf, []byte(stdout), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := server.ProcessConfigFile(conf); err == nil || !strings.Contains(err.Error(), "Duplicate nkey") {
			t.Fatalf("globex's seed copied from %s's: the server takes the configuration (%v)", from, err)
		}
	}
}

// nats-config reads no BUILDQ_* variable: BUILDQ_TENANT, set for the
// client commands, does not become a tenant of the server, and
// BUILDQ_MODE/BUILDQ_DIR/NATS_URL change nothing.
func TestNATSConfigAttackEnvironmentIsIgnored(t *testing.T) {
	t.Setenv("BUILDQ_TENANT", "intruder")
	t.Setenv("BUILDQ_MODE", "jwt")
	t.Setenv("BUILDQ_DIR", t.TempDir())
	t.Setenv("BUILDQ_NKEYS", t.TempDir())
	t.Setenv("NATS_URL", "nats://127.0.0.1:1")
	code, stdout, stderr := cli(t, "nats-config", "--tenant", "acme")
	if code != 0 || strings.Contains(stdout, "intruder") || strings.Contains(stdout, "INTRUDER") || !strings.Contains(stdout, "nkey: $BUILDQ_ACME_NKEY") {
		t.Fatalf("exit %d, %s", code, stderr)
	}
	if code, _, _ := cli(t, "nats-config"); code != exitInvalid {
		t.Fatalf("no --tenant, BUILDQ_TENANT set: exit %d", code)
	}
}
