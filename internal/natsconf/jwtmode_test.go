package natsconf

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	v1 "github.com/buildq/buildq/api/v1"
)

// credsOption writes the user's credentials file and returns the option
// that connects with it.
func credsOption(t *testing.T, s *JWTSetup, user string) nats.Option {
	t.Helper()
	creds, err := s.UserCreds(user)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), user+".creds")
	if err := os.WriteFile(f, creds, 0o600); err != nil {
		t.Fatal(err)
	}
	return nats.UserCredentials(f)
}

// forgedAccount is an account the operator signed (by mistake, or a
// stolen operator key is not the threat here: an account JWT shaped by
// someone who wants another tenant's subjects) with the given imports,
// and a user of it.
type forgedAccount struct {
	key  nkeys.KeyPair
	pub  string
	jwt  string
	user nats.Option
}

func forge(t *testing.T, s *JWTSetup, name string, imports func(pub string) []*jwt.Import) forgedAccount {
	t.Helper()
	kp, _ := nkeys.CreateAccount()
	pub, _ := kp.PublicKey()
	ac := jwt.NewAccountClaims(pub)
	ac.Name = name
	ac.Imports = imports(pub)
	token, err := ac.Encode(s.Operator)
	if err != nil {
		t.Fatal(err)
	}
	ukp, _ := nkeys.CreateUser()
	upub, _ := ukp.PublicKey()
	uc := jwt.NewUserClaims(upub)
	uc.Name = name
	ujwt, err := uc.Encode(kp)
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := ukp.Seed()
	return forgedAccount{key: kp, pub: pub, jwt: token, user: nats.UserJWTAndSeed(ujwt, string(seed))}
}

// activation is a token BUILDQ signs for account pub to import subject.
func activation(t *testing.T, s *JWTSetup, pub, subject string, typ jwt.ExportType) string {
	t.Helper()
	act := jwt.NewActivationClaims(pub)
	act.ImportSubject, act.ImportType = jwt.Subject(subject), typ
	token, err := act.Encode(s.Buildq.Key)
	if err != nil {
		t.Fatal(err)
	}
	return token
}

