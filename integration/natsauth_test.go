//go:build integration

package integration

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	corev1 "k8s.io/api/core/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/natsconf"
)

// TestNATSAuth runs buildq's NATS setup with an account per tenant on a real
// nats-server and a real `buildq worker` (its user, buildq-worker, in the
// BUILDQ account), in both of its forms, side by side:
//
//   - config file: deploy/nats/buildq.conf, unchanged, the users' public
//     nkeys from the environment;
//   - jwt: a decentralized setup made with internal/natsconf (operator,
//     SYS, BUILDQ, tenant accounts acme and globex), to which a tenant,
//     initech, is added live with `buildq nats-config --push`.
//
// In each, tenant acme (A) submits (CLI and SDK, without an inbox prefix),
// gets its results and events, queries and cancels its own requests; every
// attempt of tenant globex (B) on A's requests, results, events, inbox,
// services, the workers' internal subjects and the JetStream API is
// refused by the server (a permissions violation) or by the worker; B's
// default inbox sees nothing of A's or the workers' replies; and no reply
// subject B names — a bucket's, a stream's, the JetStream API's, the
// workers', A's — makes the server or the worker publish there
// (replyAttack).
func TestNATSAuth(t *testing.T) {
	t.Run("config file", func(t *testing.T) {
		t.Parallel()
		e := fileModeEnv(t)
		e.tenantsApart(t)
	})
	t.Run("jwt", func(t *testing.T) {
		t.Parallel()
		e := jwtModeEnv(t)
		e.tenantsApart(t)
		e.liveTenant(t, "initech")
	})
}

// natsAuthEnv is one mode's server, worker and users.
type natsAuthEnv struct {
	s *suite
	// auth is how the user with a key name (natsconf.WorkerKey,
	// AdminKey, a tenant) connects; cli the same as the command line's
	// flags, cliEnv as its variables.
	auth   func(t *testing.T, user string) nats.Option
	cli    func(user string) []string
	cliEnv func(user string) []string
	// jwtDir is the decentralized setup's directory (jwt mode only).
	jwtDir string
}

// fileModeEnv is tenantNATSEnv with builds held until released.
func fileModeEnv(t *testing.T) *natsAuthEnv {
	return tenantNATSEnv(t, newHolds(t, "held").fault)
}

// tenantNATSEnv runs deploy/nats/buildq.conf as it is shipped (an
// account per tenant, the users' public nkeys in $BUILDQ_<USER>_NKEY),
// with the test's own build faults.
func tenantNATSEnv(t *testing.T, faults func(*corev1.Pod) fault) *natsAuthEnv {
	t.Helper()
	conf, err := filepath.Abs(filepath.Join("..", "deploy", "nats", "buildq.conf"))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := natsconf.NewUserKeys(natsconf.Users([]string{"acme", "globex"}))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	seed := func(user string) string { return filepath.Join(dir, user+".seed") }
	var env []string
	for _, k := range keys {
		if err := os.WriteFile(seed(k.User), k.Seed, 0o600); err != nil {
			t.Fatal(err)
		}
		env = append(env, natsconf.NKeyVar(k.User)+"="+k.Public)
	}
	e := &natsAuthEnv{
		auth: func(t *testing.T, user string) nats.Option {
			t.Helper()
			o, err := nats.NkeyOptionFromSeed(seed(user))
			if err != nil {
				t.Fatal(err)
			}
			return o
		},
		cli:    func(user string) []string { return []string{"--nats-nkey", seed(user)} },
		cliEnv: func(user string) []string { return []string{"BUILDQ_NATS_NKEY=" + seed(user)} },
	}
	e.s = newSuite(t, options{
		natsConfig: conf, natsEnv: env, natsOptions: []nats.Option{e.auth(t, natsconf.AdminKey)},
		workerArgs: []string{"--nats-nkey", seed(natsconf.WorkerKey)},
		faults:     faults,
	})
	return e
}

// jwtModeEnv makes a decentralized setup with internal/natsconf, laid out
// as `buildq nats-config --mode jwt --dir DIR` lays it out (so that command
// can add a tenant to it), and runs nats-server on its configuration.
func jwtModeEnv(t *testing.T) *natsAuthEnv {
	setup, err := natsconf.NewJWTSetup([]string{"acme", "globex"})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(rel string, data []byte, mode os.FileMode) {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, mode); err != nil {
			t.Fatal(err)
		}
	}
	files, err := setup.Files()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		mode := os.FileMode(0o644)
		if f.Secret {
			mode = 0o600
		}
		write(f.Path, f.Data, mode)
	}
	for _, u := range []string{natsconf.WorkerKey, natsconf.AdminKey, natsconf.SysKey, "acme", "globex"} {
		b, err := setup.UserCreds(u)
		if err != nil {
			t.Fatal(err)
		}
		write(natsconf.CredsDir+"/"+u+".creds", b, 0o600)
	}
	resolver := filepath.Join(dir, natsconf.ResolverDir)
	if err := os.MkdirAll(resolver, 0o700); err != nil {
		t.Fatal(err)
	}
	conf, err := setup.ServerConfig(resolver)
	if err != nil {
		t.Fatal(err)
	}
	write(natsconf.ConfigFile, conf, 0o644)

	creds := func(user string) string { return filepath.Join(dir, natsconf.CredsDir, user+".creds") }
	e := &natsAuthEnv{
		auth:   func(_ *testing.T, user string) nats.Option { return nats.UserCredentials(creds(user)) },
		cli:    func(user string) []string { return []string{"--nats-creds", creds(user)} },
		cliEnv: func(user string) []string { return []string{"BUILDQ_NATS_CREDS=" + creds(user)} },
		jwtDir: dir,
	}
	h := newHolds(t, "held")
	e.s = newSuite(t, options{
		natsConfig: filepath.Join(dir, natsconf.ConfigFile), natsOptions: []nats.Option{e.auth(t, natsconf.AdminKey)},
		workerArgs: []string{"--nats-creds", creds(natsconf.WorkerKey)},
		faults:     h.fault,
	})
	return e
}

