package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/natsconf"
)

// The shipped configuration is exactly what the generator prints, so the
// two cannot drift apart.
func TestNATSConfigShippedFile(t *testing.T) {
	t.Parallel()
	shipped, err := os.ReadFile(filepath.Join("..", "..", "deploy", "nats", "buildq.conf"))
	if err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := cli(t, "nats-config", "--tenant", "acme", "--tenant", "globex")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if stdout != string(shipped) {
		t.Fatalf("deploy/nats/buildq.conf is not the output of `buildq nats-config --tenant acme --tenant globex`; regenerate it:\n" +
			"  go run ./cmd/buildq nats-config --tenant acme --tenant globex > deploy/nats/buildq.conf")
	}
	if stderr != "" {
		t.Errorf("stderr: %s", stderr)
	}
	// The comma-separated form is the same list.
	if _, again, _ := cli(t, "nats-config", "--tenant", "acme,globex"); again != stdout {
		t.Error("--tenant acme,globex prints another file")
	}
}

func TestNATSConfigUsageErrors(t *testing.T) {
	t.Parallel()
	notSetup := t.TempDir()
	if err := os.WriteFile(filepath.Join(notSetup, "notes.txt"), []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := map[string]struct {
		args []string
		want string
	}{
		"no tenant":              {[]string{}, "--tenant"},
		"empty tenant":           {[]string{"--tenant", ""}, "--tenant"},
		"bad tenant":             {[]string{"--tenant", "a.b"}, "DNS-1123"},
		"wildcard tenant":        {[]string{"--tenant", "*"}, "DNS-1123"},
		"upper-case tenant":      {[]string{"--tenant", "Acme"}, "DNS-1123"},
		"duplicate tenant":       {[]string{"--tenant", "acme", "--tenant", "acme"}, "given twice"},
		"reserved tenant":        {[]string{"--tenant", "worker"}, "taken"},
		"bad mode":               {[]string{"--mode", "ldap", "--tenant", "acme"}, "--mode"},
		"dir in file mode":       {[]string{"--dir", t.TempDir(), "--tenant", "acme"}, "--dir is for --mode jwt"},
		"push in file mode":      {[]string{"--push", "nats://127.0.0.1:1", "--tenant", "acme"}, "--push is for --mode jwt"},
		"resolver in file mode":  {[]string{"--resolver-dir", "/x", "--tenant", "acme"}, "--resolver-dir is for --mode jwt"},
		"jwt without dir":        {[]string{"--mode", "jwt", "--tenant", "acme"}, "needs --dir"},
		"nkeys in jwt mode":      {[]string{"--mode", "jwt", "--dir", t.TempDir(), "--nkeys", t.TempDir(), "--tenant", "acme"}, "--nkeys is for config-file mode"},
		"tls without push":       {[]string{"--mode", "jwt", "--dir", t.TempDir(), "--nats-tls-ca", "ca.pem", "--tenant", "acme"}, "--nats-tls-ca is for --push"},
		"push to a new setup":    {[]string{"--mode", "jwt", "--dir", filepath.Join(t.TempDir(), "new"), "--push", "nats://127.0.0.1:1", "--tenant", "acme"}, "holds none yet"},
		"dir is not a setup":     {[]string{"--mode", "jwt", "--dir", notSetup, "--tenant", "acme"}, "not empty"},
		"positional argument":    {[]string{"acme"}, "unknown command"},
		"empty nkeys directory":  {[]string{"--nkeys", "", "--tenant", "acme"}, "--nkeys needs a directory"},
		"tls cert without key":   {[]string{"--mode", "jwt", "--dir", t.TempDir(), "--push", "nats://127.0.0.1:1", "--nats-tls-cert", "c.pem", "--tenant", "acme"}, ""},
		"unknown flag":           {[]string{"--tenant", "acme", "--bogus"}, "unknown flag"},
		"tenant list with blank": {[]string{"--tenant", "acme,,globex"}, "an empty tenant name"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := cli(t, append([]string{"nats-config"}, c.args...)...)
			if name == "tls cert without key" {
				// A new setup refuses --push before TLS is looked at.
				c.want = "holds none yet"
			}
			if code != 2 || !strings.HasPrefix(stderr, "buildq: ") || !strings.Contains(stderr, c.want) {
				t.Fatalf("exit %d, stderr %q; want exit 2 and %q", code, stderr, c.want)
			}
			if stdout != "" {
				t.Errorf("stdout: %s", stdout)
			}
		})
	}
	if entries, _ := os.ReadDir(notSetup); len(entries) != 1 {
		t.Errorf("nats-config wrote into a directory that is not a setup: %v", entries)
	}
}

func TestNATSConfigHelp(t *testing.T) {
	t.Parallel()
	code, stdout, _ := cli(t, "nats-config", "--help")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{"Config-file mode", "Decentralized mode", "--nkeys", "--push", "nats-server -c", "--inbox-prefix"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("--help does not say %q", want)
		}
	}
}

