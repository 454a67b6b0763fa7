package gitsource

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh/knownhosts"

	v1 "github.com/buildq/buildq/api/v1"
)

func creds(c *Credentials) func(string) (*Credentials, error) {
	return func(tenant string) (*Credentials, error) {
		if tenant != "tenant" {
			return nil, errors.New("credentials asked for the wrong tenant")
		}
		return c, nil
	}
}

func TestFetch_HTTPBasicAuth(t *testing.T) {
	t.Parallel()
	const token = "s3cret-token-value"
	repo := newRepo(t)
	files := map[string]f{"Dockerfile": reg("FROM scratch\n")}
	repo.commitFiles("main", files)
	_, base := serve(t, serverOpts{user: "x-access-token", pass: token}, map[string]*testRepo{"r": repo})
	url := base + "/r.git"
	src := Source{URL: url, Ref: "main"}

	fr := newFetcher(t)
	fr.Credentials = creds(&Credentials{Password: token}) // the username defaults to x-access-token
	if c := fetchOK(t, fr, src); c.Digest != uploadDigest(t, files, "") {
		t.Errorf("digest %s", c.Digest)
	}

	fr.Credentials = creds(&Credentials{Username: "x-access-token", Password: "wrong-password-value"})
	e := fetchErr(t, fr, src, v1.ReasonGitAuthFailed)
	mustContain(t, e.Message, "refused the tenant's credentials", "401")
	noSecret(t, e, "wrong-password-value", token)

	for _, none := range []func(string) (*Credentials, error){nil, creds(nil)} {
		fr.Credentials = none
		e = fetchErr(t, fr, src, v1.ReasonGitAuthFailed)
		mustContain(t, e.Message, "requires credentials")
	}

	// Userinfo in the URL is neither used nor shown.
	fr.Credentials = nil
	withUserinfo := strings.Replace(url, "http://", "http://x-access-token:"+token+"@", 1)
	e = fetchErr(t, fr, Source{URL: withUserinfo, Ref: "main"}, v1.ReasonGitAuthFailed)
	noSecret(t, e, token, "x-access-token:")
	fr.Credentials = creds(&Credentials{Password: token})
	if c := fetchOK(t, fr, Source{URL: withUserinfo, Ref: "main"}); c.URL != url {
		t.Errorf("Context.URL = %q, want %q", c.URL, url)
	}

	// A credentials store in trouble is transient.
	fr.Credentials = func(string) (*Credentials, error) { return nil, errors.New("vault sealed") }
	_ = fetchErr(t, fr, src, "")
}

func TestFetch_ServerEchoingTheTokenDoesNotLeakIt(t *testing.T) {
	t.Parallel()
	const token = "echoed-secret-token"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, pass, _ := r.BasicAuth()
		http.Error(w, "token "+pass+" has expired; see https://user:"+pass+"@example.com", http.StatusForbidden)
	}))
	t.Cleanup(srv.Close)
	fr := newFetcher(t)
	fr.Credentials = creds(&Credentials{Password: token})
	e := fetchErr(t, fr, Source{URL: srv.URL + "/r.git", Ref: "main"}, v1.ReasonGitAuthFailed)
	mustContain(t, e.Message, "403", "has expired")
	noSecret(t, e, token)
}

