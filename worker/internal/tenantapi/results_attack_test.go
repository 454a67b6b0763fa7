package tenantapi

// Attacks of tenant "mallory" on the stored-results service
// (buildq.api.results.<tenant>), wanting acme's results or wanting to hurt
// the service. Body attacks call the service directly (a panic is then a
// test failure, not a dead test binary); subject and reply attacks go
// through Serve on an embedded server.

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// storeRaw stores data as a worker would publish a result of tenant/name
// (only a worker may publish into BUILDQ_RESULTS: internal/natsconf).
func (w *resultsWorld) storeRaw(t *testing.T, tenant, name string, data []byte) uint64 {
	t.Helper()
	ack, err := w.js.Publish(context.Background(), v1.ResultsIngestPrefix+"."+tenant+"."+name, data)
	if err != nil {
		t.Fatal(err)
	}
	return ack.Sequence
}

// storeClaiming stores, under tenant/name's subject, a result whose body
// says it is of bodyTenant/bodyName.
func (w *resultsWorld) storeClaiming(t *testing.T, tenant, name, bodyTenant, bodyName, id string) uint64 {
	t.Helper()
	r := v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: bodyTenant, Name: bodyName, Status: v1.StatusSucceeded}, time.Now())
	b, _ := json.Marshal(r)
	return w.storeRaw(t, tenant, name, b)
}

// callResults runs one results request of tenant as Serve's goroutine
// would, a panic turned into a test failure.
func (w *resultsWorld) callResults(t *testing.T, tenant string, body []byte) (rep v1.ResultsReply) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("results request %q of tenant %q panicked (in a worker: a lost request goroutine): %v", body, tenant, p)
			rep = v1.ResultsReply{Error: fmt.Sprint("panic: ", p)}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	return w.svc.results(ctx, tenant, body)
}

// storedSubjects are the stream's subjects of the results of rep (what
// they are stored as, whatever their bodies say).
func (w *resultsWorld) storedSubjects(t *testing.T, rep v1.ResultsReply) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := w.js.Stream(ctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range rep.Results {
		m, err := s.GetMsg(ctx, r.Seq)
		if err != nil {
			t.Fatalf("stored result %d: %v", r.Seq, err)
		}
		out = append(out, m.Subject)
	}
	return out
}

// attackedWorld: acme's results (some whose bodies claim mallory), and
// mallory's (one whose body claims acme).
func attackedWorld(t *testing.T) *resultsWorld {
	w := newResultsWorld(t)
	w.store(t, "acme", "web", "ACME-1")
	w.store(t, "mallory", "web", "m1")
	w.store(t, "acme", "api", "ACME-2")
	// A result stored under acme's subject whose body says mallory's:
	// it is acme's (the subject is what NATS let a worker write), and it
	// must never be served to mallory.
	w.storeClaiming(t, "acme", "web", "mallory", "web", "ACME-CLAIMS-MALLORY")
	// And one under mallory's subject whose body says acme's: mallory's
	// own (served to mallory only; acme never gets it).
	w.storeClaiming(t, "mallory", "web", "acme", "web", "m-claims-acme")
	w.store(t, "mallory", "api", "m2")
	w.store(t, "acme", "web", "ACME-3")
	return w
}

// checkMine fails when rep holds anything not stored under tenant's
// subjects.
func checkMine(t *testing.T, w *resultsWorld, tenant, asked string, rep v1.ResultsReply) {
	t.Helper()
	for i, subj := range w.storedSubjects(t, rep) {
		if !strings.HasPrefix(subj, v1.ResultsPrefix+"."+tenant+".") || strings.Count(subj, ".") != 3 {
			t.Errorf("%s's request %s got the result stored as %s: %s", tenant, asked, subj, rep.Results[i].Event)
		}
		if strings.Contains(string(rep.Results[i].Event), "ACME-") {
			t.Errorf("%s's request %s got %s", tenant, asked, rep.Results[i].Event)
		}
	}
}

// pageAll follows a request's pages as a client does (AfterSeq = Next
// while More), failing when a page does not move on.
func pageAll(t *testing.T, w *resultsWorld, tenant, body string) []v1.ResultsReply {
	t.Helper()
	var reps []v1.ResultsReply
	data := []byte(body)
	var prev uint64
	for page := 0; ; page++ {
		if page > 20 {
			t.Fatalf("%s's request %s: no end of pages", tenant, body)
		}
		rep := w.callResults(t, tenant, data)
		reps = append(reps, rep)
		if !rep.More {
			return reps
		}
		if len(rep.Results) == 0 || (page > 0 && rep.Next <= prev) {
			t.Fatalf("%s's request %s: page %d says more but does not move on: %+v", tenant, body, page, rep)
		}
		prev = rep.Next
		data, _ = json.Marshal(v1.ResultsRequest{AfterSeq: rep.Next})
	}
}