func TestJWTModeServer(t *testing.T) {
	t.Parallel()
	s, err := NewJWTSetup([]string{"acme", "globex"})
	if err != nil {
		t.Fatal(err)
	}
	buildq := s.Buildq.PublicKey()

	// An account whose import names globex's request subject with the
	// activation BUILDQ gave it for its own, preloaded into the server
	// (past the validation a push gets).
	preloaded := forge(t, s, "tenant-evil", func(pub string) []*jwt.Import {
		return []*jwt.Import{{Account: buildq, Type: jwt.Service, Subject: jwt.Subject(v1.RequestSubject("globex")),
			Token: activation(t, s, pub, v1.RequestSubject("evil"), jwt.Service)}}
	})
	// The same without imports, for contrast.
	control := forge(t, s, "tenant-control", func(string) []*jwt.Import { return nil })
	conf, err := s.ServerConfig(filepath.Join(t.TempDir(), "jwt"))
	if err != nil {
		t.Fatal(err)
	}
	conf = []byte(strings.Replace(string(conf), "resolver_preload: {\n",
		"resolver_preload: {\n  "+preloaded.pub+": \""+preloaded.jwt+"\"\n  "+control.pub+": \""+control.jwt+"\"\n", 1))
	// An account the server does not have is looked up from the other
	// servers for resolver.timeout (1.9 s by default); there are none.
	conf = []byte(strings.Replace(string(conf), "allow_delete: false\n", "allow_delete: false\n  timeout: \"100ms\"\n", 1))
	srv := startServer(t, conf)
	url := srv.ClientURL()
	w := world{
		worker: connect(t, url, "buildq-worker", credsOption(t, s, WorkerKey)),
		acme:   connect(t, url, "acme", credsOption(t, s, "acme")),
		globex: connect(t, url, "globex", credsOption(t, s, "globex")),
	}
	w.accounts = map[string]string{}
	for _, a := range s.Tenants {
		w.accounts[a.Tenant] = a.PublicKey()
	}
	checkTenantsApart(t, w)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sys := connect(t, url, "sys", credsOption(t, s, SysKey))
	wjs, _ := jetstream.New(w.worker.nc)
	requests := func() uint64 { return msgs(t, wjs, v1.RequestsStream) }

	t.Run("a tenant added to the running server gets its PubAck", func(t *testing.T) {
		buildqJWT := s.Buildq.JWT
		added, err := s.AddTenants([]string{"initech"})
		if err != nil {
			t.Fatal(err)
		}
		if s.Buildq.JWT != buildqJWT {
			t.Fatal("BUILDQ's JWT changed")
		}
		if _, err := tryConnect(url, "initech", credsOption(t, s, "initech")); err == nil {
			t.Fatal("initech connected before its account was pushed")
		}
		msg, err := PushAccount(ctx, sys.nc, added[0].JWT)
		if err != nil || msg != "jwt updated" {
			t.Fatalf("push initech: %q %v", msg, err)
		}
		initech := connect(t, url, "initech", credsOption(t, s, "initech"))
		before := requests()
		ack(t, initech, v1.RequestSubject("initech"))
		if got := requests(); got != before+1 {
			t.Fatalf("%d requests, want %d", got, before+1)
		}
		// Its status service too (the worker's queue subscription from
		// checkTenantsApart answers).
		if r, err := initech.nc.Request(v1.APIStatusSubject("initech"), []byte("id"), 5*time.Second); err != nil || string(r.Data) != "answer for buildq.api.status.initech" {
			t.Fatalf("initech's status request: %v %v", r, err)
		}
	})

	t.Run("only the system account's user may push", func(t *testing.T) {
		admin := connect(t, url, "buildq-admin", credsOption(t, s, AdminKey))
		f := forge(t, s, "tenant-x", func(string) []*jwt.Import { return nil })
		if _, err := PushAccount(ctx, admin.nc, f.jwt); err == nil || !strings.Contains(err.Error(), "nobody answers") {
			t.Fatalf("push as admin: %v", err)
		}
	})

	t.Run("the preloaded account importing another tenant's subject is refused", func(t *testing.T) {
		if _, err := tryConnect(url, "evil", preloaded.user); err == nil {
			t.Fatal("a user of the forged account connected")
		}
		connect(t, url, "control", control.user)
	})

	// Pushed accounts whose imports reach beyond their own subjects: the
	// server refuses each, and says why.
	for name, c := range map[string]struct {
		imports func(pub string) []*jwt.Import
		want    string
	}{
		"another tenant's request subject with its own activation": {func(pub string) []*jwt.Import {
			return []*jwt.Import{{Account: buildq, Type: jwt.Service, Subject: jwt.Subject(v1.RequestSubject("globex")),
				Token: activation(t, s, pub, v1.RequestSubject("evil"), jwt.Service)}}
		}, "activation token import subject"},
		"every request subject with its own activation": {func(pub string) []*jwt.Import {
			return []*jwt.Import{{Account: buildq, Type: jwt.Service, Subject: jwt.Subject(v1.RequestsPrefix + ".*"),
				Token: activation(t, s, pub, v1.RequestSubject("evil"), jwt.Service)}}
		}, "activation token import subject"},
		"every tenant's results with its own activation": {func(pub string) []*jwt.Import {
			return []*jwt.Import{{Account: buildq, Type: jwt.Stream, Subject: "buildq.results.*.>",
				Token: activation(t, s, pub, "buildq.results.evil.>", jwt.Stream)}}
		}, "activation token import subject"},
		"another tenant's activation": {func(string) []*jwt.Import {
			g, _ := s.Tenant("globex")
			gc, err := jwt.DecodeAccountClaims(g.JWT)
			if err != nil {
				t.Fatal(err)
			}
			return []*jwt.Import{gc.Imports[0]}
		}, "activation token doesn't match account"},
	} {
		t.Run("refused: "+name, func(t *testing.T) {
			f := forge(t, s, "tenant-evil", c.imports)
			_, err := PushAccount(ctx, sys.nc, f.jwt)
			if err == nil || !strings.Contains(err.Error(), "refused by the server") || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("push: %v, want the server's refusal with %q", err, c.want)
			}
			if testing.Verbose() {
				t.Log(err)
			}
			if _, err := tryConnect(url, "evil", f.user); err == nil {
				t.Fatal("a user of the refused account connected")
			}
		})
	}

	t.Run("imports of another tenant's subjects without activation get nothing", func(t *testing.T) {
		f := forge(t, s, "tenant-evil", func(string) []*jwt.Import {
			return []*jwt.Import{
				{Account: buildq, Type: jwt.Service, Subject: jwt.Subject(v1.RequestSubject("globex"))},
				{Account: buildq, Type: jwt.Service, Subject: jwt.Subject(v1.APIStatusSubject("globex"))},
				{Account: buildq, Type: jwt.Stream, Subject: "buildq.results.globex.>"},
			}
		})
		// The account itself is valid (a token is optional in a JWT), so
		// the server takes it; its imports are not authorized.
		if _, err := PushAccount(ctx, sys.nc, f.jwt); err != nil {
			t.Fatal(err)
		}
		evil := connect(t, url, "evil", f.user)
		sub, err := evil.nc.SubscribeSync("buildq.results.globex.>")
		if err != nil {
			t.Fatal(err)
		}
		if err := evil.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		before := requests()
		js, _ := jetstream.New(evil.nc)
		pctx, pcancel := context.WithTimeout(ctx, 250*time.Millisecond)
		defer pcancel()
		if _, err := js.Publish(pctx, v1.RequestSubject("globex"), []byte(`{}`)); err == nil {
			t.Fatal("the unauthorized import got a PubAck")
		}
		if _, err := evil.nc.Request(v1.APIStatusSubject("globex"), []byte("id"), 250*time.Millisecond); err == nil {
			t.Fatal("the unauthorized import's status request was answered")
		}
		if err := w.worker.nc.Publish("buildq.results.globex.y", []byte("y")); err != nil {
			t.Fatal(err)
		}
		if err := w.worker.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		// globex, subscribed before, gets it; the forged account does not.
		ack(t, w.globex, v1.RequestSubject("globex"))
		if got := requests(); got != before+1 {
			t.Fatalf("%d requests, want %d (globex's own)", got, before+1)
		}
		if m, err := sub.NextMsg(100 * time.Millisecond); err == nil {
			t.Fatalf("the forged account received %s", m.Subject)
		}
	})
}
