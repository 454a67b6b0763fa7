package tenantapi

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// resultsWorld is the stored-results service over a fresh server whose
// BUILDQ_RESULTS is configured as the worker configures it (ingest on
// buildq.internal.results.>, stored and republished as buildq.results.>).
type resultsWorld struct {
	svc *Service
	nc  *nats.Conn
	js  jetstream.JetStream
}

func newResultsWorld(t *testing.T) *resultsWorld {
	t.Helper()
	return newResultsWorldWith(t, func(*Config) {})
}

// store publishes a result of tenant/name for the request id given and
// returns its stream sequence.
func (w *resultsWorld) store(t *testing.T, tenant, name, id string) uint64 {
	t.Helper()
	r := v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: tenant, Name: name, Status: v1.StatusSucceeded}, time.Now())
	b, _ := json.Marshal(r)
	ack, err := w.js.Publish(context.Background(), v1.ResultsIngestPrefix+"."+tenant+"."+name, b)
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

// ask sends body to tenant's service, as that tenant would (a reply under
// its own inbox prefix), and decodes the answer.
func (w *resultsWorld) ask(t *testing.T, subject, tenant string, body any) v1.ResultsReply {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case string:
		b = []byte(v)
	default:
		b, _ = json.Marshal(v)
	}
	inbox := v1.InboxPrefix(tenant) + "." + nats.NewInbox()[len("_INBOX."):]
	sub, err := w.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := w.nc.PublishRequest(subject, inbox, b); err != nil {
		t.Fatal(err)
	}
	m, err := sub.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("no answer on %s: %v", subject, err)
	}
	var rep v1.ResultsReply
	if err := json.Unmarshal(m.Data, &rep); err != nil {
		t.Fatalf("answer %s: %v", m.Data, err)
	}
	return rep
}

func ids(t *testing.T, rep v1.ResultsReply) []string {
	t.Helper()
	var out []string
	for _, s := range rep.Results {
		var r v1.Result
		if err := json.Unmarshal(s.Event, &r); err != nil {
			t.Fatalf("stored event %s: %v", s.Event, err)
		}
		out = append(out, r.Data.Tenant+"/"+r.Data.Name+"/"+r.ID)
	}
	return out
}

