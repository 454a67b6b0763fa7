package natsconf

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker"
)

// Attacks of tenant "mallory" on tenant "acme" through the account per
// tenant (the generator's file mode, streams as a worker makes them).

// acctWorld starts a server on the generated configuration for acme and
// mallory, makes the worker's streams and buckets as its user, and
// returns the worker's JetStream and the two tenants.
func acctWorld(t *testing.T) (jetstream.JetStream, *user, *user) {
	t.Helper()
	tenants := []string{"acme", "mallory"}
	keys, err := NewUserKeys(Users(tenants))
	if err != nil {
		t.Fatal(err)
	}
	conf, err := ServerConfig(ConfigOptions{Tenants: tenants, NKeys: PublicKeys(keys)})
	if err != nil {
		t.Fatal(err)
	}
	s := startServer(t, conf)
	opts := seedFiles(t, keys)
	url := s.ClientURL()
	w := connect(t, url, "buildq-worker", opts["worker"])
	wjs, err := jetstream.New(w.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, _, err := worker.EnsureStreams(ctx, wjs, worker.Config{}); err != nil {
		t.Fatalf("the worker's streams: %v", err)
	}
	return wjs, connect(t, url, "acme", opts["acme"]), connect(t, url, "mallory", opts["mallory"])
}

// Message tracing cannot make the server write outside mallory's own
// subjects: a trace destination must be a subject her user may publish
// (the bucket's is refused), and one she may publish only reaches her own
// services.
func TestAccountsTraceDestinationStaysInTheTenantsSubjects(t *testing.T) {
	t.Parallel()
	wjs, _, mallory := acctWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	kv, err := wjs.KeyValue(ctx, v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	st, err := wjs.Stream(ctx, "KV_"+v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := info.State.Msgs
	for _, dest := range []string{"$KV." + v1.BuildsBucket + ".k", v1.RequestSubject("acme"), "buildq.results.acme.web"} {
		m := nats.NewMsg(v1.RequestSubject("mallory"))
		m.Header.Set("Nats-Trace-Dest", dest)
		m.Data = []byte(`{}`)
		if err := mallory.nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
		mallory.refused(t, "Publish", dest)
	}
	if _, err := kv.Get(ctx, "k"); err == nil {
		t.Fatal("a trace event landed in the bucket")
	}
	info, err = st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != before {
		t.Fatalf("the bucket holds %d messages, had %d", info.State.Msgs, before)
	}
	rs, err := wjs.Stream(ctx, v1.RequestsStream)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rs.GetLastMsgForSubject(ctx, v1.RequestSubject("acme")); err == nil {
		t.Fatal("a trace event was stored as a request of acme's")
	}
}
