package natsconf

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// Who can publish into BUILDQ_RESULTS: the workers only. A result stored
// under a tenant's subject is therefore a worker's, whose subject and body
// name the same tenant (the request's subject's) — mallory cannot store a
// result under acme's subject (for acme's stored-results service or
// followers to serve), nor under its own with a body naming acme, nor
// publish on acme's result subjects: neither the stream's ingest
// (buildq.internal.results.>) nor the republished subjects
// (buildq.results.>), plain or as a JetStream publish, of any tenant.
func TestResultsAttackOnlyWorkersPublishIntoTheResultsStream(t *testing.T) {
	t.Parallel()
	wjs, acme, mallory := acctWorld(t)
	asub, err := acme.nc.SubscribeSync(v1.ResultsPrefix + ".acme.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := acme.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	before := msgs(t, wjs, v1.ResultsStream)
	forged, _ := json.Marshal(v1.NewResult("/forged", v1.ResultData{RequestID: "forged", Tenant: "acme", Name: "web", Status: v1.StatusSucceeded}, time.Now()))
	mjs, err := jetstream.New(mallory.nc)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{
		v1.ResultsIngestPrefix + ".acme.web",
		v1.ResultsIngestPrefix + ".mallory.web",
		v1.ResultsPrefix + ".acme.web",
		v1.ResultsPrefix + ".mallory.web",
	} {
		m := nats.NewMsg(s)
		m.Header.Set(v1.MsgIDHeader, "forged")
		m.Data = forged
		if err := mallory.nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
		mallory.refused(t, "Publish", s)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		if a, err := mjs.PublishMsg(ctx, m); err == nil {
			t.Errorf("mallory's JetStream publish on %s stored: %+v", s, a)
		}
		cancel()
	}
	if got := msgs(t, wjs, v1.ResultsStream); got != before {
		t.Fatalf("%s holds %d messages, had %d: mallory stored a result", v1.ResultsStream, got, before)
	}
	// A worker's result of acme's, after mallory's: acme's subscription
	// gets it, and it is the first thing it gets.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := wjs.Publish(ctx, v1.ResultsIngestPrefix+".acme.web", []byte(`{"id":"real"}`)); err != nil {
		t.Fatal(err)
	}
	m, err := asub.NextMsg(5 * time.Second)
	if err != nil || string(m.Data) != `{"id":"real"}` {
		t.Fatalf("acme's first result: %v %v", m, err)
	}
}
