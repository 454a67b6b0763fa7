package gateway

import (
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
)

// githubPush is a push event payload as GitHub sends it (the fields of
// docs.github.com's "push" webhook; commits trimmed to one).
func githubPushPayload(fullName, ref, before, after string, deleted bool) []byte {
	headCommit := "null"
	if !deleted {
		headCommit = fmt.Sprintf(`{"id":%q,"tree_id":"f9d2a07e9488b91af2641b26b9407fe22a451433","distinct":true,
  "message":"Update README.md","timestamp":"2026-01-02T03:04:05+01:00","url":"https://github.com/%s/commit/%s",
  "author":{"name":"Jane","email":"jane@acme.example","username":"jane"},
  "committer":{"name":"GitHub","email":"noreply@github.com","username":"web-flow"},
  "added":[],"removed":[],"modified":["README.md"]}`, after, fullName, after)
	}
	return fmt.Appendf(nil, `{
  "ref": %q, "before": %q, "after": %q,
  "repository": {"id": 186853002, "node_id": "MDEwOlJlcG9zaXRvcnkxODY4NTMwMDI=", "name": %q, "full_name": %q,
    "private": false, "owner": {"name": "acme", "login": "acme", "id": 21031067, "type": "Organization"},
    "html_url": "https://github.com/%s", "url": "https://github.com/%s",
    "git_url": "git://github.com/%s.git", "ssh_url": "git@github.com:%s.git",
    "clone_url": "https://github.com/%s.git", "svn_url": "https://github.com/%s",
    "default_branch": "main", "master_branch": "main"},
  "pusher": {"name": "jane", "email": "jane@acme.example"},
  "sender": {"login": "jane", "id": 21031067, "type": "User"},
  "created": false, "deleted": %t, "forced": false, "base_ref": null,
  "compare": "https://github.com/%s/compare/%s...%s",
  "commits": [], "head_commit": %s
}`, ref, before, after, fullName[strings.Index(fullName, "/")+1:], fullName,
		fullName, fullName, fullName, fullName, fullName, fullName, deleted, fullName, before[:12], after[:12], headCommit)
}

// gitlabPushPayload is a Push Hook (or, with a refs/tags/ ref, a Tag Push
// Hook) payload as GitLab sends it (docs.gitlab.com's webhook events).
func gitlabPushPayload(pathWithNamespace, ref, before, after, checkout string) []byte {
	kind := "push"
	if strings.HasPrefix(ref, "refs/tags/") {
		kind = "tag_push"
	}
	co := "null"
	if checkout != "" {
		co = fmt.Sprintf("%q", checkout)
	}
	return fmt.Appendf(nil, `{
  "object_kind": %q, "event_name": %q, "before": %q, "after": %q, "ref": %q, "ref_protected": true,
  "checkout_sha": %s, "message": null, "user_id": 4, "user_name": "John Smith", "user_username": "jsmith",
  "user_email": "", "user_avatar": "https://s.gravatar.com/avatar/d4c74594d841139328695756648b6bd6?s=8",
  "project_id": 15,
  "project": {"id": 15, "name": "API", "description": "", "web_url": "https://gitlab.example.com/%s",
    "avatar_url": null, "git_ssh_url": "git@gitlab.example.com:%s.git",
    "git_http_url": "https://gitlab.example.com/%s.git", "namespace": "Acme", "visibility_level": 0,
    "path_with_namespace": %q, "default_branch": "main", "ci_config_path": null,
    "homepage": "https://gitlab.example.com/%s", "url": "git@gitlab.example.com:%s.git",
    "ssh_url": "git@gitlab.example.com:%s.git", "http_url": "https://gitlab.example.com/%s.git"},
  "commits": [], "total_commits_count": 0, "push_options": {},
  "repository": {"name": "API", "url": "git@gitlab.example.com:%s.git", "description": "",
    "homepage": "https://gitlab.example.com/%s", "git_http_url": "https://gitlab.example.com/%s.git",
    "git_ssh_url": "git@gitlab.example.com:%s.git", "visibility_level": 0}
}`, kind, kind, before, after, ref, co, pathWithNamespace, pathWithNamespace, pathWithNamespace, pathWithNamespace,
		pathWithNamespace, pathWithNamespace, pathWithNamespace, pathWithNamespace, pathWithNamespace, pathWithNamespace,
		pathWithNamespace, pathWithNamespace)
}