// startNATSFile runs nats-server in-process on a configuration file, on a
// free port, with JetStream in a temporary directory.
func startNATSFile(t *testing.T, file string) string {
	t.Helper()
	opts, err := server.ProcessConfigFile(file)
	if err != nil {
		t.Fatalf("the server refuses %s: %v", file, err)
	}
	opts.Host, opts.Port = "127.0.0.1", server.RANDOM_PORT
	opts.StoreDir = t.TempDir()
	opts.NoSigs, opts.NoLog = true, true
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	return s.ClientURL()
}

func natsConnect(t *testing.T, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, append(opts, nats.MaxReconnects(0))...)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// requestsStream sets up BUILDQ_REQUESTS as the worker's user.
func requestsStream(t *testing.T, worker *nats.Conn) {
	t.Helper()
	js, _ := jetstream.New(worker)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: v1.RequestsStream, Subjects: []string{v1.RequestsPrefix + ".>"}, Storage: jetstream.MemoryStorage,
	}); err != nil {
		t.Fatalf("the worker creates %s: %v", v1.RequestsStream, err)
	}
}

// publishAcked is a tenant's JetStream publish of a request.
func publishAcked(t *testing.T, nc *nats.Conn, tenant string) {
	t.Helper()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ack, err := js.Publish(ctx, v1.RequestSubject(tenant), []byte(`{}`))
	if err != nil || ack.Stream != v1.RequestsStream {
		t.Fatalf("%s's JetStream publish: %v %v", tenant, ack, err)
	}
}

func TestNATSConfigNKeys(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "keys")
	code, stdout, stderr := cli(t, "nats-config", "--nkeys", dir, "--tenant", "acme", "--tenant", "globex")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if strings.Contains(stdout, "$BUILDQ_") && strings.Contains(stdout, "nkey: $") {
		t.Fatal("the configuration still reads keys from the environment")
	}
	for _, u := range []string{"worker", "admin", "acme", "globex"} {
		p := filepath.Join(dir, u+".seed")
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v", p, st.Mode().Perm())
		}
		b, _ := os.ReadFile(p)
		kp, err := nkeys.ParseDecoratedNKey(b)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		pub, _ := kp.PublicKey()
		if strings.Count(stdout, `nkey: "`+pub+`"`) != 1 {
			t.Errorf("%s's public key is not in the configuration", u)
		}
		if !strings.Contains(stderr, p) {
			t.Errorf("stderr does not name %s", p)
		}
		if strings.Contains(stdout, strings.TrimSpace(string(b))) {
			t.Errorf("%s's seed is in the configuration", u)
		}
	}
	// It runs as it is, and the seed files connect.
	conf := filepath.Join(t.TempDir(), "buildq.conf")
	if err := os.WriteFile(conf, []byte(stdout), 0o600); err != nil {
		t.Fatal(err)
	}
	url := startNATSFile(t, conf)
	seed := func(u string) nats.Option {
		o, err := nats.NkeyOptionFromSeed(filepath.Join(dir, u+".seed"))
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	requestsStream(t, natsConnect(t, url, seed("worker")))
	publishAcked(t, natsConnect(t, url, seed("acme")), "acme")

	// A second run with the same directory keeps the keys and makes the
	// new tenant's.
	before, _ := os.ReadFile(filepath.Join(dir, "acme.seed"))
	code, again, stderr := cli(t, "nats-config", "--nkeys", dir, "--tenant", "acme", "--tenant", "globex", "--tenant", "initech")
	if code != 0 || !strings.Contains(stderr, "kept "+filepath.Join(dir, "acme.seed")) || !strings.Contains(stderr, "wrote "+filepath.Join(dir, "initech.seed")) {
		t.Fatalf("second run: exit %d, %s", code, stderr)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "acme.seed")); string(after) != string(before) {
		t.Fatal("acme's seed was replaced")
	}
	if !strings.Contains(again, `"tenant-initech" {`) {
		t.Fatal("the second configuration does not add initech")
	}
	for _, line := range strings.Split(stdout, "\n") {
		if strings.Contains(line, `nkey: "U`) && !strings.Contains(again, strings.TrimSpace(line)) {
			t.Errorf("the second configuration lost %s", strings.TrimSpace(line))
		}
	}
	// A seed file that holds no user seed is refused.
	if err := os.WriteFile(filepath.Join(dir, "hooli.seed"), []byte("not a seed\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := cli(t, "nats-config", "--nkeys", dir, "--tenant", "hooli"); code != 2 || !strings.Contains(stderr, "hooli.seed") {
		t.Fatalf("bad seed file: exit %d, %s", code, stderr)
	}
}

var pushedRe = regexp.MustCompile(`pushed tenant (\S+) \(account tenant-\S+ A[A-Z0-9]+\) to \S+: jwt updated`)