func TestFetch_SSH(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	commits, files := history(repo, 3)
	git := newGitServer(t, serverOpts{})
	git.repos["/r.git"] = repo
	clientKey, clientPEM := newKey(t)
	_, otherPEM := newKey(t)
	srv := git.serveSSH(clientKey.PublicKey())
	other := newGitServer(t, serverOpts{}).serveSSH(clientKey.PublicKey()) // another host key
	url := srv.url("/r.git")
	src := Source{URL: url, Ref: "main"}
	ok := &Credentials{SSHKey: clientPEM, KnownHosts: srv.knownHosts()}

	fr := newFetcher(t)
	fr.Credentials = creds(ok)
	if c := fetchOK(t, fr, src); c.Commit != commits[2].String() || c.Digest != uploadDigest(t, files[2], "") {
		t.Errorf("ssh fetch: commit %s digest %s", c.Commit, c.Digest)
	}
	// Below the tip: more than one upload-pack session on the connection.
	below := Source{URL: url, Ref: "main", Commit: commits[0].String()}
	if c := fetchOK(t, fr, below); c.Commit != commits[0].String() || c.Digest != uploadDigest(t, files[0], "") {
		t.Errorf("ssh fetch below the tip: commit %s digest %s", c.Commit, c.Digest)
	}

	for _, tc := range []struct {
		name  string
		creds *Credentials
		says  string
	}{
		{"wrong key", &Credentials{SSHKey: otherPEM, KnownHosts: srv.knownHosts()}, "refused the tenant's SSH key"},
		{"no key", &Credentials{KnownHosts: srv.knownHosts()}, "requires an SSH key"},
		{"changed host key", &Credentials{SSHKey: clientPEM, KnownHosts: []byte(knownhosts.Line(
			[]string{knownhosts.Normalize(srv.ln.Addr().String())}, other.hostKey.PublicKey()))}, "does not match the tenant's known hosts"},
		{"unknown host", &Credentials{SSHKey: clientPEM, KnownHosts: other.knownHosts()}, "is not among the tenant's known hosts"},
		{"no known hosts", &Credentials{SSHKey: clientPEM}, "is not among the tenant's known hosts"},
		{"unusable key", &Credentials{SSHKey: []byte("not a key"), KnownHosts: srv.knownHosts()}, "cannot be used"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fr := newFetcher(t)
			fr.Credentials = creds(tc.creds)
			e := fetchErr(t, fr, src, v1.ReasonGitAuthFailed)
			mustContain(t, e.Message, tc.says)
			noSecret(t, e, string(clientPEM), string(otherPEM))
		})
	}

	t.Run("host key checks can be turned off", func(t *testing.T) {
		fr := newFetcher(t)
		fr.Credentials = creds(&Credentials{SSHKey: clientPEM, InsecureIgnoreHostKey: true})
		fetchOK(t, fr, src)
	})
	t.Run("missing repository, in the server's words", func(t *testing.T) {
		e := fetchErr(t, fr, Source{URL: srv.url("/absent.git"), Ref: "main"}, v1.ReasonGitAuthFailed)
		mustContain(t, e.Message, "does not appear to be a git repository")
	})
	t.Run("host not allowed: no connection", func(t *testing.T) {
		fr := newFetcher(t)
		fr.Credentials = creds(ok)
		fr.Policy.AllowedHosts = []string{"git.example.com"}
		n := git.requestCount()
		_ = fetchErr(t, fr, src, v1.ReasonGitHostRefused)
		if git.requestCount() != n {
			t.Error("the refused host was contacted")
		}
	})
	t.Run("canceled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := fr.Fetch(ctx, "tenant", src, nil)
		var e *Error
		if !errors.As(err, &e) || !e.Transient || e.Reason != "" {
			t.Errorf("canceled fetch: %v, want a transient *Error", err)
		}
	})
}

// Only a text/plain refusal is echoed, as git servers word theirs; of
// any other answer only the content type is told.
func TestFetch_OnlyTextAnswersAreEchoed(t *testing.T) {
	t.Parallel()
	for ct, says := range map[string]string{
		"application/json; charset=utf-8": "an answer of type application/json, not shown",
		"text/html":                       "an answer of type text/html, not shown",
		"":                                "an answer of no content type, not shown",
		"body-secret in the header":       "an answer of an invalid content type, not shown",
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header()["Content-Type"] = []string{ct}
			w.WriteHeader(http.StatusForbidden)
			_, _ = w.Write([]byte("body-secret"))
		}))
		t.Cleanup(srv.Close)
		e := fetchErr(t, newFetcher(t), Source{URL: srv.URL + "/r.git", Ref: "main"}, v1.ReasonGitAuthFailed)
		mustContain(t, e.Message, "HTTP 403", says)
		if strings.Contains(e.Message, "body-secret") {
			t.Errorf("%q: %s", ct, e.Message)
		}
	}
}