func githubHeaders(event, delivery string, body []byte, secret string) map[string]string {
	h := map[string]string{"Content-Type": "application/json", "X-GitHub-Event": event, "User-Agent": "GitHub-Hookshot/abc123"}
	if delivery != "" {
		h["X-GitHub-Delivery"] = delivery
	}
	if secret != "" {
		h["X-Hub-Signature-256"] = githubSign(secret, body)
	}
	return h
}

func requestIDs(t *testing.T, r response) []string {
	t.Helper()
	raw, ok := r.body["requestIds"].([]any)
	if !ok {
		t.Fatalf("no requestIds in %s", r.raw)
	}
	ids := make([]string, len(raw))
	for i, v := range raw {
		ids[i] = v.(string)
	}
	return ids
}

// A push to main matches two triggers of the repository (its clone URL
// and its .git form): two requests, each pinned to the pushed ref and
// commit, with each trigger's build settings. The same push again (a
// redelivery) answers the same ids and stores nothing new.
func TestGitHubPushBuildsEveryMatchingTrigger(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	body := githubPushPayload("acme/web", "refs/heads/main", beforeCommit, pushedCommit, false)
	r := w.post("/hooks/github/acme", githubHeaders("push", "72d3162e-cc78-11e3-81ab-4c9367dc0958", body, acmeGitHub), body)
	if r.code != http.StatusAccepted {
		t.Fatalf("answer %d %s", r.code, r.raw)
	}
	ids := requestIDs(t, r)
	got := w.stored()
	if len(ids) != 2 || len(got) != 2 {
		t.Fatalf("ids %v, %d stored; want two of each", ids, len(got))
	}
	byName := map[string]storedMsg{}
	for i, m := range got {
		checkStored(t, m, "acme", ids[i])
		byName[m.req.Name] = m
		g := m.req.Source.Git
		if g == nil || g.Ref != "refs/heads/main" || g.Commit != pushedCommit {
			t.Errorf("%s: source %+v, want refs/heads/main at %s", m.req.Name, g, pushedCommit)
		}
	}
	web, docs := byName["web"].req, byName["web-docs"].req
	if web.Source.Git == nil || web.Source.Git.URL != acmeRepo || web.Image != "registry.example.com/acme/web" {
		t.Errorf("web: %+v", web)
	}
	if docs.Source.Git == nil || docs.Source.Git.URL != acmeRepo+".git" || docs.Source.Git.SubPath != "docs" || docs.Dockerfile != "docs/Dockerfile" ||
		!slices.Equal(docs.Platforms, []string{"linux/amd64", "linux/arm64"}) || docs.BuildArgs["MODE"] != "docs" {
		t.Errorf("web-docs: %+v", docs)
	}

	again := w.post("/hooks/github/acme", githubHeaders("push", "72d3162e-cc78-11e3-81ab-4c9367dc0958", body, acmeGitHub), body)
	if again.code != http.StatusAccepted || !slices.Equal(requestIDs(t, again), ids) {
		t.Fatalf("redelivery: %d %s, want ids %v", again.code, again.raw, ids)
	}
	if n := len(w.stored()); n != 2 {
		t.Fatalf("the redelivered webhook stored %d messages in all, want 2", n)
	}
	// A new delivery of a new push is new requests.
	body2 := githubPushPayload("acme/web", "refs/heads/main", pushedCommit, beforeCommit, false)
	next := w.post("/hooks/github/acme", githubHeaders("push", "a-new-delivery", body2, acmeGitHub), body2)
	if next.code != http.StatusAccepted || len(requestIDs(t, next)) != 2 || slices.Contains(ids, requestIDs(t, next)[0]) {
		t.Fatalf("a new push: %d %s", next.code, next.raw)
	}
	if n := len(w.stored()); n != 4 {
		t.Fatalf("%d messages stored, want 4", n)
	}
}

