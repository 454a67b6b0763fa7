package registry

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// fakeHarbor implements HEAD and POST /api/v2.0/projects.
type fakeHarbor struct {
	mu       sync.Mutex
	projects map[string]bool
	// headStatus/postStatus, when set, override the answers.
	headStatus, postStatus int
	postBody               string // body sent with postStatus
	// seen requests
	heads, posts []harborRequest
}

type harborRequest struct {
	user, pass  string
	query       string
	contentType string
	body        map[string]any
}

func newFakeHarbor(projects ...string) *fakeHarbor {
	f := &fakeHarbor{projects: map[string]bool{}}
	for _, p := range projects {
		f.projects[p] = true
	}
	return f
}

func (f *fakeHarbor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.URL.Path != "/api/v2.0/projects" {
		http.NotFound(w, r)
		return
	}
	u, p, _ := r.BasicAuth()
	req := harborRequest{user: u, pass: p, query: r.URL.RawQuery, contentType: r.Header.Get("Content-Type")}
	switch r.Method {
	case http.MethodHead:
		f.heads = append(f.heads, req)
		switch {
		case f.headStatus != 0:
			w.WriteHeader(f.headStatus)
		case f.projects[r.URL.Query().Get("project_name")]:
			w.WriteHeader(http.StatusOK)
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	case http.MethodPost:
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &req.body)
		f.posts = append(f.posts, req)
		if f.postStatus != 0 {
			w.WriteHeader(f.postStatus)
			_, _ = io.WriteString(w, f.postBody)
			return
		}
		name, _ := req.body["project_name"].(string)
		if f.projects[name] {
			w.WriteHeader(http.StatusConflict)
			return
		}
		f.projects[name] = true
		w.WriteHeader(http.StatusCreated)
	default:
		w.WriteHeader(http.StatusMethodNotAllowed)
	}
}

func (f *fakeHarbor) seen() (heads, posts []harborRequest) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]harborRequest(nil), f.heads...), append([]harborRequest(nil), f.posts...)
}

func (f *fakeHarbor) has(p string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.projects[p]
}

// harborClient serves f and returns a client whose config holds
// admin/Harbor12345 for it.
func harborClient(t *testing.T, f *fakeHarbor) (*Client, string) {
	t.Helper()
	host := serve(t, f)
	return newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "admin", "Harbor12345"), Insecure: []string{host}}), host
}

