package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	v1 "github.com/buildq/buildq/api/v1"
)

// requestJSON is a valid git-source build request of tenant (none: the
// field is left out), as a producer writes it.
func requestJSON(tenant, requestID string) map[string]any {
	r := map[string]any{
		"name":   "web",
		"source": map[string]any{"git": map[string]any{"url": acmeRepo, "ref": "refs/heads/main", "commit": pushedCommit}},
		"image":  "registry.example.com/acme/web",
	}
	if tenant != "" {
		r["tenant"] = tenant
	}
	if requestID != "" {
		r["requestId"] = requestID
	}
	return r
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// binaryEvent is a binary-mode CloudEvent's headers.
func binaryEvent(token, typ, source, id string) map[string]string {
	h := map[string]string{
		"Ce-Specversion": "1.0", "Ce-Type": typ, "Ce-Source": source, "Ce-Id": id,
		"Content-Type": "application/json",
	}
	if token != "" {
		h["Authorization"] = "Bearer " + token
	}
	return h
}

// structuredEvent is a structured-mode CloudEvent's body.
func structuredEvent(t *testing.T, typ, source, id string, data any) []byte {
	t.Helper()
	return mustJSON(t, map[string]any{
		"specversion": "1.0", "type": typ, "source": source, "id": id,
		"datacontenttype": "application/json", "time": "2026-01-02T03:04:05Z", "data": data,
	})
}

func bearer(token string) map[string]string {
	return map[string]string{"Content-Type": v1.CloudEventsContentType, "Authorization": "Bearer " + token}
}

// A binary-mode event sent by the CloudEvents SDK's own HTTP client is
// stored on the tenant's subject, under the id derived from its source and
// id, with a Nats-Msg-Id of the publisher SDK's form.
func TestEventBinaryModeIsStored(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})

	c, err := cloudevents.NewClientHTTP(cehttp.WithHeader("Authorization", "Bearer "+acmeToken))
	if err != nil {
		t.Fatal(err)
	}
	ev := cloudevents.NewEvent()
	ev.SetType(RequestedType)
	ev.SetSource("https://ci.acme.example/pipelines/7")
	ev.SetID("run-7-build-1")
	if err := ev.SetData(cloudevents.ApplicationJSON, requestJSON("", "")); err != nil {
		t.Fatal(err)
	}
	ctx := cloudevents.ContextWithTarget(context.Background(), w.srv.URL)
	res := c.Send(ctx, ev)
	var hr *cehttp.Result
	if !cloudevents.IsACK(res) || !cloudevents.ResultAs(res, &hr) || hr.StatusCode != http.StatusAccepted {
		t.Fatalf("send: %v", res)
	}

	want := EventRequestID("acme", ev.Source(), ev.ID())
	got := w.stored()
	if len(got) != 1 {
		t.Fatalf("%d messages stored, want 1", len(got))
	}
	checkStored(t, got[0], "acme", want)
	if g := got[0].req.Source.Git; g == nil || g.Commit != pushedCommit || got[0].req.Name != "web" {
		t.Errorf("stored request %+v", got[0].req)
	}
}

// A structured-mode event whose data names its own request id is stored
// under that id, and the answer says so.
func TestEventStructuredModeIsStored(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	body := structuredEvent(t, RequestedType, "/ci/acme", "e-1", requestJSON("acme", "acme-build-42"))
	r := w.post("/", bearer(acmeToken), body)
	if r.code != http.StatusAccepted || r.body["requestId"] != "acme-build-42" || r.body["tenant"] != "acme" {
		t.Fatalf("answer %d %s", r.code, r.raw)
	}
	got := w.stored()
	if len(got) != 1 {
		t.Fatalf("%d messages stored, want 1", len(got))
	}
	checkStored(t, got[0], "acme", "acme-build-42")
	if want := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC); !got[0].req.SubmittedAt.Equal(want) {
		t.Errorf("submittedAt %s, want the event's time %s", got[0].req.SubmittedAt, want)
	}
}

