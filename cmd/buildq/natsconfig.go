package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/conf"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/spf13/cobra"

	"github.com/buildq/buildq/internal/natsconf"
)

// newNATSConfigCmd is `buildq nats-config`: the nats-server setup with an
// account per tenant (internal/natsconf, deploy/nats/README.md).
//
// Its flags read no BUILDQ_* variables: BUILDQ_TENANT, set for the client
// commands, would silently become a tenant of the server's configuration.
func newNATSConfigCmd() *cobra.Command {
	var (
		tenants     []string
		mode        string
		nkeysDir    string
		dir         string
		resolverDir string
		push        string
		nf          natsFlags
	)
	cmd := &cobra.Command{
		Use:   "nats-config --tenant T... [--nkeys DIR | --mode jwt --dir DIR [--push URL]]",
		Short: "Make the nats-server setup that keeps tenants apart (an account per tenant)",
		Long: `Make the nats-server setup for buildq in which every tenant is a NATS
account of its own. The BUILDQ account holds the streams and buckets, the
workers' user (buildq-worker) and the operators' user (buildq-admin); each
tenant's account imports from BUILDQ exactly its own request subject, its
status, cancel and logs services, its results and its events. The server
routes replies and PubAcks back into the asking tenant's account, so no
reply subject a tenant names can write into BUILDQ's streams or buckets (in
one shared account it could). Build logs stay in BUILDQ (the BUILDQ_LOGS
stream, written by the workers on buildq.logs.>): a tenant reads a log only
through its logs service. See deploy/nats/README.md.

Config-file mode (the default) prints a nats-server configuration file on
stdout. Users authenticate by nkey, the public keys read from the
environment when the server starts ($BUILDQ_<USER>_NKEY):

  buildq nats-config --tenant acme --tenant globex > buildq.conf
  BUILDQ_WORKER_NKEY=U... BUILDQ_ADMIN_NKEY=U... BUILDQ_ACME_NKEY=U... \
    BUILDQ_GLOBEX_NKEY=U... nats-server -c buildq.conf -sd /data/nats

With --nkeys DIR it writes the users' public keys into the file instead,
so the server needs no variables: a key pair is made for each user
without a seed in DIR/<user>.seed (worker, admin and each tenant; mode
0600), and the seeds already there are kept. The worker connects with
--nats-nkey DIR/worker.seed, a tenant's clients with --nats-nkey
DIR/<tenant>.seed. To add a tenant, run it again with the whole list (and
the same --nkeys DIR, or the new tenant's variable) and restart the server
(or reload it twice: nats-server 2.15 sets up a new account's service
imports on the second reload only).

Decentralized mode (--mode jwt --dir DIR) adds tenants without touching
the running server's configuration: an operator signs the accounts, and a
new tenant is one more account JWT pushed to the server. It writes into
DIR the operator's and the accounts' keys (keys/, mode 0600) and JWTs
(operator.jwt, accounts/), a credentials file per user (creds/worker.creds,
creds/admin.creds, creds/sys.creds, creds/<tenant>.creds) and
nats-server.conf, whose account resolver keeps the JWTs in --resolver-dir
(default DIR/jwt):

  buildq nats-config --mode jwt --dir /etc/buildq/nats --tenant acme
  nats-server -c /etc/buildq/nats/nats-server.conf -sd /data/nats
  buildq worker --nats-creds /etc/buildq/nats/creds/worker.creds ...

Run it again on the same DIR with new tenants to add them: the operator,
the system account and BUILDQ keep their keys and JWTs, tenants already
there are kept, and nats-server.conf is rewritten with the new accounts
preloaded. With --push the new accounts are also sent to the running
server as the system account's user (creds/sys.creds): no restart, no
reload. Tenants named with --push that DIR already has are pushed again.

The files written are listed on stderr. A tenant's clients need no
--inbox-prefix any more: their replies stay in their own account
(--inbox-prefix _INBOX_<tenant> still works).`,
		Example: `  buildq nats-config --tenant acme --tenant globex > deploy/nats/buildq.conf
  buildq nats-config --nkeys ./keys --tenant acme,globex > buildq.conf
  buildq nats-config --mode jwt --dir ./nats --tenant acme --tenant globex
  buildq nats-config --mode jwt --dir ./nats --tenant initech --push nats://nats:4222`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			flags := cmd.Flags()
			switch mode {
			case "file", "jwt":
			default:
				return usageErr("--mode must be file or jwt, got %q", mode)
			}
			jwtOnly := []string{"dir", "resolver-dir", "push", "nats-tls-ca", "nats-tls-cert", "nats-tls-key"}
			if mode == "file" {
				for _, f := range jwtOnly {
					if flags.Changed(f) {
						return usageErr("--%s is for --mode jwt", f)
					}
				}
			} else {
				if flags.Changed("nkeys") {
					return usageErr("--nkeys is for config-file mode; --mode jwt writes its keys into --dir")
				}
				if dir == "" {
					return usageErr("--mode jwt needs --dir DIR, where it writes the keys, the credentials and nats-server.conf")
				}
				for _, f := range jwtOnly[3:] {
					if flags.Changed(f) && push == "" {
						return usageErr("--%s is for --push", f)
					}
				}
			}
			if flags.Changed("nkeys") && nkeysDir == "" {
				return usageErr("--nkeys needs a directory")
			}
			// Comma-separated lists, split here: pflag's string-slice
			// flag reads a value as one CSV record and drops the rest
			// silently (a list with a newline lost every tenant after
			// the first). Every name is then checked, whitespace and all.
			var names []string
			for _, v := range tenants {
				for _, n := range strings.Split(v, ",") {
					if n == "" {
						return usageErr("--tenant %q: an empty tenant name", v)
					}
					names = append(names, n)
				}
			}
			tenants = names
			if len(tenants) == 0 {
				return usageErr("give at least one --tenant (a DNS-1123 label, e.g. --tenant acme)")
			}
			if err := natsconf.CheckTenants(tenants); err != nil {
				return usageErr("%v", err)
			}
			if mode == "file" {
				return natsConfigFile(cmd.OutOrStdout(), cmd.ErrOrStderr(), tenants, nkeysDir)
			}
			nf.url, nf.name = push, "buildq-nats-config"
			return natsConfigJWT(cmd.Context(), cmd.ErrOrStderr(), tenants, dir, resolverDir, &nf)
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&tenants, "tenant", nil, "a tenant (DNS-1123 label); repeat it or give a comma-separated list")
	f.StringVar(&mode, "mode", "file", "file: print a configuration file with the accounts written out; jwt: write a decentralized (operator/JWT) setup into --dir")
	f.StringVar(&nkeysDir, "nkeys", "", "config-file mode: keep or make each user's seed in DIR/<user>.seed and write the public keys into the file")
	f.StringVar(&dir, "dir", "", "jwt mode: the setup's directory (new, or an existing setup to add tenants to)")
	f.StringVar(&resolverDir, "resolver-dir", "", "jwt mode: the server's account JWT directory, made absolute (default DIR/jwt, or what DIR/nats-server.conf names)")
	f.StringVar(&push, "push", "", "jwt mode: send the tenants' account JWTs to the running server at this URL (nats://HOST:4222) as the system account's user")
	f.StringVar(&nf.tlsCA, "nats-tls-ca", "", "with --push: CA certificate to verify the NATS server")
	f.StringVar(&nf.tlsCert, "nats-tls-cert", "", "with --push: client certificate for NATS mutual TLS")
	f.StringVar(&nf.tlsKey, "nats-tls-key", "", "with --push: client key for NATS mutual TLS")
	return cmd
}

