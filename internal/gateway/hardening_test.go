package gateway

// The gateway's answers to replays, unauthenticated or oversized bodies,
// saturation and reserved request ids (see attack_test.go for the attacks
// themselves).

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
)

// A GitLab push replayed with a fresh Idempotency-Key and event UUID (the
// token authenticates the sender, not the body) is the same request:
// nothing new is stored. Another push of the same repository is new.
func TestGitLabReplayWithNewDeliveryHeadersIsNoNewRequest(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	hdr := func(key, uuid string) map[string]string {
		return map[string]string{"Content-Type": "application/json", "X-Gitlab-Event": "Push Hook", "X-Gitlab-Token": acmeGitLab,
			"Idempotency-Key": key, "X-Gitlab-Event-UUID": uuid}
	}
	push := gitlabPushPayload("acme/api", "refs/heads/main", beforeCommit, pushedCommit, pushedCommit)
	first := w.post("/hooks/gitlab/acme", hdr("908a6d9e-45fd-46c8-97e6-c4f350f219dd", "u-1"), push)
	if first.code != http.StatusAccepted || len(requestIDs(t, first)) != 1 {
		t.Fatalf("the genuine delivery: %d %s", first.code, first.raw)
	}
	for i, h := range []map[string]string{hdr("replayed-1", "replayed-1"), hdr("", ""), hdr(strings.Repeat("k", 500), "")} {
		r := w.post("/hooks/gitlab/acme", h, push)
		if r.code != http.StatusAccepted || !slices.Equal(requestIDs(t, r), requestIDs(t, first)) {
			t.Fatalf("replay %d: %d %s, want the ids %v", i, r.code, r.raw, requestIDs(t, first))
		}
	}
	if n := len(w.stored()); n != 1 {
		t.Fatalf("%d messages stored, want 1: one push is one build", n)
	}
	next := gitlabPushPayload("acme/api", "refs/heads/main", pushedCommit, beforeCommit, beforeCommit)
	r := w.post("/hooks/gitlab/acme", hdr("908a6d9e-45fd-46c8-97e6-c4f350f219dd", "u-1"), next)
	if r.code != http.StatusAccepted || len(requestIDs(t, r)) != 1 || requestIDs(t, r)[0] == requestIDs(t, first)[0] {
		t.Fatalf("another push (with the first one's headers): %d %s", r.code, r.raw)
	}
	if n := len(w.stored()); n != 2 {
		t.Fatalf("%d messages stored, want 2", n)
	}
}