// A redelivered event (same source and id) answers the same request id and
// stores nothing new — also when another replica (a second gateway with
// the same key) takes the redelivery.
func TestEventRedeliveryStoresOnce(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	send := func() response {
		return w.post("/", binaryEvent(acmeToken, RequestedType, "/ci/acme", "same-id"), mustJSON(t, requestJSON("acme", "")))
	}
	first := send()
	if first.code != http.StatusAccepted || first.body["duplicate"] != nil {
		t.Fatalf("first delivery: %d %s", first.code, first.raw)
	}
	again := send()
	if again.code != http.StatusAccepted || again.body["requestId"] != first.body["requestId"] || again.body["duplicate"] != true {
		t.Fatalf("redelivery: %d %s, first %s", again.code, again.raw, first.raw)
	}
	// Another replica: the same configuration, its own connections.
	replica := *w
	replica.start()
	third := replica.post("/", binaryEvent(acmeToken, RequestedType, "/ci/acme", "same-id"), mustJSON(t, requestJSON("acme", "")))
	if third.code != http.StatusAccepted || third.body["requestId"] != first.body["requestId"] || third.body["duplicate"] != true {
		t.Fatalf("redelivery to another replica: %d %s", third.code, third.raw)
	}
	if got := w.stored(); len(got) != 1 {
		t.Fatalf("%d messages stored after three deliveries of one event, want 1", len(got))
	}
	if v := w.metricValue("buildq_gateway_requests_total", map[string]string{"route": routeEvents, "tenant": "acme", "outcome": outcomeDuplicate}); v != 1 {
		t.Errorf("duplicates counted %v, want 1", v)
	}
	// A new event id is a new request.
	other := w.post("/", binaryEvent(acmeToken, RequestedType, "/ci/acme", "other-id"), mustJSON(t, requestJSON("acme", "")))
	if other.code != http.StatusAccepted || other.body["requestId"] == first.body["requestId"] {
		t.Fatalf("a new event: %d %s", other.code, other.raw)
	}
	if got := w.stored(); len(got) != 2 {
		t.Fatalf("%d messages stored, want 2", len(got))
	}
}

