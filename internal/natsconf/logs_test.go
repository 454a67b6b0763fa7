package natsconf

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// Build logs (DESIGN §3) are kept in BUILDQ_LOGS, one subject per run
// (buildq.logs.<key>.<run>), and served to tenants by the workers' logs
// service (buildq.api.logs.<tenant>) only. A tenant may ask its own logs
// service and nothing else: it may not subscribe to a log's subject, read
// the stream through the JetStream API, or ask another tenant's service.

const (
	logKey = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	logRun = "r1"
)

// The permission lists themselves, whatever account they are used in (the
// single-account configuration of the first version gave a tenant's user
// these lists in BUILDQ's own account): nothing a tenant may publish or
// subscribe to reaches a log, the JetStream API or another tenant's logs
// service.
func TestTenantPermissionsReachNoLog(t *testing.T) {
	t.Parallel()
	for _, tenant := range []string{"acme", "globex", "a", "logs"} {
		if !slices.Contains(TenantServices(tenant), v1.APILogsSubject(tenant)) {
			t.Errorf("tenant %s does not import its logs service %s: %v", tenant, v1.APILogsSubject(tenant), TenantServices(tenant))
		}
		lists := map[string][]string{
			"publish":   TenantServices(tenant),
			"subscribe": append(TenantStreams(tenant), TenantInboxes(tenant)...),
		}
		for kind, subjects := range lists {
			for _, s := range subjects {
				for _, forbidden := range []string{
					v1.LogsPrefix + ".>",
					v1.LogsSubject(logKey, logRun),
					"$JS.API.>",
					"$JS.API.STREAM.MSG.GET." + v1.LogsStream,
					"$JS.API.DIRECT.GET." + v1.LogsStream + "." + v1.LogsSubject(logKey, logRun),
					"$JS.API.CONSUMER.CREATE." + v1.LogsStream + ".x." + v1.LogsSubject(logKey, logRun),
					v1.APILogsSubject("other"),
				} {
					if server.SubjectsCollide(s, forbidden) {
						t.Errorf("tenant %s may %s %q, which reaches %q", tenant, kind, s, forbidden)
					}
				}
			}
		}
	}
	// The worker writes the logs and answers the logs service.
	if !slices.Contains(WorkerPublish(), v1.LogsPrefix+".>") {
		t.Errorf("the worker may not publish %s.>: %v", v1.LogsPrefix, WorkerPublish())
	}
	if !slices.Contains(WorkerSubscribe(), v1.APILogsPrefix+".*") {
		t.Errorf("the worker may not subscribe to %s.*: %v", v1.APILogsPrefix, WorkerSubscribe())
	}
	// BUILDQ exports the logs service and nothing of the logs themselves.
	var exported []string
	for _, e := range buildqExports() {
		exported = append(exported, string(e.Subject))
		for _, forbidden := range []string{v1.LogsSubject(logKey, logRun), "$JS.API.STREAM.MSG.GET." + v1.LogsStream} {
			if server.SubjectsCollide(string(e.Subject), forbidden) {
				t.Errorf("BUILDQ exports %s, which reaches %s", e.Subject, forbidden)
			}
		}
	}
	if !slices.Contains(exported, v1.APILogsPrefix+".*") {
		t.Errorf("BUILDQ does not export %s.*: %v", v1.APILogsPrefix, exported)
	}
}

// The shipped configuration file on a server.
func TestLogsApartFileMode(t *testing.T) {
	t.Parallel()
	tenants := []string{"acme", "globex"}
	keys, err := NewUserKeys(Users(tenants))
	if err != nil {
		t.Fatal(err)
	}
	conf, err := os.ReadFile(filepath.Join("..", "..", "deploy", "nats", "buildq.conf"))
	if err != nil {
		t.Fatal(err)
	}
	// The shipped file reads the keys from the environment; write them in
	// (t.Setenv would forbid t.Parallel).
	for _, k := range keys {
		conf = []byte(strings.ReplaceAll(string(conf), "$"+NKeyVar(k.User), fmt.Sprintf("%q", k.Public)))
	}
	s := startServer(t, conf)
	opts := seedFiles(t, keys)
	url := s.ClientURL()
	checkLogsApart(t, world{
		worker:   connect(t, url, "buildq-worker", opts["worker"]),
		acme:     connect(t, url, "acme", opts["acme"]),
		globex:   connect(t, url, "globex", opts["globex"]),
		accounts: map[string]string{"acme": TenantAccount("acme"), "globex": TenantAccount("globex")},
	}, func(string) string { return "_R_." })
}