// The webhook secret is checked: a missing or wrong signature, a signature
// of another body, or the other forge's header are refused and store
// nothing; ping answers 200, other events are ignored.
func TestGitHubSignatureAndEvents(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	body := githubPushPayload("acme/web", "refs/heads/main", beforeCommit, pushedCommit, false)
	tampered := []byte(strings.Replace(string(body), pushedCommit, strings.Repeat("f", 40), 2))
	for _, tc := range []struct {
		name    string
		headers map[string]string
		body    []byte
		code    int
		want    string
	}{
		{"missing signature", githubHeaders("push", "d1", body, ""), body, http.StatusUnauthorized, "no X-Hub-Signature-256"},
		{"wrong secret", githubHeaders("push", "d1", body, "not-the-secret"), body, http.StatusUnauthorized, "does not match"},
		{"tampered body", githubHeaders("push", "d1", body, acmeGitHub), tampered, http.StatusUnauthorized, "does not match"},
		{"sha1 only", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature": "sha1=0000"}, body, http.StatusUnauthorized, "no X-Hub-Signature-256"},
		{"not hex", map[string]string{"X-GitHub-Event": "push", "X-Hub-Signature-256": "sha256=zz"}, body, http.StatusUnauthorized, "does not match"},
		{"unknown tenant", githubHeaders("push", "d1", body, acmeGitHub), body, http.StatusNotFound, "no github webhook"},
		{"tenant without the webhook", githubHeaders("push", "d1", body, acmeGitHub), body, http.StatusNotFound, "tenant globex"},
		{"oversize", githubHeaders("push", "d1", nil, acmeGitHub), make([]byte, DefaultMaxWebhookBytes+1), http.StatusRequestEntityTooLarge, "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := "/hooks/github/acme"
			switch tc.name {
			case "unknown tenant":
				path = "/hooks/github/initech"
			case "tenant without the webhook":
				path = "/hooks/github/globex"
			}
			r := w.post(path, tc.headers, tc.body)
			errText, _ := r.body["error"].(string)
			if r.code != tc.code || !strings.Contains(errText, tc.want) {
				t.Fatalf("answer %d %s, want %d with %q", r.code, r.raw, tc.code, tc.want)
			}
			if strings.Contains(r.raw, acmeGitHub) {
				t.Fatalf("the answer holds the secret: %s", r.raw)
			}
		})
	}
	ping := []byte(`{"zen":"Keep it logically awesome.","hook_id":12345678,"hook":{"type":"Repository","id":12345678,"name":"web","active":true,"events":["push"],"config":{"content_type":"json","insecure_ssl":"0","url":"https://buildq.example/hooks/github/acme"}},"repository":{"full_name":"acme/web"}}`)
	if r := w.post("/hooks/github/acme", githubHeaders("ping", "p1", ping, acmeGitHub), ping); r.code != http.StatusOK || !strings.Contains(r.raw, "pong") {
		t.Errorf("ping: %d %s", r.code, r.raw)
	}
	issue := []byte(`{"action":"opened","issue":{"number":1}}`)
	if r := w.post("/hooks/github/acme", githubHeaders("issues", "i1", issue, acmeGitHub), issue); r.code != http.StatusAccepted || !strings.Contains(r.raw, "ignored") {
		t.Errorf("issues event: %d %s", r.code, r.raw)
	}
	// The form content type: the JSON is the form's payload field, the
	// signature covers the form.
	form := []byte("payload=" + url.QueryEscape(string(body)))
	h := githubHeaders("push", "form-1", form, acmeGitHub)
	h["Content-Type"] = "application/x-www-form-urlencoded"
	if r := w.post("/hooks/github/acme", h, form); r.code != http.StatusAccepted || len(requestIDs(t, r)) != 2 {
		t.Errorf("form push: %d %s", r.code, r.raw)
	}
	if n := len(w.stored()); n != 2 {
		t.Fatalf("%d messages stored, want the form push's 2 only", n)
	}
	for _, lvl := range w.logs.All() {
		for _, f := range lvl.Context {
			if strings.Contains(f.String, acmeGitHub) || strings.Contains(f.String, "sha256=") {
				t.Fatalf("a log line holds a secret or signature: %v", lvl)
			}
		}
	}
}