// Held: no body mallory may send — sequences negative, huge or wrapping
// (afterSeq MaxUint64: +1 is 0), times far past or future (outside
// UnixNano's range), page sizes 0, negative or huge, malformed JSON,
// fields naming acme or a wildcard — gets a result stored under another
// tenant's subject, whatever the stored body says, nor panics, nor pages
// without end.
func TestResultsAttackBodiesNeverLeaveTheSubjectsTenant(t *testing.T) {
	t.Parallel()
	w := attackedWorld(t)
	bodies := []string{
		``, `{}`, `null`, `[]`, `"acme"`, `acme`, `{`, `{"afterSeq":`, `{"afterSeq":1}{"tenant":"acme"}`,
		`{"tenant":"acme"}`, `{"Tenant":"acme","name":"web"}`, `{"name":"web","tenant":"acme","subject":"buildq.results.acme.web"}`,
		`{"name":"*"}`, `{"name":">"}`, `{"name":"web.>"}`, `{"name":"acme.web"}`, `{"name":"..acme"}`, `{"name":"web "}`,
		`{"name":"wéb"}`, `{"name":"` + strings.Repeat("a", 64) + `"}`, `{"name":"` + strings.Repeat("a", 100000) + `"}`,
		`{"name":"\u0000"}`, `{"name":"web\u0000acme"}`,
		`{"afterSeq":-1}`, `{"afterSeq":"1"}`, `{"afterSeq":1e30}`, `{"afterSeq":0.5}`,
		`{"afterSeq":18446744073709551615}`, `{"afterSeq":18446744073709551614}`, `{"afterSeq":18446744073709551616}`,
		`{"afterSeq":3,"since":"2000-01-01T00:00:00Z"}`,
		`{"since":"9999-12-31T23:59:59Z"}`, `{"since":"0001-01-01T00:00:00.000000001Z"}`, `{"since":"1600-01-01T00:00:00Z"}`,
		`{"since":"2300-01-01T00:00:00Z"}`, `{"since":"-0001-01-01T00:00:00Z"}`, `{"since":"yesterday"}`, `{"since":1}`,
		`{"max":0}`, `{"max":-1}`, `{"max":1}`, `{"max":9223372036854775807}`, `{"max":-9223372036854775808}`, `{"max":1e99}`,
		`{"max":1,"afterSeq":18446744073709551615}`,
	}
	for _, body := range bodies {
		for _, rep := range pageAll(t, w, "mallory", body) {
			checkMine(t, w, "mallory", body, rep)
		}
	}
	// The same bodies as acme: never the body that claims acme (stored as
	// mallory's).
	for _, body := range bodies {
		for _, rep := range pageAll(t, w, "acme", body) {
			for i, subj := range w.storedSubjects(t, rep) {
				if !strings.HasPrefix(subj, v1.ResultsPrefix+".acme.") {
					t.Errorf("acme's request %s got %s: %s", body, subj, rep.Results[i].Event)
				}
			}
		}
	}
	// And mallory's own results are all there (the attack list did not
	// just get errors): its three, one of which claims acme.
	if got := strings.Join(ids(t, w.callResults(t, "mallory", nil)), " "); got != "mallory/web/m1 acme/web/m-claims-acme mallory/api/m2" {
		t.Errorf("mallory's own results: %q", got)
	}
}

// Held, in depth: were the tenant given to results not a valid label
// (respond checks it; this is its second line), a wildcard or a dotted
// tenant never widens the filter to another tenant's results: every
// message read is checked to be under the tenant's own subjects.
func TestResultsAttackTenantTokenNeverWidensTheFilter(t *testing.T) {
	t.Parallel()
	w := attackedWorld(t)
	for _, tenant := range []string{"*", ">", "acme.*", "*.web", "mallory.*", "acme.web", "", "acme.>", "a*", "mall*"} {
		rep := w.callResults(t, tenant, nil)
		if len(rep.Results) > 0 {
			t.Errorf("results of tenant %q: %d results, the first stored as %v", tenant, len(rep.Results), w.storedSubjects(t, rep)[:1])
		}
	}
}