// Decentralized mode; and an account that imports the logs themselves or
// the JetStream API, even with activations BUILDQ's key signed, gets
// nothing: BUILDQ exports no such subject.
func TestLogsApartJWTMode(t *testing.T) {
	t.Parallel()
	s, err := NewJWTSetup([]string{"acme", "globex"})
	if err != nil {
		t.Fatal(err)
	}
	buildq := s.Buildq.PublicKey()
	evil := forge(t, s, "tenant-evil", func(pub string) []*jwt.Import {
		return []*jwt.Import{
			{Account: buildq, Type: jwt.Stream, Subject: v1.LogsPrefix + ".>",
				Token: activation(t, s, pub, v1.LogsPrefix+".>", jwt.Stream)},
			{Account: buildq, Type: jwt.Service, Subject: "$JS.API.>",
				Token: activation(t, s, pub, "$JS.API.>", jwt.Service)},
		}
	})
	conf, err := s.ServerConfig(filepath.Join(t.TempDir(), "jwt"))
	if err != nil {
		t.Fatal(err)
	}
	conf = []byte(strings.Replace(string(conf), "resolver_preload: {\n",
		"resolver_preload: {\n  "+evil.pub+": \""+evil.jwt+"\"\n", 1))
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
	asked := checkLogsApart(t, w, func(string) string { return "_R_." })

	// The forged account's user has no permissions list: only what its
	// account imports limits it.
	e := connect(t, url, "evil", evil.user)
	sub, err := e.nc.SubscribeSync(v1.LogsPrefix + ".>")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wjs, _ := jetstream.New(w.worker.nc)
	if _, err := wjs.Publish(ctx, v1.LogsSubject(logKey, "r2"), []byte("a line\n")); err != nil {
		t.Fatalf("the worker's log line: %v", err)
	}
	// Its account has no JetStream: the server may say so, but tells
	// nothing of BUILDQ's stream.
	if r, err := e.nc.Request("$JS.API.STREAM.INFO."+v1.LogsStream, nil, 250*time.Millisecond); err == nil && !strings.Contains(string(r.Data), `"error"`) {
		t.Fatalf("the forged account's JetStream API request was answered: %s", r.Data)
	}
	if m, err := sub.NextMsg(250 * time.Millisecond); err == nil {
		t.Fatalf("the forged account received %s", m.Subject)
	}
	// The worker's connection gets requests in order: had the forged one
	// reached it, it would have come before acme's.
	asked(t, w.acme, "acme")
}

// The first version's single-account configuration: the tenants are users
// of BUILDQ's own account, with the generator's permission lists (and
// their own inbox prefix only: in one account the default inbox is every
// user's). The lists alone keep the logs from them.
func TestLogsApartSingleAccount(t *testing.T) {
	t.Parallel()
	w := &confWriter{}
	w.line("port: 4222")
	w.line("jetstream: enabled")
	w.open("accounts {")
	w.open("%s {", BuildqAccount)
	w.line("jetstream: enabled")
	w.open("users: [")
	w.open("{")
	w.line("user: worker, password: worker-pw")
	w.open("permissions: {")
	writePerms(w, "publish", workerPublish)
	writePerms(w, "subscribe", workerSubscribe)
	w.line("allow_responses: true")
	w.close("}")
	w.close("}")
	for _, tenant := range []string{"acme", "globex"} {
		w.open("{")
		w.line("user: %s, password: %s-pw", tenant, tenant)
		w.open("permissions: {")
		writePerms(w, "publish", plain(TenantServices(tenant)))
		writePerms(w, "subscribe", plain(append(TenantStreams(tenant), v1.InboxPrefix(tenant)+".>")))
		w.close("}")
		w.close("}")
	}
	w.close("]")
	w.close("}")
	w.close("}")
	srv := startServer(t, []byte(w.b.String()))
	url := srv.ClientURL()
	checkLogsApart(t, world{
		worker: connect(t, url, "buildq-worker", nats.UserInfo("worker", "worker-pw")),
		acme:   connect(t, url, "acme", nats.UserInfo("acme", "acme-pw"), nats.CustomInboxPrefix(v1.InboxPrefix("acme"))),
		globex: connect(t, url, "globex", nats.UserInfo("globex", "globex-pw"), nats.CustomInboxPrefix(v1.InboxPrefix("globex"))),
	}, func(tenant string) string { return v1.InboxPrefix(tenant) + "." })
}

