package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
)

// A tenant's registry client is kept while its credentials file is the
// same version, and read again once the file is replaced (a Secret's
// update), rewritten, or removed.
func TestTenantRegistryIsKeptUntilItsCredentialsChange(t *testing.T) {
	dir := t.TempDir()
	shared, err := registry.New(registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	regFor := tenantRegistries(shared, dir, kaniko.Config{Namespace: "builds"})
	path := filepath.Join(dir, "acme", "config.json")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(p, user string) {
		t.Helper()
		body := `{"auths":{"registry.example:5000":{"username":"` + user + `","password":"pw"}}}`
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	own := func() *registry.Client {
		t.Helper()
		r, err := regFor("acme")
		if err != nil {
			t.Fatalf("acme's registry: %v", err)
		}
		return r.(tenantRegistry).own
	}

	if _, err := regFor("acme"); err == nil || !strings.Contains(err.Error(), "acme") || !strings.Contains(err.Error(), "is missing") {
		t.Fatalf("without credentials: %v, want the missing file named", err)
	}
	write(path, "first")
	first := own()
	if again := own(); again != first {
		t.Fatal("the same credentials file gave a new client: it should be kept")
	}

	// A Secret's update: a new file renamed over the old one.
	next := filepath.Join(dir, "acme", "next.json")
	write(next, "second")
	if err := os.Rename(next, path); err != nil {
		t.Fatal(err)
	}
	second := own()
	if second == first {
		t.Fatal("the credentials file was replaced, and the old client was kept")
	}

	// Rewritten in place, a different size.
	write(path, "a-third-user")
	third := own()
	if third == second {
		t.Fatal("the credentials file was rewritten, and the old client was kept")
	}

	// Broken, then removed: an error each time, never the kept client.
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := regFor("acme"); err == nil || !strings.Contains(err.Error(), "registry credentials") {
		t.Fatalf("with a broken credentials file: %v, want an error", err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if _, err := regFor("acme"); err == nil || !strings.Contains(err.Error(), "is missing") {
		t.Fatalf("with the credentials file removed: %v, want an error", err)
	}
	write(path, "back")
	if back := own(); back == third {
		t.Fatal("the credentials came back, and the client from before their removal was given")
	}
}