// Held: over NATS, subjects whose tenant token is not a valid tenant
// ("*", ">", upper case, unicode, 64+ characters, an underscore) are
// answered nowhere — neither on the inbox of the tenant the token
// pretends to be, nor on mallory's or acme's.
func TestResultsAttackInvalidTenantSubjectsAreNotAnswered(t *testing.T) {
	t.Parallel()
	w := newResultsWorld(t)
	w.store(t, "acme", "web", "ACME-1")
	// Everything the server carries, on a connection of its own: the
	// answers, were there any, to the ".x" inboxes.
	spy := w.srvConn(t)
	all, err := spy.SubscribeSync(">")
	if err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []string{"*", ">", "ACME", "ácme", "acme\u200b", strings.Repeat("a", 64), strings.Repeat("a", 1000), "a_b", "-acme", "acme-"} {
		for _, reply := range []string{"_INBOX_mallory.x", "_INBOX_acme.x", "_INBOX_" + tok + ".x"} {
			if err := w.nc.PublishRequest(v1.APIResultsPrefix+"."+tok, reply, []byte(`{}`)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Mallory's own, valid request: answered (and, as requests are
	// answered concurrently, a short while more for the others).
	if rep := w.ask(t, v1.APIResultsSubject("mallory"), "mallory", v1.ResultsRequest{}); rep.Error != "" || len(rep.Results) != 0 {
		t.Fatalf("mallory's own request: %+v", rep)
	}
	time.Sleep(200 * time.Millisecond)
	for {
		m, err := all.NextMsg(50 * time.Millisecond)
		if err != nil {
			break
		}
		if strings.HasPrefix(m.Subject, "_INBOX_") && strings.HasSuffix(m.Subject, ".x") {
			t.Errorf("an invalid tenant's request was answered on %s: %s", m.Subject, m.Data)
		}
	}
}

// Held: a reply subject mallory names that is not its own inbox — acme's
// inbox, the default inbox, the results stream's ingest and published
// subjects (the answer would be stored as acme's result, or delivered to
// acme's followers), the JetStream API (purge or delete the results
// stream), a bucket, the workers' internal cancel — is never written to:
// the request is dropped unanswered and counted.
func TestResultsAttackReplySubjectsWriteNothing(t *testing.T) {
	t.Parallel()
	var refused atomic.Int64
	w := newResultsWorldWith(t, func(c *Config) {
		c.ReplyRefused = func(tenant string) {
			if tenant == "mallory" {
				refused.Add(1)
			}
		}
	})
	ctx := context.Background()
	w.store(t, "acme", "web", "ACME-1")
	w.store(t, "mallory", "web", "m1")
	sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
	defer scancel()
	st, err := w.js.Stream(sctx, v1.ResultsStream)
	if err != nil {
		t.Fatal(err)
	}
	before := st.CachedInfo().State.Msgs

	replies := []string{
		"_INBOX_acme.x",
		"_INBOX.x",
		"_INBOX_mallorx.x",
		"_INBOX_mallory",
		"_INBOX_malloryy.x",
		v1.ResultsIngestPrefix + ".acme.web",
		v1.ResultsIngestPrefix + ".mallory.web",
		v1.ResultsPrefix + ".acme.web",
		v1.APIResultsSubject("acme"),
		"$JS.API.STREAM.PURGE." + v1.ResultsStream,
		"$JS.API.STREAM.DELETE." + v1.ResultsStream,
		"$JS.API.STREAM.MSG.DELETE." + v1.ResultsStream,
		"$KV." + v1.BuildsBucket + ".k",
		internalCancelSubject,
		// ($JS.ACK.… replies the server itself refuses to carry.)
	}
	// Spies on every plain reply subject (the JetStream API's and the
	// stream's are checked on the stream itself below).
	spy := w.srvConn(t)
	var spies []*nats.Subscription
	for _, r := range replies {
		sub, err := spy.SubscribeSync(r)
		if err != nil {
			t.Fatal(err)
		}
		spies = append(spies, sub)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	// A requester that is not the worker's connection, as mallory is.
	mallory := w.srvConn(t)
	for _, r := range replies {
		for _, body := range []string{`{}`, `{"afterSeq":0}`} {
			if err := mallory.PublishRequest(v1.APIResultsSubject("mallory"), r, []byte(body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := mallory.Flush(); err != nil {
		t.Fatal(err)
	}
	want := int64(2 * len(replies))
	deadline := time.Now().Add(10 * time.Second)
	for refused.Load() < want && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := refused.Load(); got != want {
		t.Errorf("%d of mallory's %d requests with a foreign reply subject refused", got, want)
	}
	// Everything the worker might have sent has arrived by now.
	if err := w.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	for i, sub := range spies {
		// Each spy sees the request itself only when it was published
		// there — never: requests go to buildq.api.results.mallory.
		if m, err := sub.NextMsg(20 * time.Millisecond); err == nil {
			t.Errorf("the worker wrote on %s: %s", replies[i], m.Data)
		}
	}
	ictx, icancel := context.WithTimeout(ctx, 10*time.Second)
	defer icancel()
	info, err := st.Info(ictx)
	if err != nil {
		t.Fatalf("the results stream after the attack: %v", err)
	}
	if info.State.Msgs != before {
		t.Errorf("the results stream holds %d messages, had %d: a reply was stored", info.State.Msgs, before)
	}
	if got := strings.Join(ids(t, w.ask(t, v1.APIResultsSubject("acme"), "acme", v1.ResultsRequest{})), " "); got != "acme/web/ACME-1" {
		t.Errorf("acme's results after the attack: %q", got)
	}
}

// srvConn is another connection to the world's server.
func (w *resultsWorld) srvConn(t *testing.T) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(w.nc.ConnectedUrl())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Held: the work of one request is bounded — whatever max mallory asks,
// a page holds at most MaxResultsPage results read with at most
// MaxResultsPage+2 JetStream API requests (the stream's info, one get per
// result, the get that finds the page full), other tenants' results in
// between costing nothing (the server filters); the next page goes on
// from Next.
func TestResultsAttackWorkPerRequestIsBounded(t *testing.T) {
	t.Parallel()
	w := newResultsWorld(t)
	const n = v1.MaxResultsPage + 30
	for i := range n {
		w.store(t, "mallory", "web", fmt.Sprint("m", i))
		if i%10 == 0 {
			w.store(t, "acme", "web", fmt.Sprint("ACME-", i))
		}
	}
	// JetStream API requests of the worker's connection, seen in order on
	// that same connection: once the answer is read, they are pending.
	api, err := w.nc.SubscribeSync("$JS.API.STREAM.>")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = api.Unsubscribe() }()
	drain := func() int {
		k := 0
		for {
			if _, err := api.NextMsg(50 * time.Millisecond); err != nil {
				return k
			}
			k++
		}
	}
	for _, max := range []int{0, -1, math.MaxInt, v1.MaxResultsPage + 1, 1 << 30} {
		drain()
		rep := w.ask(t, v1.APIResultsSubject("mallory"), "mallory", v1.ResultsRequest{Max: max})
		calls := drain()
		if len(rep.Results) != v1.MaxResultsPage || !rep.More {
			t.Errorf("max %d: %d results, more %v", max, len(rep.Results), rep.More)
		}
		if calls > v1.MaxResultsPage+2 {
			t.Errorf("max %d: %d JetStream API requests for one page", max, calls)
		}
		rest := w.ask(t, v1.APIResultsSubject("mallory"), "mallory", v1.ResultsRequest{AfterSeq: rep.Next})
		if len(rest.Results) != n-v1.MaxResultsPage || rest.More {
			t.Errorf("max %d: the next page %d results, more %v", max, len(rest.Results), rest.More)
		}
	}
	// A tenant with no results at all, among many of others': one get.
	drain()
	rep := w.ask(t, v1.APIResultsSubject("nobody"), "nobody", v1.ResultsRequest{})
	if calls := drain(); len(rep.Results) != 0 || calls > 2 {
		t.Errorf("a tenant without results: %+v after %d JetStream API requests", rep, calls)
	}
}

// Held: a page stays under NATS's max payload even when the tenant's
// results are as large as a worker makes them and full of the characters
// JSON escapes (a build log tail of '<', '>', '&' and U+2028, which a
// tenant's build prints at will): the page's byte bound counts what is
// sent. Without it, the answer would exceed the max payload and never
// arrive: the tenant's watch could never fill its gap.
func TestResultsAttackPagesOfEscapedResultsStayUnderMaxPayload(t *testing.T) {
	t.Parallel()
	w := newResultsWorld(t)
	tail := strings.Repeat("<>&\u2028", 4096/6)
	for i := range v1.MaxResultsPage {
		r := v1.NewResult("/test", v1.ResultData{RequestID: fmt.Sprint("m", i), Tenant: "mallory", Name: "web",
			Status: v1.StatusFailed, Message: tail, LogTail: tail}, time.Now())
		b, _ := json.Marshal(r)
		w.storeRaw(t, "mallory", "web", b)
	}
	got := 0
	req := v1.ResultsRequest{}
	for page := 0; ; page++ {
		if page > v1.MaxResultsPage {
			t.Fatal("no end of pages")
		}
		rep := w.ask(t, v1.APIResultsSubject("mallory"), "mallory", req)
		b, _ := json.Marshal(rep)
		if len(b) > int(w.nc.MaxPayload()) {
			t.Fatalf("a page of %d bytes: over the max payload %d", len(b), w.nc.MaxPayload())
		}
		got += len(rep.Results)
		if !rep.More {
			break
		}
		req.AfterSeq = rep.Next
	}
	if got != v1.MaxResultsPage {
		t.Errorf("%d results read, %d stored", got, v1.MaxResultsPage)
	}
}

// newResultsWorldWith is newResultsWorld with the service's Config
// changed by fn.
func newResultsWorldWith(t *testing.T, fn func(*Config)) *resultsWorld {
	t.Helper()
	_, nc, js := testnats.JetStream(t)
	ctx := context.Background()
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:             v1.ResultsStream,
		Subjects:         []string{v1.ResultsIngestPrefix + ".>"},
		SubjectTransform: &jetstream.SubjectTransformConfig{Source: v1.ResultsIngestPrefix + ".>", Destination: v1.ResultsPrefix + ".>"},
		RePublish:        &jetstream.RePublish{Source: v1.ResultsPrefix + ".>", Destination: v1.ResultsPrefix + ".>"},
	}); err != nil {
		t.Fatal(err)
	}
	cfg := Config{NC: nc, Now: time.Now}
	fn(&cfg)
	svc := New(cfg)
	stop, err := svc.Serve(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return &resultsWorld{svc: svc, nc: nc, js: js}
}

// Broke before the fix (the tenant's own results only): afterSeq
// MaxUint64 — the sequence a forged or corrupt Nats-Sequence header
// would leave a follower at — wrapped (AfterSeq+1 = 0) to "from the
// first stored": every stored result of the tenant again, reported as
// aged out. Nothing is stored after the last sequence there can be.
func TestResultsAttackLargestAfterSeqIsAfterEverything(t *testing.T) {
	t.Parallel()
	w := attackedWorld(t)
	rep := w.callResults(t, "mallory", []byte(`{"afterSeq":18446744073709551615}`))
	if rep.Error != "" || len(rep.Results) != 0 || rep.More || rep.Truncated || rep.Next != math.MaxUint64 {
		t.Errorf("after the largest sequence: %d results, next %d, more %v, truncated %v, error %q", len(rep.Results), rep.Next, rep.More, rep.Truncated, rep.Error)
	}
}

// One tenant's flood of stored-results requests takes at most
// resultsPerTenant of the service's handlers: the next is answered busy
// at once, and another tenant is served meanwhile.
func TestResultsAttackOneTenantCannotHoldTheService(t *testing.T) {
	w := attackedWorld(t)
	for range resultsPerTenant {
		if !w.svc.reading.take("mallory") {
			t.Fatal("mallory's requests refused before its limit")
		}
	}
	if rep := w.callResults(t, "mallory", []byte(`{}`)); rep.Error != ErrResultsBusy {
		t.Fatalf("mallory's request past its limit: %+v, want %q", rep, ErrResultsBusy)
	}
	if rep := w.callResults(t, "acme", []byte(`{}`)); rep.Error != "" || len(rep.Results) == 0 {
		t.Fatalf("acme's request while mallory is at its limit: %+v", rep)
	}
	w.svc.reading.give("mallory")
	if rep := w.callResults(t, "mallory", []byte(`{}`)); rep.Error != "" {
		t.Fatalf("mallory's request under its limit again: %+v", rep)
	}
	// In all, stored-results requests leave half of the handlers to
	// status and cancel.
	for i := range apiConcurrency {
		w.svc.reading.take(fmt.Sprintf("t%d", i))
	}
	if rep := w.callResults(t, "acme", []byte(`{}`)); rep.Error != ErrResultsBusy {
		t.Fatalf("acme's request with half the handlers reading: %+v", rep)
	}
}