// checkLogsApart runs the checks every configuration must pass: the
// worker makes BUILDQ_LOGS, writes a log line and answers the logs
// service; each tenant reaches its own logs service (the worker sees a
// reply subject starting with replyPrefix(tenant)) and no log, no JetStream API
// and no other tenant's logs service. It returns the check that a
// tenant's logs request reaches the worker next, for more checks after.
func checkLogsApart(t *testing.T, w world, replyPrefix func(tenant string) string) func(*testing.T, *user, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	wjs, err := jetstream.New(w.worker.nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wjs.CreateStream(ctx, jetstream.StreamConfig{
		Name: v1.LogsStream, Subjects: []string{v1.LogsPrefix + ".>"}, Storage: jetstream.MemoryStorage,
		AllowDirect: true,
	}); err != nil {
		t.Fatalf("the worker creates %s: %v", v1.LogsStream, err)
	}
	line := v1.AppendLogLine(nil, v1.LogLine{Time: time.Now(), Stream: v1.LogStreamBuildq, Attempt: 1, Text: []byte("claimed")})
	if a, err := wjs.Publish(ctx, v1.LogsSubject(logKey, logRun), line); err != nil || a.Stream != v1.LogsStream {
		t.Fatalf("the worker writes a log line: %v %v", a, err)
	}
	stored := func() uint64 { return msgs(t, wjs, v1.LogsStream) }

	type asked struct{ subject, reply, info string }
	seen := make(chan asked, 16)
	if _, err := w.worker.nc.QueueSubscribe(v1.APILogsPrefix+".*", "buildq-api", func(m *nats.Msg) {
		seen <- asked{m.Subject, m.Reply, m.Header.Get("Nats-Request-Info")}
		_ = m.Respond([]byte("log for " + m.Subject))
	}); err != nil {
		t.Fatal(err)
	}
	if err := w.worker.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	ask := func(t *testing.T, u *user, tenant string) {
		t.Helper()
		subject := v1.APILogsSubject(tenant)
		r, err := u.nc.Request(subject, []byte(logKey), 5*time.Second)
		if err != nil {
			t.Fatalf("%s's request on %s: %v", u.name, subject, err)
		}
		if want := "log for " + subject; string(r.Data) != want {
			t.Fatalf("%s's answer %q, want %q", u.name, r.Data, want)
		}
		select {
		case a := <-seen:
			if a.subject != subject || !strings.HasPrefix(a.reply, replyPrefix(tenant)) {
				t.Fatalf("the worker got %+v: want %s with a reply subject %s…", a, subject, replyPrefix(tenant))
			}
			if acc, ok := w.accounts[tenant]; ok && !strings.Contains(a.info, `"acc":"`+acc+`"`) {
				t.Fatalf("Nats-Request-Info %s does not name %s's account %s", a.info, tenant, acc)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the worker saw no request")
		}
	}

	t.Run("a tenant reaches its own logs service", func(t *testing.T) {
		ask(t, w.acme, "acme")
		ask(t, w.globex, "globex")
	})

	t.Run("a tenant does not reach another's logs service", func(t *testing.T) {
		s := v1.APILogsSubject("globex")
		if err := w.acme.nc.PublishRequest(s, w.acme.nc.NewRespInbox(), []byte(logKey)); err != nil {
			t.Fatal(err)
		}
		w.acme.refused(t, "Publish", s)
		if _, err := w.acme.nc.Request(s, []byte(logKey), 250*time.Millisecond); err == nil {
			t.Fatal("acme's request on globex's logs service was answered")
		}
		// In order: had one of those reached the worker, it would come
		// before this one.
		ask(t, w.acme, "acme")
	})

	t.Run("a tenant cannot subscribe to a log", func(t *testing.T) {
		var subs []*nats.Subscription
		for _, s := range []string{v1.LogsSubject(logKey, logRun), v1.LogsPrefix + ".*.*", v1.LogsPrefix + ".>", "buildq.>", ">"} {
			sub, err := w.acme.nc.SubscribeSync(s)
			if err != nil {
				t.Fatal(err)
			}
			w.acme.refused(t, "Subscription", s)
			subs = append(subs, sub)
		}
		before := stored()
		if _, err := wjs.Publish(ctx, v1.LogsSubject(logKey, logRun), line); err != nil {
			t.Fatal(err)
		}
		if err := w.worker.nc.Publish(v1.LogsSubject(logKey, logRun), line); err != nil {
			t.Fatal(err)
		}
		if err := w.worker.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		ask(t, w.acme, "acme")
		for _, sub := range subs {
			if m, err := sub.NextMsg(50 * time.Millisecond); err == nil {
				t.Fatalf("acme received %s on %s", m.Subject, sub.Subject)
			}
		}
		if got := stored(); got != before+2 {
			t.Fatalf("%s holds %d lines, want %d", v1.LogsStream, got, before+2)
		}
	})

	t.Run("a tenant cannot read the logs stream through the JetStream API", func(t *testing.T) {
		subject := v1.LogsSubject(logKey, logRun)
		for _, s := range []string{
			"$JS.API.INFO",
			"$JS.API.STREAM.INFO." + v1.LogsStream,
			"$JS.API.STREAM.MSG.GET." + v1.LogsStream,
			"$JS.API.DIRECT.GET." + v1.LogsStream,
			"$JS.API.DIRECT.GET." + v1.LogsStream + "." + subject,
			"$JS.API.CONSUMER.CREATE." + v1.LogsStream,
			"$JS.API.CONSUMER.CREATE." + v1.LogsStream + ".peek." + subject,
		} {
			if err := w.acme.nc.PublishRequest(s, w.acme.nc.NewRespInbox(), []byte(`{"last_by_subj":"`+subject+`"}`)); err != nil {
				t.Fatal(err)
			}
			w.acme.refused(t, "Publish", s)
		}
		js, err := jetstream.New(w.acme.nc)
		if err != nil {
			t.Fatal(err)
		}
		jctx, jcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer jcancel()
		if _, err := js.Stream(jctx, v1.LogsStream); err == nil {
			t.Fatalf("acme looked up %s", v1.LogsStream)
		}
		if _, err := js.OrderedConsumer(jctx, v1.LogsStream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}}); err == nil {
			t.Fatalf("acme made a consumer on %s", v1.LogsStream)
		}
	})

	t.Run("a tenant cannot write a log", func(t *testing.T) {
		before := stored()
		s := v1.LogsSubject(logKey, "forged")
		if err := w.acme.nc.Publish(s, []byte("forged line\n")); err != nil {
			t.Fatal(err)
		}
		w.acme.refused(t, "Publish", s)
		ask(t, w.acme, "acme")
		if got := stored(); got != before {
			t.Fatalf("%s holds %d lines, had %d", v1.LogsStream, got, before)
		}
	})
	return ask
}

// A setup made before the logs service existed: its BUILDQ account JWT
// lacks the export, which MissingExports reports (buildq nats-config says
// so when it adds tenants to such a setup).
func TestMissingExports(t *testing.T) {
	t.Parallel()
	s, err := NewJWTSetup([]string{"acme"})
	if err != nil {
		t.Fatal(err)
	}
	if missing, err := s.MissingExports(); err != nil || len(missing) != 0 {
		t.Fatalf("a new setup misses exports: %v %v", missing, err)
	}
	ac, err := jwt.DecodeAccountClaims(s.Buildq.JWT)
	if err != nil {
		t.Fatal(err)
	}
	var old jwt.Exports
	for _, e := range ac.Exports {
		if string(e.Subject) != v1.APILogsPrefix+".*" {
			old = append(old, e)
		}
	}
	ac.Exports = old
	if s.Buildq.JWT, err = ac.Encode(s.Operator); err != nil {
		t.Fatal(err)
	}
	missing, err := s.MissingExports()
	if err != nil || strings.Join(missing, ",") != v1.APILogsPrefix+".*" {
		t.Fatalf("missing %v %v, want %s.*", missing, err, v1.APILogsPrefix)
	}
}
