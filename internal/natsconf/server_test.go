package natsconf

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker"
)

// startServer runs nats-server in-process on the configuration conf, on a
// free loopback port, with JetStream in a temporary directory (as
// `nats-server -c FILE -sd DIR` would).
func startServer(t *testing.T, conf []byte) *server.Server {
	t.Helper()
	s, _ := startServerFile(t, conf)
	return s
}

// startServerFile is startServer that also returns the configuration
// file's path.
func startServerFile(t *testing.T, conf []byte) (*server.Server, string) {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, "nats-server.conf")
	if err := os.WriteFile(file, conf, 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(file)
	if err != nil {
		t.Fatalf("the server refuses the configuration: %v", err)
	}
	s, err := server.NewServer(overrides(opts, server.RANDOM_PORT, filepath.Join(dir, "js")))
	if err != nil {
		t.Fatal(err)
	}
	if testing.Verbose() && os.Getenv("NATSCONF_SERVER_LOG") != "" {
		s.ConfigureLogger()
	}
	s.Start()
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	if !s.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	return s, file
}

// overrides sets what the command line would (-a, -p, -sd) and what a
// test needs.
func overrides(opts *server.Options, port int, storeDir string) *server.Options {
	opts.Host, opts.Port = "127.0.0.1", port
	opts.StoreDir = storeDir
	opts.NoSigs, opts.NoLog = true, true
	return opts
}

// reload has the server read its configuration file again, as on SIGHUP
// (the command line's options stay).
func reload(t *testing.T, s *server.Server, file string) {
	t.Helper()
	opts, err := server.ProcessConfigFile(file)
	if err != nil {
		t.Fatalf("the server refuses the configuration: %v", err)
	}
	js := s.JetStreamConfig()
	if js == nil {
		t.Fatal("no JetStream")
	}
	if err := s.ReloadOptions(overrides(opts, s.Addr().(*net.TCPAddr).Port, filepath.Dir(js.StoreDir))); err != nil {
		t.Fatalf("reload: %v", err)
	}
}

// user is a connection with the asynchronous errors (permission
// violations) the server sent it.
type user struct {
	name string
	nc   *nats.Conn
	errs chan error
}

func connect(t *testing.T, url, name string, opts ...nats.Option) *user {
	t.Helper()
	u, err := tryConnect(url, name, opts...)
	if err != nil {
		t.Fatalf("connect as %s: %v", name, err)
	}
	t.Cleanup(u.nc.Close)
	return u
}

func tryConnect(url, name string, opts ...nats.Option) (*user, error) {
	u := &user{name: name, errs: make(chan error, 64)}
	opts = append(opts, nats.Name(name), nats.MaxReconnects(0),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			select {
			case u.errs <- err:
			default:
			}
		}))
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, err
	}
	u.nc = nc
	return u, nil
}

// refused waits for the server's permissions violation for op ("Publish",
// "Subscription") on subject.
func (u *user) refused(t *testing.T, op, subject string) {
	t.Helper()
	_ = u.nc.Flush()
	want := "Permissions Violation for " + op + " to \"" + subject + "\""
	timeout := time.After(5 * time.Second)
	for {
		select {
		case err := <-u.errs:
			if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), want) {
				return
			}
		case <-timeout:
			t.Fatalf("%s: no %s", u.name, want)
		}
	}
}

// world is a running server and the users the checks need.
type world struct {
	worker, acme, globex *user
	// accounts are the names the server gives the tenants' accounts
	// (a name in config-file mode, a public key in JWT mode).
	accounts map[string]string
}

// msgs is the number of messages in stream name, as the worker sees it.
func msgs(t *testing.T, js jetstream.JetStream, name string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	return info.State.Msgs
}