func TestNATSConfigJWT(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "nats")
	code, stdout, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme")
	if code != 0 || stdout != "" {
		t.Fatalf("exit %d, stdout %q, stderr %s", code, stdout, stderr)
	}
	for f, mode := range map[string]os.FileMode{
		"operator.jwt": 0o644, "keys/operator.nk": 0o600, "keys/SYS.nk": 0o600, "keys/BUILDQ.nk": 0o600,
		"keys/tenant-acme.nk": 0o600, "accounts/SYS.jwt": 0o644, "accounts/BUILDQ.jwt": 0o644,
		"accounts/tenant-acme.jwt": 0o644, "creds/worker.creds": 0o600, "creds/admin.creds": 0o600,
		"creds/sys.creds": 0o600, "creds/acme.creds": 0o600, "nats-server.conf": 0o644,
	} {
		p := filepath.Join(dir, f)
		st, err := os.Stat(p)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if st.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", f, st.Mode().Perm(), mode)
		}
		if !strings.Contains(stderr, p) {
			t.Errorf("stderr does not name %s:\n%s", p, stderr)
		}
	}
	if !strings.Contains(stderr, "run: nats-server -c "+filepath.Join(dir, "nats-server.conf")) {
		t.Errorf("stderr does not say how to run it:\n%s", stderr)
	}
	buildqJWT, _ := os.ReadFile(filepath.Join(dir, "accounts", "BUILDQ.jwt"))
	creds := func(u string) nats.Option { return nats.UserCredentials(filepath.Join(dir, "creds", u+".creds")) }

	url := startNATSFile(t, filepath.Join(dir, "nats-server.conf"))
	requestsStream(t, natsConnect(t, url, creds("worker")))
	publishAcked(t, natsConnect(t, url, creds("acme")), "acme")

	// The same tenant again: nothing to add.
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme")
	if code != 2 || !strings.Contains(stderr, "nothing to add") {
		t.Fatalf("adding acme again: exit %d, %s", code, stderr)
	}

	// A new tenant, pushed to the running server.
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme", "--tenant", "globex", "--push", url)
	if code != 0 {
		t.Fatalf("adding globex: exit %d, %s", code, stderr)
	}
	pushed := pushedRe.FindAllStringSubmatch(stderr, -1)
	if len(pushed) != 2 || pushed[0][1] != "acme" || pushed[1][1] != "globex" || !strings.Contains(stderr, "tenant acme: already in") {
		t.Fatalf("stderr of the push:\n%s", stderr)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "accounts", "BUILDQ.jwt")); string(b) != string(buildqJWT) {
		t.Fatal("BUILDQ's JWT changed")
	}
	publishAcked(t, natsConnect(t, url, creds("globex")), "globex")
	publishAcked(t, natsConnect(t, url, creds("acme")), "acme")
	conf, _ := os.ReadFile(filepath.Join(dir, "nats-server.conf"))
	if !strings.Contains(string(conf), "# tenant-globex\n") || !strings.Contains(string(conf), filepath.Join(dir, "jwt")) {
		t.Errorf("nats-server.conf was not rewritten with globex:\n%s", conf)
	}

	// Pushed to a server of another operator: the system account's user
	// is refused, and the command says so.
	other := filepath.Join(t.TempDir(), "other")
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", other, "--tenant", "acme"); code != 0 {
		t.Fatal(stderr)
	}
	otherURL := startNATSFile(t, filepath.Join(other, "nats-server.conf"))
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "initech", "--push", otherURL)
	if code != 1 || !strings.Contains(stderr, "Authorization Violation") || !strings.Contains(stderr, "does the server run the operator of "+dir) {
		t.Fatalf("push to another operator's server: exit %d, %s", code, stderr)
	}
	// initech is in the setup now; pushing it to the right server works.
	code, _, stderr = cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "initech", "--push", url)
	if code != 0 || len(pushedRe.FindAllString(stderr, -1)) != 1 {
		t.Fatalf("push initech: exit %d, %s", code, stderr)
	}
	publishAcked(t, natsConnect(t, url, creds("initech")), "initech")
}

// A push the server refuses fails with the server's message.
func TestNATSConfigPushRefused(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "nats")
	if code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "acme"); code != 0 {
		t.Fatal(stderr)
	}
	// A server without authentication and a responder in the server's place.
	conf := filepath.Join(t.TempDir(), "plain.conf")
	if err := os.WriteFile(conf, []byte("port: 4222\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	url := startNATSFile(t, conf)
	nc := natsConnect(t, url)
	if _, err := nc.Subscribe(natsconf.ClaimsUpdateSubject, func(m *nats.Msg) {
		b, _ := json.Marshal(map[string]any{"server": map[string]string{"name": "n1"},
			"error": map[string]any{"code": 500, "description": "jwt validation failed - validation errors: [no]"}})
		_ = m.Respond(b)
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	code, _, stderr := cli(t, "nats-config", "--mode", "jwt", "--dir", dir, "--tenant", "globex", "--push", url)
	if code != 1 || !strings.Contains(stderr, "refused by the server: jwt validation failed - validation errors: [no]") {
		t.Fatalf("exit %d, %s", code, stderr)
	}
}