// Every bad event gets its 4xx with a reason, and nothing is stored.
func TestEventRefusals(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	valid := mustJSON(t, requestJSON("acme", ""))
	invalid := requestJSON("acme", "")
	invalid["name"] = "Not_A_Label"
	invalid["platforms"] = []string{"plan9/mips"}
	for _, tc := range []struct {
		name    string
		headers map[string]string
		body    []byte
		code    int
		want    string // in the error
	}{
		{"no credentials", binaryEvent("", RequestedType, "/s", "1"), valid, http.StatusUnauthorized, "authentication required"},
		{"wrong token", binaryEvent("not-a-token", RequestedType, "/s", "1"), valid, http.StatusUnauthorized, "name no tenant"},
		{"another tenant's body", binaryEvent(globexToken, RequestedType, "/s", "1"), valid, http.StatusForbidden, `names tenant "acme"`},
		{"wrong type", binaryEvent(acmeToken, "com.example.other.v1", "/s", "1"), valid, http.StatusBadRequest, RequestedType},
		{"not a CloudEvent", map[string]string{"Authorization": "Bearer " + acmeToken, "Content-Type": "application/json"}, valid, http.StatusBadRequest, "not a CloudEvent"},
		{"missing id", func() map[string]string {
			h := binaryEvent(acmeToken, RequestedType, "/s", "1")
			delete(h, "Ce-Id")
			return h
		}(), valid, http.StatusBadRequest, "id"},
		{"undecodable data", binaryEvent(acmeToken, RequestedType, "/s", "1"), []byte(`{"name": "web",`), http.StatusBadRequest, "undecodable build request"},
		{"data not an object", binaryEvent(acmeToken, RequestedType, "/s", "1"), []byte(`"build please"`), http.StatusBadRequest, "not a JSON object"},
		{"unknown field", binaryEvent(acmeToken, RequestedType, "/s", "1"), []byte(`{"name":"web","imageName":"x"}`), http.StatusBadRequest, "unknown field"},
		{"no data", binaryEvent(acmeToken, RequestedType, "/s", "1"), nil, http.StatusBadRequest, "no data"},
		{"data not JSON", func() map[string]string {
			h := binaryEvent(acmeToken, RequestedType, "/s", "1")
			h["Content-Type"] = "text/plain"
			return h
		}(), valid, http.StatusUnsupportedMediaType, "must be JSON"},
		{"invalid request", binaryEvent(acmeToken, RequestedType, "/s", "1"), mustJSON(t, invalid), http.StatusUnprocessableEntity, "invalid build request"},
		{"oversize", binaryEvent(acmeToken, RequestedType, "/s", "1"), []byte(`{"name":"` + strings.Repeat("a", DefaultMaxEventBytes) + `"}`), http.StatusRequestEntityTooLarge, "larger than"},
		{"oversize structured", bearer(acmeToken), structuredEvent(t, RequestedType, "/s", "1", map[string]string{"name": strings.Repeat("a", DefaultMaxEventBytes)}), http.StatusRequestEntityTooLarge, "larger than"},
		{"batch", map[string]string{"Authorization": "Bearer " + acmeToken, "Content-Type": "application/cloudevents-batch+json"}, []byte("[]"), http.StatusBadRequest, "batched"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := w.post("/", tc.headers, tc.body)
			errText, _ := r.body["error"].(string)
			if r.code != tc.code || !strings.Contains(errText, tc.want) {
				t.Fatalf("answer %d %s, want %d with %q", r.code, r.raw, tc.code, tc.want)
			}
			if tc.code == http.StatusUnauthorized && r.code == http.StatusUnauthorized {
				// The WWW-Authenticate challenge is set; the body names no secret.
				if strings.Contains(r.raw, "not-a-token") {
					t.Errorf("the answer repeats the token: %s", r.raw)
				}
			}
		})
	}
	// The field errors of an invalid request are listed.
	r := w.post("/", binaryEvent(acmeToken, RequestedType, "/s", "1"), mustJSON(t, invalid))
	fields, _ := r.body["fields"].([]any)
	var names []string
	for _, f := range fields {
		if m, ok := f.(map[string]any); ok {
			names = append(names, m["field"].(string))
		}
	}
	if strings.Join(names, ",") != "name,platforms" {
		t.Errorf("field errors %v, want name and platforms: %s", names, r.raw)
	}
	if r := w.post("/", binaryEvent(acmeToken, "x.y", "/s", "1"), valid); r.body["acceptedType"] != RequestedType {
		t.Errorf("a wrong type's answer does not name the accepted type: %s", r.raw)
	}
	if got := w.stored(); len(got) != 0 {
		t.Fatalf("refused events stored %d messages", len(got))
	}
	for _, outcome := range []string{outcomeUnauthorized, outcomeForbidden, outcomeInvalid, outcomeTooLarge} {
		if v := w.metricValue("buildq_gateway_requests_total", map[string]string{"route": routeEvents, "outcome": outcome}); v < 1 {
			t.Errorf("outcome %s not counted", outcome)
		}
	}
	// No label value comes from an unauthenticated client.
	if v := w.metricValue("buildq_gateway_requests_total", map[string]string{"outcome": outcomeUnauthorized, "tenant": unknownTenant}); v != 2 {
		t.Errorf("unauthorized requests under tenant %q: %v, want 2", unknownTenant, v)
	}
}

// Only POST takes events; GET / is refused.
func TestEventRouteMethods(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	if code, _ := w.get("/"); code != http.StatusMethodNotAllowed {
		t.Errorf("GET / answered %d", code)
	}
	if code, body := w.get("/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Errorf("/healthz %d %q", code, body)
	}
}