// natsConfigFile prints the config-file mode configuration. With nkeysDir
// the users' public keys are written into it: a seed already in
// nkeysDir/<user>.seed is kept (so a tenant is added with the same
// directory), a missing one is made and written there.
func natsConfigFile(stdout, stderr io.Writer, tenants []string, nkeysDir string) error {
	opts := natsconf.ConfigOptions{Tenants: tenants}
	var (
		made []natsconf.UserKey
		kept []string
	)
	if nkeysDir != "" {
		opts.NKeys = map[string]string{}
		var missing []string
		for _, u := range natsconf.Users(tenants) {
			p := filepath.Join(nkeysDir, u+".seed")
			b, err := os.ReadFile(p)
			if errors.Is(err, fs.ErrNotExist) {
				missing = append(missing, u)
				continue
			}
			if err != nil {
				return failed(err)
			}
			kp, err := nkeys.ParseDecoratedNKey(b)
			if err != nil {
				return usageErr("%s: %v", p, err)
			}
			pub, err := kp.PublicKey()
			if err != nil || !nkeys.IsValidPublicUserKey(pub) {
				return usageErr("%s holds no user seed (SU...)", p)
			}
			opts.NKeys[u] = pub
			kept = append(kept, fmt.Sprintf("kept %s (public key %s)", p, pub))
		}
		var err error
		if made, err = natsconf.NewUserKeys(missing); err != nil {
			return failed(err)
		}
		for _, k := range made {
			opts.NKeys[k.User] = k.Public
		}
	}
	b, err := natsconf.ServerConfig(opts)
	if err != nil {
		return usageErr("%v", err)
	}
	if nkeysDir != "" {
		if err := os.MkdirAll(nkeysDir, 0o700); err != nil {
			return failed(err)
		}
		for _, k := range kept {
			fmt.Fprintln(stderr, k)
		}
		for _, k := range made {
			p := filepath.Join(nkeysDir, k.User+".seed")
			if err := writeNew(p, append(k.Seed, '\n'), 0o600); err != nil {
				return failed(err)
			}
			fmt.Fprintf(stderr, "wrote %s (public key %s)\n", p, k.Public)
		}
	}
	if _, err := stdout.Write(b); err != nil {
		return failed(err)
	}
	return nil
}

