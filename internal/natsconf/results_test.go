package natsconf

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
)

// The stored-results service (buildq.api.results.<tenant>): a tenant's
// watch asks it for its own results it missed while disconnected, as
// tenants may not read BUILDQ_RESULTS. Every tenant imports its own, the
// worker answers every tenant's, BUILDQ exports it, and nothing a tenant
// may publish reaches another tenant's service or the stream itself.
func TestTenantsReachTheirOwnStoredResultsOnly(t *testing.T) {
	t.Parallel()
	for _, tenant := range []string{"acme", "globex", "results"} {
		if !slices.Contains(TenantServices(tenant), v1.APIResultsSubject(tenant)) {
			t.Errorf("tenant %s does not import %s: %v", tenant, v1.APIResultsSubject(tenant), TenantServices(tenant))
		}
		for _, s := range append(TenantServices(tenant), append(TenantStreams(tenant), TenantInboxes(tenant)...)...) {
			for _, forbidden := range []string{
				v1.APIResultsSubject("other"),
				"$JS.API.STREAM.MSG.GET." + v1.ResultsStream,
				"$JS.API.STREAM.INFO." + v1.ResultsStream,
				"$JS.API.CONSUMER.CREATE." + v1.ResultsStream,
				"$JS.API.DIRECT.GET." + v1.ResultsStream,
			} {
				if server.SubjectsCollide(s, forbidden) {
					t.Errorf("tenant %s may use %q, which reaches %q", tenant, s, forbidden)
				}
			}
		}
	}
	if !slices.Contains(WorkerSubscribe(), v1.APIResultsPrefix+".*") {
		t.Errorf("the worker may not subscribe to %s.*: %v", v1.APIResultsPrefix, WorkerSubscribe())
	}
	var exported []string
	for _, e := range buildqExports() {
		exported = append(exported, string(e.Subject))
	}
	if !slices.Contains(exported, v1.APIResultsPrefix+".*") {
		t.Errorf("BUILDQ does not export %s.*: %v", v1.APIResultsPrefix, exported)
	}
}

// The shipped configuration file and a decentralized setup, on a server:
// each tenant's request on its own stored-results service reaches the
// worker (for that tenant's subject, with a reply into its own account);
// one on another tenant's is refused and never reaches the worker.
func TestStoredResultsServiceApart(t *testing.T) {
	t.Parallel()
	t.Run("config file", func(t *testing.T) {
		t.Parallel()
		keys, err := NewUserKeys(Users([]string{"acme", "globex"}))
		if err != nil {
			t.Fatal(err)
		}
		conf, err := os.ReadFile(filepath.Join("..", "..", "deploy", "nats", "buildq.conf"))
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			conf = []byte(strings.ReplaceAll(string(conf), "$"+NKeyVar(k.User), fmt.Sprintf("%q", k.Public)))
		}
		url := startServer(t, conf).ClientURL()
		opts := seedFiles(t, keys)
		checkStoredResultsApart(t, world{
			worker: connect(t, url, "buildq-worker", opts["worker"]),
			acme:   connect(t, url, "acme", opts["acme"]),
			globex: connect(t, url, "globex", opts["globex"]),
		})
	})
	t.Run("jwt", func(t *testing.T) {
		t.Parallel()
		s, err := NewJWTSetup([]string{"acme", "globex"})
		if err != nil {
			t.Fatal(err)
		}
		conf, err := s.ServerConfig(filepath.Join(t.TempDir(), "jwt"))
		if err != nil {
			t.Fatal(err)
		}
		url := startServer(t, conf).ClientURL()
		checkStoredResultsApart(t, world{
			worker: connect(t, url, "buildq-worker", credsOption(t, s, WorkerKey)),
			acme:   connect(t, url, "acme", credsOption(t, s, "acme")),
			globex: connect(t, url, "globex", credsOption(t, s, "globex")),
		})
	})
}

func checkStoredResultsApart(t *testing.T, w world) {
	t.Helper()
	type asked struct{ subject, reply string }
	seen := make(chan asked, 16)
	if _, err := w.worker.nc.QueueSubscribe(v1.APIResultsPrefix+".*", "buildq-api", func(m *nats.Msg) {
		seen <- asked{m.Subject, m.Reply}
		_ = m.Respond([]byte("results of " + m.Subject))
	}); err != nil {
		t.Fatal(err)
	}
	if err := w.worker.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ask := func(t *testing.T, u *user, tenant string) {
		t.Helper()
		subject := v1.APIResultsSubject(tenant)
		r, err := u.nc.Request(subject, []byte(`{"afterSeq":1}`), 5*time.Second)
		if err != nil {
			t.Fatalf("%s's request on %s: %v", u.name, subject, err)
		}
		if want := "results of " + subject; string(r.Data) != want {
			t.Fatalf("%s's answer %q, want %q", u.name, r.Data, want)
		}
		select {
		case a := <-seen:
			if a.subject != subject || !strings.HasPrefix(a.reply, "_R_.") {
				t.Fatalf("the worker got %+v: want %s with a service-import reply", a, subject)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the worker saw no request")
		}
	}
	ask(t, w.acme, "acme")
	ask(t, w.globex, "globex")

	s := v1.APIResultsSubject("acme")
	if err := w.globex.nc.PublishRequest(s, w.globex.nc.NewRespInbox(), []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	w.globex.refused(t, "Publish", s)
	if err := w.globex.nc.PublishRequest("$JS.API.STREAM.MSG.GET."+v1.ResultsStream, w.globex.nc.NewRespInbox(), []byte(`{"seq":1}`)); err != nil {
		t.Fatal(err)
	}
	w.globex.refused(t, "Publish", "$JS.API.STREAM.MSG.GET."+v1.ResultsStream)
	// In order: had globex's request reached the worker, it would come
	// before this one.
	ask(t, w.globex, "globex")
}