func TestEnsureHarborProject(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("creates a missing project", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		c, host := harborClient(t, f)
		if err := c.EnsureHarborProject(ctx, host, "team-a"); err != nil {
			t.Fatal(err)
		}
		if !f.has("team-a") {
			t.Fatal("project not created")
		}
		heads, posts := f.seen()
		if len(heads) != 1 || heads[0].query != "project_name=team-a" {
			t.Fatalf("HEADs = %+v, want one for project_name=team-a", heads)
		}
		if len(posts) != 1 {
			t.Fatalf("%d POSTs, want 1", len(posts))
		}
		p := posts[0]
		if p.user != "admin" || p.pass != "Harbor12345" {
			t.Errorf("POST authenticated as %q/%q, want the config's admin/Harbor12345", p.user, p.pass)
		}
		if p.contentType != "application/json" {
			t.Errorf("Content-Type %q", p.contentType)
		}
		want := map[string]any{"project_name": "team-a", "metadata": map[string]any{"public": "false"}}
		if got, _ := json.Marshal(p.body); string(got) != mustJSON(t, want) {
			t.Errorf("POST body %s, want %s", got, mustJSON(t, want))
		}
	})
	t.Run("existing project: no POST", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor("team-a")
		c, host := harborClient(t, f)
		if err := c.EnsureHarborProject(ctx, host, "team-a"); err != nil {
			t.Fatal(err)
		}
		heads, posts := f.seen()
		if len(heads) != 1 || len(posts) != 0 {
			t.Fatalf("%d HEADs and %d POSTs, want 1 and 0", len(heads), len(posts))
		}
		if heads[0].user != "admin" {
			t.Errorf("HEAD authenticated as %q, want admin", heads[0].user)
		}
	})
	t.Run("409 conflict is success", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		f.postStatus = http.StatusConflict
		f.postBody = `{"errors":[{"code":"CONFLICT","message":"The project named team-a already exists"}]}`
		c, host := harborClient(t, f)
		if err := c.EnsureHarborProject(ctx, host, "team-a"); err != nil {
			t.Fatalf("err = %v, want nil", err)
		}
	})
	t.Run("403 says the credentials cannot create projects", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		f.postStatus = http.StatusForbidden
		f.postBody = `{"errors":[{"code":"FORBIDDEN","message":"forbidden"}]}`
		c, host := harborClient(t, f)
		err := c.EnsureHarborProject(ctx, host, "team-a")
		if err == nil {
			t.Fatal("err = nil")
		}
		for _, s := range []string{"cannot create", "admin", "403", "FORBIDDEN", "team-a"} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("error %q does not mention %q", err, s)
			}
		}
		if strings.Contains(err.Error(), "Harbor12345") {
			t.Errorf("error %q leaks the password", err)
		}
	})
	t.Run("401 without credentials says so", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		f.postStatus = http.StatusUnauthorized
		host := serve(t, f)
		c := newClient(t, Options{Insecure: []string{host}})
		err := c.EnsureHarborProject(ctx, host, "team-a")
		if err == nil || !strings.Contains(err.Error(), "anonymous") || !strings.Contains(err.Error(), "cannot create") {
			t.Fatalf("err = %v, want it to blame anonymous requests", err)
		}
		_, posts := f.seen()
		if len(posts) != 1 || posts[0].user != "" {
			t.Fatalf("POSTs = %+v, want one without credentials", posts)
		}
	})
	t.Run("other failures carry status and a bounded body", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		f.postStatus = http.StatusInternalServerError
		f.postBody = "database is down\n" + strings.Repeat("x", 10000)
		c, host := harborClient(t, f)
		err := c.EnsureHarborProject(ctx, host, "team-a")
		if err == nil || !strings.Contains(err.Error(), "500") || !strings.Contains(err.Error(), "database is down") {
			t.Fatalf("err = %v, want status and body", err)
		}
		if len(err.Error()) > 1000 {
			t.Fatalf("error is %d bytes long; the body must be bounded", len(err.Error()))
		}
	})
	t.Run("a HEAD it may not make still ends in a POST", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor("team-a")
		f.headStatus = http.StatusForbidden // e.g. a robot account
		c, host := harborClient(t, f)
		if err := c.EnsureHarborProject(ctx, host, "team-a"); err != nil {
			t.Fatalf("err = %v, want nil (409 after the POST)", err)
		}
		if _, posts := f.seen(); len(posts) != 1 {
			t.Fatalf("%d POSTs, want 1", len(posts))
		}
	})
	t.Run("https unless insecure", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		srv := httptest.NewTLSServer(f)
		t.Cleanup(srv.Close)
		host := strings.TrimPrefix(srv.URL, "https://")
		c := newClient(t, Options{DockerConfig: writeDockerConfig(t, host, "admin", "Harbor12345"), Transport: srv.Client().Transport})
		if err := c.EnsureHarborProject(ctx, host, "team-a"); err != nil {
			t.Fatal(err)
		}
		if !f.has("team-a") {
			t.Fatal("project not created over https")
		}
	})
	t.Run("bad names are refused before any request", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		c, host := harborClient(t, f)
		for _, p := range []string{"", "Team", "team/a", "team a", "team?x=1", strings.Repeat("a", 256)} {
			if err := c.EnsureHarborProject(ctx, host, p); err == nil {
				t.Errorf("project %q accepted", p)
			}
		}
		for _, r := range []string{"", "https://" + host, host + "/api"} {
			if err := c.EnsureHarborProject(ctx, r, "team-a"); err == nil {
				t.Errorf("registry %q accepted", r)
			}
		}
		if heads, posts := f.seen(); len(heads)+len(posts) != 0 {
			t.Fatalf("%d requests sent", len(heads)+len(posts))
		}
	})
	t.Run("cancelled context", func(t *testing.T) {
		t.Parallel()
		f := newFakeHarbor()
		c, host := harborClient(t, f)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := c.EnsureHarborProject(cctx, host, "team-a"); err == nil {
			t.Fatal("err = nil")
		}
		if f.has("team-a") {
			t.Fatal("project created despite the cancelled context")
		}
	})
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestExcerpt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"empty", "", ""},
		{"whitespace", " \n\t", ""},
		{"one line", "a\n  b\r\nc", ": a b c"},
		{"invalid utf-8", "a\xffb", ": a?b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := excerpt([]byte(tc.in)); got != tc.want {
				t.Fatalf("excerpt(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	t.Run("long bodies are cut on a rune boundary", func(t *testing.T) {
		t.Parallel()
		got := excerpt([]byte(strings.Repeat("é", 1000)))
		if !strings.HasSuffix(got, "…") || len(got) > harborBodyShow+len(": …") {
			t.Fatalf("excerpt is %d bytes: %q", len(got), got)
		}
		if !strings.HasPrefix(got, ": é") || strings.ContainsRune(got, '\uFFFD') {
			t.Fatalf("excerpt broke a rune: %q", got)
		}
	})
}