// natsConfigJWT writes a new decentralized setup into dir, or adds tenants
// to the one there (and pushes them with nf.url set).
func natsConfigJWT(ctx context.Context, stderr io.Writer, tenants []string, dir, resolverDir string, nf *natsFlags) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return failed(err)
	}
	files, err := readSetup(dir)
	if err != nil {
		return failed(err)
	}
	confPath := filepath.Join(dir, natsconf.ConfigFile)
	if resolverDir != "" {
		if resolverDir, err = filepath.Abs(resolverDir); err != nil {
			return failed(err)
		}
	}

	newSetup := !natsconf.IsSetup(files)
	var (
		setup   *natsconf.JWTSetup
		added   []natsconf.Account
		creds   []string // key names whose credentials are written
		pushing []string // tenants whose accounts are pushed
	)
	if !newSetup {
		if setup, err = natsconf.LoadJWTSetup(files); err != nil {
			return failed(fmt.Errorf("%s: %w", dir, err))
		}
		// A setup made by an earlier buildq: the services added since
		// are out of its tenants' reach, whatever their accounts import.
		if missing, err := setup.MissingExports(); err != nil {
			return failed(fmt.Errorf("%s: %w", dir, err))
		} else if len(missing) > 0 {
			fmt.Fprintf(stderr, "note: %s's %s account was made by an earlier buildq and does not export %s: its tenants, old and new, cannot reach these services (buildq logs) and its worker credentials lack their permissions; make a new setup for them\n",
				dir, natsconf.BuildqAccount, strings.Join(missing, ", "))
		}
		var fresh, kept []string
		for _, t := range tenants {
			if _, ok := setup.Tenant(t); ok {
				kept = append(kept, t)
			} else {
				fresh = append(fresh, t)
			}
		}
		// Credentials an earlier run did not get to write (a full disk, a
		// killed process) are written now: a retry is the same command.
		var missing []string
		for _, u := range append([]string{natsconf.WorkerKey, natsconf.AdminKey, natsconf.SysKey}, kept...) {
			if _, err := os.Lstat(filepath.Join(dir, natsconf.CredsDir, u+".creds")); errors.Is(err, fs.ErrNotExist) {
				missing = append(missing, u)
			}
		}
		if len(fresh) == 0 && len(missing) == 0 && nf.url == "" {
			return usageErr("%s already has tenant(s) %s: nothing to add (name a new --tenant; with --push, the named tenants are pushed again)",
				dir, strings.Join(kept, ", "))
		}
		for _, t := range kept {
			fmt.Fprintf(stderr, "tenant %s: already in %s, kept\n", t, dir)
		}
		if len(fresh) > 0 {
			if added, err = setup.AddTenants(fresh); err != nil {
				return usageErr("%v", err)
			}
		}
		creds, pushing = slices.Concat(missing, fresh), tenants
		if resolverDir == "" {
			resolverDir = configuredResolverDir(confPath)
		}
	} else {
		entries, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return failed(err)
		}
		if len(entries) > 0 {
			return usageErr("%s is not empty and holds no buildq NATS setup (no keys/operator.nk): refusing to write into it", dir)
		}
		if nf.url != "" {
			return usageErr("--push adds tenants of an existing setup to its running server; %s holds none yet (start nats-server with the %s this writes)", dir, natsconf.ConfigFile)
		}
		if setup, err = natsconf.NewJWTSetup(tenants); err != nil {
			return usageErr("%v", err)
		}
		added = setup.Tenants
		creds = append([]string{natsconf.WorkerKey, natsconf.AdminKey, natsconf.SysKey}, tenants...)
	}
	if resolverDir == "" {
		resolverDir = filepath.Join(dir, natsconf.ResolverDir)
	}
	serverConf, err := setup.ServerConfig(resolverDir)
	if err != nil {
		return failed(err)
	}

	// Keys and JWTs: all of a new setup, the added accounts' otherwise.
	var out []natsconf.File
	if newSetup {
		if out, err = setup.Files(); err != nil {
			return failed(err)
		}
	} else {
		for _, a := range added {
			fs, err := natsconf.AccountFiles(a)
			if err != nil {
				return failed(err)
			}
			out = append(out, fs...)
		}
	}
	for _, u := range creds {
		b, err := setup.UserCreds(u)
		if err != nil {
			return failed(err)
		}
		out = append(out, natsconf.File{Path: path.Join(natsconf.CredsDir, u+".creds"), Data: b, Secret: true})
	}
	for _, f := range out {
		p := filepath.Join(dir, filepath.FromSlash(f.Path))
		if _, err := os.Lstat(p); err == nil {
			return failed(fmt.Errorf("%s exists: refusing to replace it (a leftover of an earlier run? move it away)", p))
		}
	}
	for _, f := range out {
		if err := writeNew(filepath.Join(dir, filepath.FromSlash(f.Path)), f.Data, fileMode(f.Secret)); err != nil {
			return failed(err)
		}
	}
	if err := writeReplace(confPath, serverConf, 0o644); err != nil {
		return failed(err)
	}
	for _, f := range out {
		fmt.Fprintf(stderr, "wrote %s\n", filepath.Join(dir, filepath.FromSlash(f.Path)))
	}
	fmt.Fprintf(stderr, "wrote %s (account JWTs in %s)\n", confPath, resolverDir)
	for _, a := range added {
		fmt.Fprintf(stderr, "tenant %s: account %s %s\n", a.Tenant, a.Name, a.PublicKey())
	}

	if nf.url == "" {
		if newSetup {
			fmt.Fprintf(stderr, "run: nats-server -c %s -sd /data/nats\n", confPath)
		} else {
			fmt.Fprintf(stderr, "a running server takes the new accounts with --push %s, or at its next start\n", "nats://HOST:4222")
		}
		return nil
	}
	return pushTenants(ctx, stderr, setup, dir, pushing, nf)
}