func TestStoredResultsServesTheSubjectsTenantOnly(t *testing.T) {
	t.Parallel()
	w := newResultsWorld(t)
	a1 := w.store(t, "acme", "web", "a1")
	w.store(t, "globex", "web", "g1")
	w.store(t, "acme", "api", "a2")
	mid := time.Now()
	time.Sleep(5 * time.Millisecond) // stored times are the server's; apart from mid
	w.store(t, "globex", "api", "g2")
	a3 := w.store(t, "acme", "web", "a3")

	t.Run("everything of the tenant, in stream order", func(t *testing.T) {
		rep := w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{})
		if got := strings.Join(ids(t, rep), " "); got != "acme/web/a1 acme/api/a2 acme/web/a3" || rep.Error != "" || rep.More {
			t.Fatalf("acme's results: %q %+v", got, rep)
		}
		if rep.Next != a3 || rep.Results[0].Seq != a1 {
			t.Fatalf("next %d (want %d), first seq %d (want %d)", rep.Next, a3, rep.Results[0].Seq, a1)
		}
	})
	t.Run("after a sequence", func(t *testing.T) {
		rep := w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{AfterSeq: a1})
		if got := strings.Join(ids(t, rep), " "); got != "acme/api/a2 acme/web/a3" {
			t.Fatalf("after %d: %q", a1, got)
		}
		rep = w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{AfterSeq: a3})
		if len(rep.Results) != 0 || rep.Next != a3 || rep.Error != "" {
			t.Fatalf("after the last: %+v", rep)
		}
	})
	t.Run("since a time", func(t *testing.T) {
		rep := w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{Since: mid})
		if got := strings.Join(ids(t, rep), " "); got != "acme/web/a3" {
			t.Fatalf("since mid: %q", got)
		}
	})
	t.Run("one name", func(t *testing.T) {
		rep := w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{Name: "web"})
		if got := strings.Join(ids(t, rep), " "); got != "acme/web/a1 acme/web/a3" {
			t.Fatalf("acme/web: %q", got)
		}
	})
	t.Run("pages", func(t *testing.T) {
		var got []string
		req := v1.ResultsRequest{Max: 1}
		for i := 0; ; i++ {
			if i > 5 {
				t.Fatal("no end of pages")
			}
			rep := w.ask(t, v1.APIResultsSubject("acme"), "acme", req)
			got = append(got, ids(t, rep)...)
			if !rep.More {
				break
			}
			req.AfterSeq = rep.Next
		}
		if strings.Join(got, " ") != "acme/web/a1 acme/api/a2 acme/web/a3" {
			t.Fatalf("paged: %q", got)
		}
	})
	// Invariant 8: nothing in the body reaches another tenant's results.
	t.Run("globex's service never answers with acme's results", func(t *testing.T) {
		for _, body := range []any{
			v1.ResultsRequest{},
			v1.ResultsRequest{Name: "*"},
			v1.ResultsRequest{Name: ">"},
			v1.ResultsRequest{Name: "web.>"},
			v1.ResultsRequest{Name: "web acme"},
			`{"name":"web","tenant":"acme"}`,
			`{"afterSeq":1,"since":"2000-01-01T00:00:00Z"}`,
			`{"name":"../acme"}`,
			"acme",
			`{"max":-1}`,
		} {
			rep := w.ask(t, v1.APIResultsSubject("globex"), "globex", body)
			for _, id := range ids(t, rep) {
				if !strings.HasPrefix(id, "globex/") {
					t.Fatalf("globex asked %v and got %s", body, id)
				}
			}
		}
	})
	t.Run("a subject without a valid tenant is not answered", func(t *testing.T) {
		for _, tenant := range []string{"ACME", "a_b"} {
			sub, err := w.nc.SubscribeSync(v1.InboxPrefix(tenant) + ".x")
			if err != nil {
				t.Fatal(err)
			}
			if err := w.nc.PublishRequest(v1.APIResultsPrefix+"."+tenant, sub.Subject, nil); err != nil {
				t.Fatal(err)
			}
			if m, err := sub.NextMsg(time.Second); err == nil {
				t.Fatalf("tenant %q answered: %s", tenant, m.Data)
			}
			_ = sub.Unsubscribe()
		}
	})
}

func TestStoredResultsSaysWhenResultsAgedOut(t *testing.T) {
	t.Parallel()
	w := newResultsWorld(t)
	ctx := context.Background()
	first := w.store(t, "acme", "web", "old")
	w.store(t, "acme", "web", "old2")
	before := time.Now().Add(-time.Hour)
	last := w.store(t, "acme", "web", "new")
	s, err := w.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	// What MaxAge does to old results.
	if err := s.Purge(ctx, jetstream.WithPurgeSequence(last)); err != nil {
		t.Fatal(err)
	}
	rep := w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{AfterSeq: first})
	if !rep.Truncated || rep.FirstSeq != last || strings.Join(ids(t, rep), " ") != "acme/web/new" {
		t.Fatalf("after a purged sequence: %+v", rep)
	}
	rep = w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{Since: before})
	if !rep.Truncated {
		t.Fatalf("since before the purge: %+v", rep)
	}
	rep = w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{AfterSeq: last - 1})
	if rep.Truncated {
		t.Fatalf("after a sequence still stored: %+v", rep)
	}
}

func TestParseResultsRequest(t *testing.T) {
	t.Parallel()
	r, err := parseResultsRequest(nil)
	if err != nil || r.Max != v1.MaxResultsPage || r.AfterSeq != 0 {
		t.Fatalf("empty: %+v %v", r, err)
	}
	if r, err = parseResultsRequest([]byte(`{"max":100000,"afterSeq":7}`)); err != nil || r.Max != v1.MaxResultsPage || r.AfterSeq != 7 {
		t.Fatalf("limits: %+v %v", r, err)
	}
	for _, bad := range []string{`{"name":"*"}`, `{"name":"a.b"}`, `{"name":">"}`, `{`, `acme`} {
		if _, err := parseResultsRequest([]byte(bad)); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