func ack(t *testing.T, u *user, subject string) *jetstream.PubAck {
	t.Helper()
	js, err := jetstream.New(u.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	a, err := js.Publish(ctx, subject, []byte(`{"apiVersion":"buildq.dev/v1"}`))
	if err != nil {
		t.Fatalf("%s's JetStream publish on %s: %v", u.name, subject, err)
	}
	if a.Stream != v1.RequestsStream {
		t.Fatalf("%s's PubAck from stream %q", u.name, a.Stream)
	}
	return a
}

// checkTenantsApart runs what both modes must do: tenants get their
// PubAcks, services, results and events through their imports, and
// nothing else.
func checkTenantsApart(t *testing.T, w world) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	wjs, err := jetstream.New(w.worker.nc)
	if err != nil {
		t.Fatal(err)
	}
	// The worker, as its user, sets up its streams and buckets.
	kv, _, err := worker.EnsureStreams(ctx, wjs, worker.Config{Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatalf("the worker sets up its streams and buckets: %v", err)
	}
	if _, err := kv.Put(ctx, "worker-key", []byte("x")); err != nil {
		t.Fatalf("the worker writes its bucket: %v", err)
	}
	bucketStream := "KV_" + v1.BuildsBucket
	bucketMsgs := msgs(t, wjs, bucketStream)
	requests := func() uint64 { return msgs(t, wjs, v1.RequestsStream) }

	// The tenant API, answered as the worker does (queue group, one reply).
	type asked struct{ subject, reply, info string }
	seen := make(chan asked, 16)
	for _, s := range []string{v1.APIStatusPrefix + ".*", v1.APICancelPrefix + ".*", v1.CancelPrefix + ".*.*"} {
		if _, err := w.worker.nc.QueueSubscribe(s, "buildq-api", func(m *nats.Msg) {
			seen <- asked{m.Subject, m.Reply, m.Header.Get("Nats-Request-Info")}
			_ = m.Respond([]byte("answer for " + m.Subject))
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.worker.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	service := func(t *testing.T, u *user, tenant, subject string) {
		t.Helper()
		r, err := u.nc.Request(subject, []byte("some-id"), 5*time.Second)
		if err != nil {
			t.Fatalf("%s's request on %s: %v", u.name, subject, err)
		}
		if want := "answer for " + subject; string(r.Data) != want {
			t.Fatalf("%s's answer %q, want %q", u.name, r.Data, want)
		}
		a := <-seen
		if a.subject != subject || !strings.HasPrefix(a.reply, "_R_.") {
			t.Fatalf("the worker got %+v: want %s and a reply subject _R_.… of the server's", a, subject)
		}
		if acc, ok := w.accounts[tenant]; ok && !strings.Contains(a.info, `"acc":"`+acc+`"`) {
			t.Fatalf("Nats-Request-Info %s does not name %s's account %s", a.info, tenant, acc)
		}
	}
	status := func(t *testing.T, u *user, tenant string) {
		t.Helper()
		service(t, u, tenant, v1.APIStatusSubject(tenant))
	}

	t.Run("a tenant's JetStream publish gets its PubAck", func(t *testing.T) {
		before := requests()
		ack(t, w.acme, v1.RequestSubject("acme"))
		ack(t, w.globex, v1.RequestSubject("globex"))
		if got := requests(); got != before+2 {
			t.Fatalf("%s holds %d messages, want %d", v1.RequestsStream, got, before+2)
		}
	})

	t.Run("a tenant's status and cancel requests reach the worker and are answered", func(t *testing.T) {
		for _, c := range []struct {
			u      *user
			tenant string
		}{{w.acme, "acme"}, {w.globex, "globex"}} {
			for _, s := range []string{v1.APIStatusSubject(c.tenant), v1.APICancelSubject(c.tenant), v1.CancelSubject(c.tenant, "web")} {
				service(t, c.u, c.tenant, s)
			}
		}
	})

	t.Run("a tenant gets its own results and events and nothing of another's", func(t *testing.T) {
		var subs []*nats.Subscription
		for _, s := range []string{"buildq.results.acme.>", "buildq.events.acme.>"} {
			sub, err := w.acme.nc.SubscribeSync(s)
			if err != nil {
				t.Fatal(err)
			}
			subs = append(subs, sub)
		}
		gsub, err := w.globex.nc.SubscribeSync("buildq.results.globex.>")
		if err != nil {
			t.Fatal(err)
		}
		if err := w.acme.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := w.globex.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		// Results as a worker publishes them: into BUILDQ_RESULTS, which
		// publishes each once stored; events directly.
		for _, s := range []string{"buildq.results.globex.x", "buildq.events.globex.x", "buildq.results.acme.x", "buildq.events.acme.x"} {
			if strings.HasPrefix(s, v1.ResultsPrefix+".") {
				m := nats.NewMsg(v1.ResultsIngestPrefix + strings.TrimPrefix(s, v1.ResultsPrefix))
				m.Header.Set(v1.MsgIDHeader, s)
				m.Data = []byte(s)
				if _, err := wjs.PublishMsg(ctx, m); err != nil {
					t.Fatalf("the worker's result %s: %v", s, err)
				}
				continue
			}
			if err := w.worker.nc.Publish(s, []byte(s)); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.worker.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		for i, want := range []string{"buildq.results.acme.x", "buildq.events.acme.x"} {
			m, err := subs[i].NextMsg(5 * time.Second)
			if err != nil || m.Subject != want {
				t.Fatalf("acme's subscription: %v %v, want %s", m, err, want)
			}
		}
		if m, err := gsub.NextMsg(5 * time.Second); err != nil || m.Subject != "buildq.results.globex.x" {
			t.Fatalf("globex's subscription: %v %v", m, err)
		}
		// globex's messages were published before acme's on one
		// connection: had acme been delivered one, it would be here now.
		for _, sub := range subs {
			if n, _, _ := sub.Pending(); n != 0 {
				m, _ := sub.NextMsg(0)
				t.Fatalf("acme received %s", m.Subject)
			}
		}
		if n, _, _ := gsub.Pending(); n != 0 {
			t.Fatal("globex received more than its result")
		}
		// And acme may not widen its subscriptions to another's.
		for _, s := range []string{"buildq.results.globex.>", "buildq.results.>", ">"} {
			if _, err := w.acme.nc.SubscribeSync(s); err != nil {
				t.Fatal(err)
			}
			w.acme.refused(t, "Subscription", s)
		}
	})

	t.Run("reply subjects naming a bucket write nothing", func(t *testing.T) {
		before := requests()
		// A JetStream publish on its own subject with the bucket as the
		// reply: stored (its own subject), the PubAck lands nowhere.
		if err := w.acme.nc.PublishMsg(&nats.Msg{Subject: v1.RequestSubject("acme"), Reply: "$KV." + v1.BuildsBucket + ".k", Data: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
		// A status request with the bucket as the reply: the worker
		// answers, the answer lands nowhere.
		if err := w.acme.nc.PublishRequest(v1.APIStatusSubject("acme"), "$KV."+v1.BuildsBucket+".k", []byte("id")); err != nil {
			t.Fatal(err)
		}
		// Replies naming another tenant's results or requests reach
		// nothing of globex's either.
		gsub, err := w.globex.nc.SubscribeSync("buildq.results.globex.>")
		if err != nil {
			t.Fatal(err)
		}
		if err := w.globex.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := w.acme.nc.PublishRequest(v1.APIStatusSubject("acme"), "buildq.results.globex.x", []byte("id")); err != nil {
			t.Fatal(err)
		}
		if err := w.acme.nc.PublishMsg(&nats.Msg{Subject: v1.RequestSubject("acme"), Reply: v1.RequestSubject("globex"), Data: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if a := <-seen; !strings.HasPrefix(a.reply, "_R_.") {
				t.Fatalf("the worker was asked to answer on %q", a.reply)
			}
		}
		if err := w.worker.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		// The stream handles its subject's messages in order, and the
		// worker's connection its answers: once these round trips are
		// done, the earlier PubAcks and answers have been routed.
		ack(t, w.acme, v1.RequestSubject("acme"))
		status(t, w.acme, "acme")
		if got := msgs(t, wjs, bucketStream); got != bucketMsgs {
			t.Fatalf("%s holds %d messages, had %d: a reply landed in the bucket", bucketStream, got, bucketMsgs)
		}
		if _, err := kv.Get(ctx, "k"); !errors.Is(err, jetstream.ErrKeyNotFound) {
			t.Fatalf("key k of the bucket: %v", err)
		}
		// acme's three requests, and nothing else (no PubAck stored as a
		// request of globex's).
		if got := requests(); got != before+3 {
			t.Fatalf("%s holds %d messages, want %d", v1.RequestsStream, got, before+3)
		}
		if m, err := gsub.NextMsg(100 * time.Millisecond); err == nil {
			t.Fatalf("globex received %s: %s", m.Subject, m.Data)
		}
		// Nor can acme publish into the bucket itself.
		if err := w.acme.nc.Publish("$KV."+v1.BuildsBucket+".k", []byte("x")); err != nil {
			t.Fatal(err)
		}
		w.acme.refused(t, "Publish", "$KV."+v1.BuildsBucket+".k")
		if got := msgs(t, wjs, bucketStream); got != bucketMsgs {
			t.Fatalf("%s holds %d messages, had %d", bucketStream, got, bucketMsgs)
		}
	})

	t.Run("a tenant's publish on another's request subject reaches no stream", func(t *testing.T) {
		before := requests()
		if err := w.acme.nc.Publish(v1.RequestSubject("globex"), []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
		w.acme.refused(t, "Publish", v1.RequestSubject("globex"))
		js, _ := jetstream.New(w.acme.nc)
		pctx, pcancel := context.WithTimeout(ctx, 250*time.Millisecond)
		defer pcancel()
		if _, err := js.Publish(pctx, v1.RequestSubject("globex"), []byte(`{}`)); err == nil {
			t.Fatal("acme's publish on globex's request subject got a PubAck")
		}
		ack(t, w.acme, v1.RequestSubject("acme"))
		if got := requests(); got != before+1 {
			t.Fatalf("%s holds %d messages, want %d (acme's own one)", v1.RequestsStream, got, before+1)
		}
	})

	t.Run("a tenant's requests to another's services reach no worker", func(t *testing.T) {
		for _, s := range []string{v1.APIStatusSubject("globex"), v1.APICancelSubject("globex"), v1.CancelSubject("globex", "web")} {
			if err := w.acme.nc.PublishRequest(s, w.acme.nc.NewRespInbox(), []byte("id")); err != nil {
				t.Fatal(err)
			}
			w.acme.refused(t, "Publish", s)
		}
		// The worker's connection gets a tenant's requests in order: had
		// one of those reached it, it would come before this one.
		status(t, w.acme, "acme")
		select {
		case a := <-seen:
			t.Fatalf("the worker was asked %+v", a)
		default:
		}
	})
}
