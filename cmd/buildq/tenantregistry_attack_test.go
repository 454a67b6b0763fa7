package main

// Attacks on the tenant registry client cache (tenantregistry.go): a
// credentials file that changes while it keeps its inode, size and
// modification time never keeps the old client, and a Secret's update
// swapped in by the kubelet is seen by the next request.

import (
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

// credsEnv is a tenantRegistryCache over a temporary directory, its
// clock later by ahead (a file written now looks settled when ahead is
// past racyWindow), and its reads counted.
type credsEnv struct {
	t     *testing.T
	dir   string
	c     *tenantRegistryCache
	reads atomic.Int64
}

func newCredsEnv(t *testing.T, ahead time.Duration) *credsEnv {
	t.Helper()
	shared, err := registry.New(registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e := &credsEnv{t: t, dir: t.TempDir()}
	e.c = &tenantRegistryCache{shared: shared, dir: e.dir, kc: kaniko.Config{Namespace: "builds"},
		now:  func() time.Time { return time.Now().Add(ahead) },
		stat: os.Stat,
		read: func(p string) ([]byte, error) { e.reads.Add(1); return os.ReadFile(p) },
		kept: map[string]keptRegistry{}}
	return e
}

func (e *credsEnv) path(tenant string) string { return filepath.Join(e.dir, tenant, "config.json") }

// write writes a docker config whose password is secret at p.
func (e *credsEnv) write(p, secret string) {
	e.t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		e.t.Fatal(err)
	}
	body := `{"auths":{"registry.example:5000":{"username":"robot","password":"` + secret + `"}}}`
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		e.t.Fatal(err)
	}
}

func (e *credsEnv) own(tenant string) *registry.Client {
	e.t.Helper()
	r, err := e.c.registryFor(tenant)
	if err != nil {
		e.t.Fatalf("%s's registry: %v", tenant, err)
	}
	return r.(tenantRegistry).own
}

// The two ways a file is looked at: changed just now (its times may not
// show a write within the same tick: its bytes are compared), and
// settled (its times do).
var credsClocks = []struct {
	name  string
	ahead time.Duration
}{{"changed just now", 0}, {"settled", time.Hour}}

// A rotated token of the same length (robot accounts' secrets are), written
// in place by a tool that keeps the modification time (cp -p, install -p,
// rsync -t --inplace, tar): same inode, same size, same mtime.
func TestAttack_CredentialsRewrittenInPlaceWithTheirMtimeKeptAreReadAgain(t *testing.T) {
	for _, clk := range credsClocks {
		t.Run(clk.name, func(t *testing.T) {
			e := newCredsEnv(t, clk.ahead)
			p := e.path("acme")
			e.write(p, "token-AAAAAAAAAAAA")
			fi, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			first := e.own("acme")
			e.write(p, "token-BBBBBBBBBBBB")
			if err := os.Chtimes(p, fi.ModTime(), fi.ModTime()); err != nil {
				t.Fatal(err)
			}
			if e.own("acme") == first {
				t.Fatal("acme's credentials were rewritten in place (a rotated token), and the client of the old token was kept")
			}
		})
	}
}

// The file removed and written anew, its mtime kept: the filesystem may
// hand the freed inode straight back, and os.SameFile cannot tell the new
// file from the old one.
func TestAttack_CredentialsRecreatedOnTheSameInodeAreReadAgain(t *testing.T) {
	for _, clk := range credsClocks {
		t.Run(clk.name, func(t *testing.T) {
			e := newCredsEnv(t, clk.ahead)
			p := e.path("acme")
			e.write(p, "token-AAAAAAAAAAAA")
			before, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			first := e.own("acme")
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			e.write(p, "token-BBBBBBBBBBBB")
			if err := os.Chtimes(p, before.ModTime(), before.ModTime()); err != nil {
				t.Fatal(err)
			}
			if e.own("acme") == first {
				t.Fatal("acme's credentials file was replaced by a new one (same size and mtime), and the old client was kept")
			}
		})
	}
}

// A clock too coarse to tell two writes apart: the file's every time and
// its inode are as they were, its bytes are not. A file changed within
// racyWindow of the look is read again: the bytes tell.
func TestAttack_CredentialsChangedWithinOneTickOfACoarseClockAreReadAgain(t *testing.T) {
	e := newCredsEnv(t, 0)
	p := e.path("acme")
	e.write(p, "token-AAAAAAAAAAAA")
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	// Every stat from now on shows the first version's times.
	e.c.stat = func(string) (os.FileInfo, error) { return fi, nil }
	first := e.own("acme")
	if e.own("acme") != first {
		t.Fatal("the same bytes gave a new client")
	}
	e.write(p, "token-BBBBBBBBBBBB")
	if e.own("acme") == first {
		t.Fatal("acme's credentials changed within one tick of the clock, and the old client was kept")
	}
}