// What is refused or ignored without the body is answered without
// reading it: a malformed signature, an event that builds nothing, a
// webhook of a tenant that has none, a body announced larger than the cap.
func TestWebhookBodiesUnreadWhenNotNeeded(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	for _, tc := range []struct {
		name, path string
		headers    map[string]string
		length     int64 // Content-Length; 0: unknown
		code       int
	}{
		{"github, malformed signature", "/hooks/github/acme", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha256=abcd"}, 0, http.StatusUnauthorized},
		{"github, sha1 prefix", "/hooks/github/acme", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha1=" + strings.Repeat("a", 64)}, 0, http.StatusUnauthorized},
		{"github, ignored event", "/hooks/github/acme", map[string]string{"X-GitHub-Event": "issues", "X-Hub-Signature-256": "sha256=" + strings.Repeat("a", 64)}, 0, http.StatusAccepted},
		{"github, announced too large", "/hooks/github/acme", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha256=" + strings.Repeat("a", 64)}, DefaultMaxWebhookBytes + 1, http.StatusRequestEntityTooLarge},
		{"github, tenant without the webhook", "/hooks/github/globex", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha256=" + strings.Repeat("a", 64)}, 0, http.StatusNotFound},
		{"github, unknown tenant", "/hooks/github/initech", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha256=" + strings.Repeat("a", 64)}, 0, http.StatusNotFound},
		{"gitlab, ignored event", "/hooks/gitlab/acme", map[string]string{"X-Gitlab-Event": "Merge Request Hook", "X-Gitlab-Token": acmeGitLab}, 0, http.StatusAccepted},
		{"gitlab, announced too large", "/hooks/gitlab/acme", map[string]string{"X-Gitlab-Event": "Push Hook", "X-Gitlab-Token": acmeGitLab}, DefaultMaxWebhookBytes + 1, http.StatusRequestEntityTooLarge},
		{"gitlab, unknown tenant", "/hooks/gitlab/initech", map[string]string{"X-Gitlab-Event": "Push Hook", "X-Gitlab-Token": acmeGitLab}, 0, http.StatusNotFound},
		{"cloudevent, announced too large", "/", binaryEvent(acmeToken, RequestedType, "/s", "1"), DefaultMaxEventBytes + 1, http.StatusRequestEntityTooLarge},
		{"cloudevent, no credentials", "/", binaryEvent("", RequestedType, "/s", "1"), 0, http.StatusUnauthorized},
		{"no such route", "/hooks/bitbucket/acme", nil, 0, http.StatusNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := &countingBody{r: bytes.NewReader(make([]byte, DefaultMaxWebhookBytes))}
			req := httptest.NewRequest(http.MethodPost, tc.path, body)
			req.ContentLength = tc.length
			for k, v := range tc.headers {
				req.Header.Set(k, v)
			}
			rec := httptest.NewRecorder()
			w.gw.ServeHTTP(rec, req)
			if rec.Code != tc.code {
				t.Fatalf("answer %d %s, want %d", rec.Code, rec.Body, tc.code)
			}
			if n := body.read.Load(); n > 0 {
				t.Fatalf("%d bytes of the body were read", n)
			}
		})
	}
	if n := len(w.stored()); n != 0 {
		t.Fatalf("%d messages stored", n)
	}
}

// Beyond MaxInFlight requests in flight, a request is answered 503 with
// Retry-After at once, its body unread; probes and metrics still answer.
func TestMaxInFlight(t *testing.T) {
	t.Parallel()
	s, err := New(Options{MsgIDKey: bytes.Repeat([]byte("k"), MinMsgIDKeyBytes), MaxInFlight: 2})
	if err != nil {
		t.Fatal(err)
	}
	s.inFlight <- struct{}{} // two requests in flight
	s.inFlight <- struct{}{}
	for _, path := range []string{"/", "/hooks/github/acme", "/hooks/gitlab/acme"} {
		body := &countingBody{r: strings.NewReader("{}")}
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, body))
		if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") == "" || !strings.Contains(rec.Body.String(), "retry") {
			t.Fatalf("POST %s while saturated: %d %v %s, want 503 with Retry-After", path, rec.Code, rec.Header(), rec.Body)
		}
		if body.read.Load() > 0 {
			t.Fatalf("POST %s while saturated: its body was read", path)
		}
	}
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		if rec.Code != http.StatusOK {
			t.Fatalf("GET %s while saturated: %d", path, rec.Code)
		}
	}
	<-s.inFlight // one finishes: the next is served (401: no credentials)
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", strings.NewReader("{}")))
	if rec.Code != http.StatusUnauthorized {
		t.Fatalf("POST / with a slot free: %d %s", rec.Code, rec.Body)
	}
	if len(s.inFlight) != 1 {
		t.Fatalf("%d slots held after the request, want the 1 the test holds", len(s.inFlight))
	}
}

// A CloudEvent may not name a requestId with a webhook prefix (gh-,
// gl-): 422 naming the field and the reason; other ids, "ghost-1"
// included, are taken.
func TestCloudEventRequestIDPrefixesReserved(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	body := githubPushPayload("acme/web", "refs/heads/main", beforeCommit, pushedCommit, false)
	hook := w.post("/hooks/github/acme", githubHeaders("push", "", body, acmeGitHub), body)
	if hook.code != http.StatusAccepted {
		t.Fatalf("webhook: %d %s", hook.code, hook.raw)
	}
	stored := len(w.stored())
	for _, id := range []string{requestIDs(t, hook)[0], "gh-mine", "gl-" + strings.Repeat("0", 40)} {
		r := w.post("/", binaryEvent(acmeToken, RequestedType, "/ci", "evt-"+id), mustJSON(t, requestJSON("acme", id)))
		errText, _ := r.body["error"].(string)
		if r.code != http.StatusUnprocessableEntity || !strings.Contains(errText, "reserved") || !strings.Contains(r.raw, `"field":"requestId"`) {
			t.Fatalf("requestId %s: %d %s, want 422 saying the prefix is reserved", id, r.code, r.raw)
		}
	}
	if n := len(w.stored()); n != stored {
		t.Fatalf("refused events stored %d messages", n-stored)
	}
	for _, id := range []string{"ghost-1", "GH-upper", "build-gh-1"} {
		if r := w.post("/", binaryEvent(acmeToken, RequestedType, "/ci", "evt-"+id), mustJSON(t, requestJSON("acme", id))); r.code != http.StatusAccepted {
			t.Fatalf("requestId %s: %d %s, want 202", id, r.code, r.raw)
		}
	}
}
