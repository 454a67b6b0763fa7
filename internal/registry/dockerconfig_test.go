package registry

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
)

func TestDockerConfigResolution(t *testing.T) {
	t.Parallel()
	type want struct{ user, pass, identity, registry string }
	for _, tc := range []struct {
		name   string
		config string
		repo   string
		want   *want // nil: anonymous
	}{
		{
			name:   "auth is base64 user:pass",
			config: `{"auths":{"reg.example":{"auth":"` + b64("alice:pw") + `"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "alice", pass: "pw"},
		},
		{
			name:   "auth without padding",
			config: `{"auths":{"reg.example":{"auth":"` + strings.TrimRight(b64("alice:pw1"), "=") + `"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "alice", pass: "pw1"},
		},
		{
			name:   "password may contain colons",
			config: `{"auths":{"reg.example":{"auth":"` + b64("alice:a:b:c") + `"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "alice", pass: "a:b:c"},
		},
		{
			name:   "username and password",
			config: `{"auths":{"reg.example":{"username":"bob","password":"pw","email":"bob@example.com"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "bob", pass: "pw"},
		},
		{
			name:   "auth wins over username and password, as in docker",
			config: `{"auths":{"reg.example":{"auth":"` + b64("alice:pw") + `","username":"bob","password":"other"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "alice", pass: "pw"},
		},
		{
			name:   "https://host/v1/ key",
			config: `{"auths":{"https://reg.example/v1/":{"auth":"` + b64("alice:pw") + `"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "alice", pass: "pw"},
		},
		{
			name:   "https://host key",
			config: `{"auths":{"https://reg.example":{"username":"bob","password":"pw"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "bob", pass: "pw"},
		},
		{
			name:   "http://host:port/ key",
			config: `{"auths":{"http://reg.example:5000/":{"username":"bob","password":"pw"}}}`,
			repo:   "reg.example:5000/team/app",
			want:   &want{user: "bob", pass: "pw"},
		},
		{
			name:   "port is part of the host",
			config: `{"auths":{"reg.example:5000":{"username":"bob","password":"pw"}}}`,
			repo:   "reg.example/team/app",
		},
		{
			name:   "host names are case-insensitive",
			config: `{"auths":{"HTTPS://Reg.Example/v2/":{"username":"bob","password":"pw"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "bob", pass: "pw"},
		},
		{
			name:   "docker hub legacy key",
			config: `{"auths":{"https://index.docker.io/v1/":{"username":"hub","password":"pw"}}}`,
			repo:   "docker.io/library/alpine",
			want:   &want{user: "hub", pass: "pw"},
		},
		{
			name:   "docker hub short key",
			config: `{"auths":{"docker.io":{"username":"hub","password":"pw"}}}`,
			repo:   "index.docker.io/acme/app",
			want:   &want{user: "hub", pass: "pw"},
		},
		{
			name:   "a bare host key wins over decorated ones",
			config: `{"auths":{"https://reg.example/v1/":{"username":"old","password":"pw"},"reg.example":{"username":"new","password":"pw"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "new", pass: "pw"},
		},
		{
			name: "the most specific namespace key wins",
			config: `{"auths":{"reg.example":{"username":"admin","password":"pw"},` +
				`"reg.example/team":{"username":"robot$team","password":"pw2"}}}`,
			repo: "reg.example/team/app",
			want: &want{user: "robot$team", pass: "pw2"},
		},
		{
			name: "namespace keys do not leak to other namespaces",
			config: `{"auths":{"reg.example":{"username":"admin","password":"pw"},` +
				`"reg.example/team":{"username":"robot$team","password":"pw2"}}}`,
			repo: "reg.example/teammate/app",
			want: &want{user: "admin", pass: "pw"},
		},
		{
			name:   "a /v1/ key is not a namespace",
			config: `{"auths":{"https://reg.example/v1/":{"username":"old","password":"pw"},"reg.example":{"username":"new","password":"pw"}}}`,
			repo:   "reg.example/v1/app",
			want:   &want{user: "new", pass: "pw"},
		},
		{
			name:   "identity token",
			config: `{"auths":{"reg.example":{"username":"<token>","identitytoken":"refresh"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "<token>", identity: "refresh"},
		},
		{
			name:   "registry token",
			config: `{"auths":{"reg.example":{"registrytoken":"bearer"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{registry: "bearer"},
		},
		{
			name:   "unknown registry is anonymous",
			config: `{"auths":{"reg.example":{"username":"bob","password":"pw"}}}`,
			repo:   "other.example/team/app",
		},
		{
			name:   "empty entries are ignored",
			config: `{"auths":{"reg.example":{},"https://reg.example/v1/":{"username":"bob","password":"pw"}}}`,
			repo:   "reg.example/team/app",
			want:   &want{user: "bob", pass: "pw"},
		},
		{
			name:   "no auths is anonymous",
			config: `{"credsStore":"desktop"}`,
			repo:   "reg.example/team/app",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newClient(t, Options{DockerConfig: writeFile(t, tc.config)})
			got := resolved(t, c, tc.repo)
			switch {
			case tc.want == nil && got != nil:
				t.Fatalf("got %+v, want anonymous", *got)
			case tc.want == nil:
			case got == nil:
				t.Fatalf("got anonymous, want %+v", *tc.want)
			default:
				g := want{user: got.Username, pass: got.Password, identity: got.IdentityToken, registry: got.RegistryToken}
				if g != *tc.want {
					t.Fatalf("got %+v, want %+v", g, *tc.want)
				}
			}
		})
	}
}

func TestDockerConfigErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		config string
		want   []string // substrings of the error, besides the path
	}{
		{"bad JSON", `{"auths": {`, []string{"JSON"}},
		{"auths is not an object", `{"auths": []}`, []string{"JSON"}},
		{"auth is not base64", `{"auths":{"reg.example":{"auth":"%%%"}}}`, []string{"reg.example", "base64"}},
		{"auth has no colon", `{"auths":{"reg.example":{"auth":"` + b64("alice") + `"}}}`, []string{"reg.example", "username:password"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := writeFile(t, tc.config)
			_, err := New(Options{DockerConfig: path})
			if err == nil {
				t.Fatal("New succeeded")
			}
			for _, s := range append(tc.want, path) {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %q", err, s)
				}
			}
		})
	}
	t.Run("missing file", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "nope.json")
		_, err := New(Options{DockerConfig: path})
		if err == nil || !strings.Contains(err.Error(), path) {
			t.Fatalf("err = %v, want it to name %s", err, path)
		}
	})
	t.Run("no config is anonymous", func(t *testing.T) {
		t.Parallel()
		c := newClient(t, Options{})
		if got := resolved(t, c, "reg.example/team/app"); got != nil {
			t.Fatalf("got %+v, want anonymous", *got)
		}
	})
	t.Run("the file is read once", func(t *testing.T) {
		t.Parallel()
		path := writeDockerConfig(t, "reg.example", "alice", "pw")
		c := newClient(t, Options{DockerConfig: path})
		if err := os.WriteFile(path, []byte("garbage"), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := resolved(t, c, "reg.example/team/app"); got == nil || got.Username != "alice" {
			t.Fatalf("got %+v, want alice", got)
		}
	})
}

func TestDockerConfigJSON(t *testing.T) {
	t.Parallel()

	t.Run("round-trips through New", func(t *testing.T) {
		t.Parallel()
		b, err := DockerConfigJSON("reg.example:5000", "robot$ci", "p@ss:word")
		if err != nil {
			t.Fatal(err)
		}
		c := newClient(t, Options{DockerConfig: writeFile(t, string(b))})
		got := resolved(t, c, "reg.example:5000/team/app")
		if got == nil || got.Username != "robot$ci" || got.Password != "p@ss:word" {
			t.Fatalf("got %+v, want robot$ci / p@ss:word", got)
		}
	})
	t.Run("is the docker login shape", func(t *testing.T) {
		t.Parallel()
		b, err := DockerConfigJSON("reg.example", "alice", "pw")
		if err != nil {
			t.Fatal(err)
		}
		var f struct {
			Auths map[string]map[string]string `json:"auths"`
		}
		if err := json.Unmarshal(b, &f); err != nil {
			t.Fatal(err)
		}
		e, ok := f.Auths["reg.example"]
		if !ok || len(f.Auths) != 1 {
			t.Fatalf("auths = %v, want one entry for reg.example", f.Auths)
		}
		if e["auth"] != b64("alice:pw") || e["username"] != "alice" || e["password"] != "pw" {
			t.Fatalf("entry = %v", e)
		}
	})
	t.Run("authenticates against a registry", func(t *testing.T) {
		t.Parallel()
		host := serve(t, basicAuth(memRegistry(), "alice", "pw"))
		img := randomImage(t)
		seed(t, host+"/team/app:v1", img, withBasic("alice", "pw"))
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "alice", "pw"), Insecure: []string{host}})
		if got, want := mustHead(t, c, host+"/team/app:v1"), digestOf(t, img); got != want {
			t.Fatalf("digest %s, want %s", got, want)
		}
	})
	t.Run("rejects what it cannot render", func(t *testing.T) {
		t.Parallel()
		for _, args := range [][3]string{
			{"", "alice", "pw"},
			{"reg.example", "", "pw"},
			{"reg.example", "alice", ""},
			{"reg.example", "al:ice", "pw"},
		} {
			if _, err := DockerConfigJSON(args[0], args[1], args[2]); err == nil {
				t.Errorf("DockerConfigJSON%q succeeded", args)
			}
		}
	})
}

func TestKeychainIsContextAware(t *testing.T) {
	t.Parallel()
	c := newClient(t, Options{DockerConfig: writeDockerConfig(t, "reg.example", "alice", "pw")})
	kc, ok := c.keychain.(authn.ContextKeychain)
	if !ok {
		t.Fatal("keychain does not implement authn.ContextKeychain")
	}
	a, err := kc.ResolveContext(context.Background(), fakeResource("reg.example"))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := authn.Authorization(context.Background(), a)
	if err != nil || cfg.Username != "alice" {
		t.Fatalf("registry-level lookup: %+v, %v", cfg, err)
	}
}

type fakeResource string

func (f fakeResource) String() string      { return string(f) }
func (f fakeResource) RegistryStr() string { return string(f) }

// A config already read is parsed as given: the path only names it in
// errors, and a file at the path (gone, or changed since) is not read.
func TestDockerConfigDataIsParsedWithoutReadingThePath(t *testing.T) {
	t.Parallel()
	gone := filepath.Join(t.TempDir(), "config.json")
	c := newClient(t, Options{DockerConfig: gone, DockerConfigData: []byte(`{"auths":{"reg.example":{"username":"bob","password":"pw"}}}`)})
	if got := resolved(t, c, "reg.example/team/app"); got == nil || got.Username != "bob" || got.Password != "pw" {
		t.Fatalf("got %+v, want bob's credentials from the data given", got)
	}
	_, err := New(Options{DockerConfig: gone, DockerConfigData: []byte(`{"auths": {`)})
	if err == nil || !strings.Contains(err.Error(), gone) || !strings.Contains(err.Error(), "JSON") {
		t.Fatalf("err = %v, want a JSON error naming %s", err, gone)
	}
}