// A file last changed well before it is looked at costs a stat per
// request, not a read; one changed just now is read on every request and
// its client kept while its bytes stay the same.
func TestASettledCredentialsFileIsNotReadAgain(t *testing.T) {
	e := newCredsEnv(t, time.Hour)
	p := e.path("acme")
	e.write(p, "token-AAAAAAAAAAAA")
	first := e.own("acme")
	if n := e.reads.Load(); n != 1 {
		t.Fatalf("%d reads for the first request, want 1", n)
	}
	for range 3 {
		if e.own("acme") != first {
			t.Fatal("a settled, unchanged file gave a new client")
		}
	}
	if n := e.reads.Load(); n != 1 {
		t.Fatalf("%d reads after four requests of a settled file, want 1", n)
	}

	recent := newCredsEnv(t, 0)
	recent.write(recent.path("acme"), "token-AAAAAAAAAAAA")
	first = recent.own("acme")
	for range 3 {
		if recent.own("acme") != first {
			t.Fatal("the same bytes gave a new client")
		}
	}
	if n := recent.reads.Load(); n != 4 {
		t.Fatalf("%d reads for four requests of a file changed just now, want 4", n)
	}
}

// The kubelet's atomic writer (config.json -> ..data/config.json, ..data
// -> ..<timestamp>) swaps in a new version of the same size and,
// adversarially, the same mtime: the next request has the new client. A
// dangling link and a directory in the file's place are errors, never
// the kept client.
func TestAttack_ASecretSwappedInByTheKubeletIsSeenByTheNextRequest(t *testing.T) {
	for _, clk := range credsClocks {
		t.Run(clk.name, func(t *testing.T) {
			e := newCredsEnv(t, clk.ahead)
			td := filepath.Join(e.dir, "acme")
			e.write(filepath.Join(td, "..2026_01_01_00_00_00.1", "config.json"), "token-AAAAAAAAAAAA")
			if err := os.Symlink("..2026_01_01_00_00_00.1", filepath.Join(td, "..data")); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink("..data/config.json", filepath.Join(td, "config.json")); err != nil {
				t.Fatal(err)
			}
			old, err := os.Stat(filepath.Join(td, "config.json"))
			if err != nil {
				t.Fatal(err)
			}
			first := e.own("acme")

			newFile := filepath.Join(td, "..2026_01_01_00_00_01.2", "config.json")
			e.write(newFile, "token-BBBBBBBBBBBB")
			if err := os.Chtimes(newFile, old.ModTime(), old.ModTime()); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink("..2026_01_01_00_00_01.2", filepath.Join(td, "..data_tmp")); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(filepath.Join(td, "..data_tmp"), filepath.Join(td, "..data")); err != nil {
				t.Fatal(err)
			}
			if err := os.RemoveAll(filepath.Join(td, "..2026_01_01_00_00_00.1")); err != nil {
				t.Fatal(err)
			}
			if e.own("acme") == first {
				t.Fatal("the Secret's update was swapped in, and the old client was kept")
			}

			if err := os.Remove(filepath.Join(td, "..data")); err != nil {
				t.Fatal(err)
			}
			if _, err := e.c.registryFor("acme"); err == nil {
				t.Fatal("a dangling credentials link gave a client")
			}
			if err := os.Remove(filepath.Join(td, "config.json")); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(filepath.Join(td, "config.json"), 0o755); err != nil {
				t.Fatal(err)
			}
			if _, err := e.c.registryFor("acme"); err == nil {
				t.Fatal("a directory in place of the credentials file gave a client")
			}
		})
	}
}

// Tenants asked for at once while their files are swapped never get
// another tenant's client (run with -race).
func TestAttack_TenantsAskedForAtOnceNeverGetAnothersClient(t *testing.T) {
	e := newCredsEnv(t, 0)
	tenants := []string{"acme", "globex"}
	firstOf := map[string]*registry.Client{}
	for _, tn := range tenants {
		e.write(e.path(tn), tn)
		firstOf[tn] = e.own(tn)
	}
	done := make(chan struct{})
	errs := make(chan string, 400)
	for _, tn := range tenants {
		go func() {
			defer func() { done <- struct{}{} }()
			for range 200 {
				r, err := e.c.registryFor(tn)
				if err != nil {
					continue
				}
				for _, other := range tenants {
					if other != tn && r.(tenantRegistry).own == firstOf[other] {
						errs <- tn + " got " + other + "'s client"
					}
				}
			}
		}()
	}
	for range 50 {
		for _, tn := range tenants {
			tmp := filepath.Join(e.dir, tn, "next.json")
			e.write(tmp, tn)
			if err := os.Rename(tmp, e.path(tn)); err != nil {
				t.Fatal(err)
			}
		}
	}
	<-done
	<-done
	close(errs)
	for msg := range errs {
		t.Error(msg)
	}
}