// pushTenants sends the tenants' account JWTs to the server at nf.url as
// the system account's user, then checks that each tenant's user gets in.
func pushTenants(ctx context.Context, stderr io.Writer, setup *natsconf.JWTSetup, dir string, tenants []string, nf *natsFlags) error {
	sys := *nf
	sys.creds = filepath.Join(dir, natsconf.CredsDir, natsconf.SysKey+".creds")
	opts, err := sys.options()
	if err != nil {
		return err
	}
	nc, err := nats.Connect(nf.url, opts...)
	if errors.Is(err, nats.ErrAuthorization) {
		return failed(fmt.Errorf("connect to NATS at %s as the system account's user (%s): %w — does the server run the operator of %s?", nf.url, sys.creds, err, dir))
	}
	if err != nil {
		return failed(fmt.Errorf("connect to NATS at %s as the system account's user (%s): %w", nf.url, sys.creds, err))
	}
	defer nc.Close()
	for _, t := range tenants {
		a, _ := setup.Tenant(t)
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		msg, err := natsconf.PushAccount(pctx, nc, a.JWT)
		cancel()
		if err != nil {
			return failed(err)
		}
		fmt.Fprintf(stderr, "pushed tenant %s (account %s %s) to %s: %s\n", t, a.Name, a.PublicKey(), nf.url, msg)
		// The server stores a pushed JWT before it checks who signed it:
		// only a user that gets in shows that it took the account.
		user := *nf
		user.creds = filepath.Join(dir, natsconf.CredsDir, t+".creds")
		opts, err := user.options()
		if err != nil {
			return err
		}
		tc, err := nats.Connect(nf.url, opts...)
		if err != nil {
			return failed(fmt.Errorf("the server at %s stored tenant %s's account but refuses its user (%s): %w — does it run the operator of %s?",
				nf.url, t, user.creds, err, dir))
		}
		tc.Close()
	}
	return nil
}

// readSetup reads the files of a setup in dir (as natsconf names them):
// operator.jwt, keys/*.nk and accounts/*.jwt. A missing dir has none.
func readSetup(dir string) (map[string][]byte, error) {
	files := map[string][]byte{}
	read := func(rel string) error {
		b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(rel)))
		if err != nil {
			return err
		}
		files[rel] = b
		return nil
	}
	if err := read(natsconf.OperatorJWTFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	for _, sub := range []struct{ dir, ext string }{{"keys", ".nk"}, {"accounts", ".jwt"}} {
		entries, err := os.ReadDir(filepath.Join(dir, sub.dir))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range entries {
			if e.Type().IsRegular() && strings.HasSuffix(e.Name(), sub.ext) {
				if err := read(sub.dir + "/" + e.Name()); err != nil {
					return nil, err
				}
			}
		}
	}
	return files, nil
}

// configuredResolverDir is the resolver directory an existing
// nats-server.conf names, or "".
func configuredResolverDir(confPath string) string {
	m, err := conf.ParseFile(confPath)
	if err != nil {
		return ""
	}
	r, _ := m["resolver"].(map[string]any)
	d, _ := r["dir"].(string)
	return d
}

func fileMode(secret bool) os.FileMode {
	if secret {
		return 0o600
	}
	return 0o644
}

// writeNew writes a file that must not exist yet (a key is never replaced).
func writeNew(p string, data []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// writeReplace replaces a file at once (a server reading it sees the old or
// the new one).
func writeReplace(p string, data []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), p)
}