// Branch and tag filters decide which triggers build; a deleted branch
// builds nothing; a push of another repository builds nothing.
func TestGitHubPushFilters(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	total := 0
	for _, tc := range []struct {
		name, repo, ref string
		deleted         bool
		builds          []string // names built
	}{
		{"main: both triggers", "acme/web", "refs/heads/main", false, []string{"web", "web-docs"}},
		{"release branch: web's pattern only", "acme/web", "refs/heads/release/1.2", false, []string{"web"}},
		{"release/*/x: * stays in one segment", "acme/web", "refs/heads/release/1.2/hotfix", false, nil},
		{"feature branch: no trigger", "acme/web", "refs/heads/feature/login", false, nil},
		{"tag v1.0.0: web-docs's tag pattern", "acme/web", "refs/tags/v1.0.0", false, []string{"web-docs"}},
		{"tag nightly: no trigger", "acme/web", "refs/tags/nightly", false, nil},
		{"deleted main", "acme/web", "refs/heads/main", true, nil},
		{"another repository", "acme/unknown", "refs/heads/main", false, nil},
		{"no filters: any branch of acme/other (ssh URL)", "acme/other", "refs/heads/anything", false, []string{"other"}},
		{"no filters: tags too", "acme/other", "refs/tags/x", false, []string{"other"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			after := pushedCommit
			if tc.deleted {
				after = strings.Repeat("0", 40)
			}
			body := githubPushPayload(tc.repo, tc.ref, beforeCommit, after, tc.deleted)
			r := w.post("/hooks/github/acme", githubHeaders("push", "delivery-"+tc.name, body, acmeGitHub), body)
			if r.code != http.StatusAccepted {
				t.Fatalf("answer %d %s", r.code, r.raw)
			}
			ids := requestIDs(t, r)
			if len(ids) != len(tc.builds) {
				t.Fatalf("%d requests (%s), want %v", len(ids), r.raw, tc.builds)
			}
			got := w.stored()
			var names []string
			for _, m := range got[total:] {
				names = append(names, m.req.Name)
				if m.req.Source.Git.Ref != tc.ref {
					t.Errorf("ref %s, want %s", m.req.Source.Git.Ref, tc.ref)
				}
			}
			slices.Sort(names)
			if !slices.Equal(names, tc.builds) {
				t.Fatalf("built %v, want %v", names, tc.builds)
			}
			total += len(tc.builds)
			if len(tc.builds) == 0 && r.body["message"] == "" {
				t.Errorf("no message says why nothing was built: %s", r.raw)
			}
		})
	}
}