// connect is a new connection as user, with the default inbox prefix
// (tenants need none of their own: their replies stay in their account).
func (e *natsAuthEnv) connect(t *testing.T, user string, extra ...nats.Option) *natsUser {
	t.Helper()
	return e.s.connectAs(t, append([]nats.Option{e.auth(t, user), nats.Name("it-" + user)}, extra...)...)
}

// cliNATS are the command line's flags to reach the server as user.
func (e *natsAuthEnv) cliNATS(user string) []string {
	return append([]string{"--nats-url", e.s.natsURL}, e.cli(user)...)
}

// checkServerLog: the server logged globex's refusals, and none of the
// worker's (it needed nothing its user is not allowed).
func (e *natsAuthEnv) checkServerLog(t *testing.T) {
	t.Helper()
	log := e.s.natsLog.String()
	if !strings.Contains(log, "Violation") {
		t.Errorf("the server logged none of globex's refusals; its log:\n%s", tail(log, 3000))
		return
	}
	var lines []string
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "Violation") && strings.Contains(l, "buildq-worker") {
			lines = append(lines, l)
		}
	}
	if len(lines) > 0 {
		t.Errorf("the worker's user was refused:\n%s", strings.Join(lines, "\n"))
	}
}

// liveTenant adds tenant to the running server of jwt mode with the real
// `buildq nats-config --mode jwt --dir DIR --tenant T --push URL`, and the
// new tenant submits and gets its result: no restart of the server or the
// worker.
func (e *natsAuthEnv) liveTenant(t *testing.T, tenant string) {
	s := e.s
	s.natsMu.Lock()
	server := s.nats
	s.natsMu.Unlock()
	t.Run("a tenant added live submits and gets its result", func(t *testing.T) {
		if _, err := os.Stat(filepath.Join(e.jwtDir, natsconf.CredsDir, tenant+".creds")); err == nil {
			t.Fatalf("%s already has %s's credentials", e.jwtDir, tenant)
		}
		out, errOut, code := runCLI(t, time.Minute, "nats-config", "--mode", "jwt", "--dir", e.jwtDir, "--tenant", tenant, "--push", s.natsURL)
		if code != 0 {
			t.Fatalf("buildq nats-config --push: exit %d\n%s%s", code, out, errOut)
		}
		if !strings.Contains(errOut, "pushed tenant "+tenant) {
			t.Fatalf("buildq nats-config --push did not report the push:\n%s", errOut)
		}
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY i.txt /i.txt\n", "i.txt": tenant + "\n"})
		args := append([]string{"submit", dir, "--tenant", tenant, "--name", "app", "--wait", "--wait-timeout", "2m", "-o", "json"}, e.cliNATS(tenant)...)
		stdout, stderr, code := runCLI(t, 3*time.Minute, append(args, "--s3-endpoint", shared.minioEndpoint, "--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword, "--s3-bucket", shared.bucket)...)
		if code != 0 {
			t.Fatalf("buildq submit --wait as %s: exit %d\nstdout: %s\nstderr: %s", tenant, code, stdout, stderr)
		}
		var d v1.ResultData
		if err := json.Unmarshal([]byte(stdout), &d); err != nil {
			t.Fatalf("stdout is not one JSON result: %v\n%s", err, stdout)
		}
		if d.Status != v1.StatusSucceeded || d.Tenant != tenant || d.Digest == "" {
			t.Fatalf("result %+v", d)
		}
		// The same nats-server process, started once.
		s.natsMu.Lock()
		same := s.nats == server
		s.natsMu.Unlock()
		if !same || server.Process.Signal(syscall.Signal(0)) != nil {
			t.Fatal("nats-server was restarted")
		}
		if n := strings.Count(s.natsLog.String(), "Server is ready"); n != 1 {
			t.Fatalf("nats-server started %d times", n)
		}
		// The new tenant is apart from the others too.
		u := e.connect(t, tenant)
		u.subscribeRefused(t, "buildq.results.acme.>")
		if err := u.nc.Publish(v1.RequestSubject("acme"), []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
		u.refused(t, "Publish", v1.RequestSubject("acme"))
	})
}