// GitLab: the secret token is checked; Push Hook and Tag Push Hook build
// the pushed commit (checkout_sha); a redelivery of the same push, with
// whatever Idempotency-Key or event UUID or none, stores nothing new; a
// deleted branch builds nothing.
func TestGitLabPush(t *testing.T) {
	t.Parallel()
	w := newWorld(t, worldOptions{})
	hdr := func(event, token string, extra ...string) map[string]string {
		h := map[string]string{"Content-Type": "application/json", "X-Gitlab-Event": event, "X-Gitlab-Instance": "https://gitlab.example.com"}
		if token != "" {
			h["X-Gitlab-Token"] = token
		}
		for i := 0; i+1 < len(extra); i += 2 {
			h[extra[i]] = extra[i+1]
		}
		return h
	}
	push := gitlabPushPayload("acme/api", "refs/heads/main", beforeCommit, pushedCommit, pushedCommit)
	for _, tc := range []struct {
		name    string
		headers map[string]string
		code    int
	}{
		{"no token", hdr("Push Hook", ""), http.StatusUnauthorized},
		{"wrong token", hdr("Push Hook", acmeGitLab+"x"), http.StatusUnauthorized},
		{"the GitHub secret", hdr("Push Hook", acmeGitHub), http.StatusUnauthorized},
	} {
		if r := w.post("/hooks/gitlab/acme", tc.headers, push); r.code != tc.code {
			t.Errorf("%s: %d %s, want %d", tc.name, r.code, r.raw, tc.code)
		}
	}
	if n := len(w.stored()); n != 0 {
		t.Fatalf("refused webhooks stored %d messages", n)
	}

	r := w.post("/hooks/gitlab/acme", hdr("Push Hook", acmeGitLab, "Idempotency-Key", "908a6d9e-45fd-46c8-97e6-c4f350f219dd", "X-Gitlab-Event-UUID", "u-1"), push)
	ids := requestIDs(t, r)
	if r.code != http.StatusAccepted || len(ids) != 1 {
		t.Fatalf("push: %d %s", r.code, r.raw)
	}
	// A retry keeps the Idempotency-Key (its event UUID may differ).
	again := w.post("/hooks/gitlab/acme", hdr("Push Hook", acmeGitLab, "Idempotency-Key", "908a6d9e-45fd-46c8-97e6-c4f350f219dd", "X-Gitlab-Event-UUID", "u-2"), push)
	if again.code != http.StatusAccepted || !slices.Equal(requestIDs(t, again), ids) {
		t.Fatalf("retry: %d %s, want %v", again.code, again.raw, ids)
	}
	got := w.stored()
	if len(got) != 1 {
		t.Fatalf("%d stored, want 1", len(got))
	}
	checkStored(t, got[0], "acme", ids[0])
	if g := got[0].req.Source.Git; g.URL != acmeLabRepo || g.Ref != "refs/heads/main" || g.Commit != pushedCommit || got[0].req.Name != "api" {
		t.Errorf("stored %+v %+v", got[0].req, g)
	}

	// An annotated tag: "after" is the tag object, checkout_sha the commit.
	tagObject := strings.Repeat("7", 40)
	tag := gitlabPushPayload("acme/api", "refs/tags/v2.0.0", strings.Repeat("0", 40), tagObject, pushedCommit)
	tr := w.post("/hooks/gitlab/acme", hdr("Tag Push Hook", acmeGitLab), tag)
	if tr.code != http.StatusAccepted || len(requestIDs(t, tr)) != 1 {
		t.Fatalf("tag push: %d %s", tr.code, tr.raw)
	}
	// No delivery header: the same push, the same request.
	if tr2 := w.post("/hooks/gitlab/acme", hdr("Tag Push Hook", acmeGitLab), tag); !slices.Equal(requestIDs(t, tr2), requestIDs(t, tr)) {
		t.Fatalf("the same tag push again: %s, want %v", tr2.raw, requestIDs(t, tr))
	}
	got = w.stored()
	if len(got) != 2 || got[1].req.Source.Git.Commit != pushedCommit || got[1].req.Source.Git.Ref != "refs/tags/v2.0.0" {
		t.Fatalf("stored %d; the tag's request %+v", len(got), got[len(got)-1].req.Source.Git)
	}

	deleted := gitlabPushPayload("acme/api", "refs/heads/main", pushedCommit, strings.Repeat("0", 40), "")
	if r := w.post("/hooks/gitlab/acme", hdr("Push Hook", acmeGitLab), deleted); r.code != http.StatusAccepted || len(requestIDs(t, r)) != 0 {
		t.Fatalf("deleted branch: %d %s", r.code, r.raw)
	}
	mr := []byte(`{"object_kind":"merge_request","project":{"id":15}}`)
	if r := w.post("/hooks/gitlab/acme", hdr("Merge Request Hook", acmeGitLab), mr); r.code != http.StatusAccepted || !strings.Contains(r.raw, "ignored") {
		t.Fatalf("merge request event: %d %s", r.code, r.raw)
	}
	if n := len(w.stored()); n != 2 {
		t.Fatalf("%d stored, want 2", n)
	}
}
