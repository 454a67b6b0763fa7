package gitsource

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/go-git/go-git/v5/plumbing/protocol/packp"

	v1 "github.com/buildq/buildq/api/v1"
)

// maxRedirects bounds the redirects of a ref discovery, as git's five.
const maxRedirects = 5

// userAgent starts with "git/": some hosts serve the smart protocol only
// to clients that say so.
const userAgent = "git/buildq"

// repo is a repository being fetched from: its server and the refs it
// advertised.
type repo struct {
	rem     remote
	adv     *packp.AdvRefs
	display string
}

// openRepo connects to the repository at u (without userinfo) after the
// policy allows its host, and reads its refs. sshUser is the user of an
// ssh:// URL.
func (r *run) openRepo(ctx context.Context, u *url.URL, sshUser string) (*repo, error) {
	if e := r.pol.checkURL(u); e != nil {
		return nil, e
	}
	var rem remote
	switch u.Scheme {
	case "http", "https":
		rem = r.newHTTPRemote(u)
	case "ssh":
		s, err := r.newSSHRemote(u, sshUser)
		if err != nil {
			return nil, err
		}
		rem = s
	default:
		return nil, invalid(fmt.Sprintf("unsupported git URL scheme %q", u.Scheme))
	}
	adv, err := rem.advertise(ctx)
	if err != nil {
		_ = rem.close()
		return nil, err
	}
	return &repo{rem: rem, adv: adv, display: u.String()}, nil
}

// httpRemote is a repository over git's smart HTTP protocol. Each one has
// its own transport, whose dialer enforces the run's policy; proxies from
// the environment are not used (a proxy would be the address dialed).
type httpRemote struct {
	r      *run
	tr     *http.Transport
	client *http.Client
	base   *url.URL // the repository URL; an initial redirect moves it
	origin string   // the origin the tenant's credentials may go to
	user   string
	pass   string
}

func (r *run) newHTTPRemote(u *url.URL) *httpRemote {
	h := &httpRemote{
		r:    r,
		base: u,
		tr: &http.Transport{
			Proxy:               nil,
			DialContext:         r.dialContext,
			TLSClientConfig:     &tls.Config{RootCAs: r.rootCAs, MinVersion: tls.VersionTLS12},
			TLSHandshakeTimeout: 30 * time.Second,
			DisableCompression:  true, // bytes counted are bytes a reader sees
			ForceAttemptHTTP2:   true,
			MaxIdleConnsPerHost: 2,
			IdleConnTimeout:     30 * time.Second,
		},
	}
	// The tenant's credentials go only to the source's own origin: a
	// submodule on another host, or a redirect away, gets none.
	if c := r.creds; c != nil && c.Password != "" && origin(u) == origin(r.repoURL) {
		h.origin, h.user, h.pass = origin(u), c.Username, c.Password
		if h.user == "" {
			h.user = "x-access-token"
		}
	}
	h.client = &http.Client{Transport: h, CheckRedirect: h.checkRedirect}
	return h
}

// origin is a URL's scheme and host, as credentials are scoped.
func origin(u *url.URL) string {
	return strings.ToLower(u.Scheme) + "://" + strings.ToLower(u.Host)
}

// RoundTrip checks every request, each redirect hop included, against
// the policy before it may connect, and adds the tenant's credentials to
// requests for their origin only.
func (h *httpRemote) RoundTrip(req *http.Request) (*http.Response, error) {
	if e := h.r.pol.checkURL(req.URL); e != nil {
		return nil, h.r.fail(e)
	}
	if h.origin != "" && origin(req.URL) == h.origin {
		req = req.Clone(req.Context())
		req.SetBasicAuth(h.user, h.pass)
	}
	return h.tr.RoundTrip(req)
}

// checkRedirect follows redirects of the ref discovery only (as git's
// http.followRedirects=initial), never from https to http.
func (h *httpRemote) checkRedirect(req *http.Request, via []*http.Request) error {
	if via[0].Method != http.MethodGet {
		return http.ErrUseLastResponse
	}
	if len(via) > maxRedirects {
		return fmt.Errorf("more than %d redirects", maxRedirects)
	}
	if via[len(via)-1].URL.Scheme == "https" && req.URL.Scheme != "https" {
		return h.r.fail(refuse(v1.ReasonGitHostRefused,
			fmt.Sprintf("%s redirected from https to %s://%s", h.r.display, req.URL.Scheme, req.URL.Host), nil))
	}
	return nil
}

func (h *httpRemote) display() string { return h.base.String() }

// advertise implements remote.
func (h *httpRemote) advertise(ctx context.Context) (*packp.AdvRefs, error) {
	u := *h.base
	u.Path = strings.TrimSuffix(u.Path, "/") + "/info/refs"
	u.RawPath = ""
	u.RawQuery = "service=git-upload-pack"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, invalidf(err, "the git URL %s cannot be requested", h.display())
	}
	req.Header.Set("User-Agent", userAgent)
	req.Header.Set("Accept", "*/*")
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, transient("list the refs of "+h.display(), err)
	}
	defer closeBody(resp)
	if err := h.status(resp); err != nil {
		return nil, err
	}
	if final := resp.Request.URL; final.String() != u.String() {
		p, ok := strings.CutSuffix(final.Path, "/info/refs")
		if !ok {
			return nil, invalid(fmt.Sprintf("%s redirected to %s://%s%s, which is not a git repository", h.display(), final.Scheme, final.Host, final.Path))
		}
		h.base = &url.URL{Scheme: final.Scheme, Host: final.Host, Path: p}
	}
	if mediaType(resp) != "application/x-git-upload-pack-advertisement" {
		return nil, invalid(fmt.Sprintf("%s does not speak git's smart HTTP protocol (it answered with %s)", h.display(), describeType(resp)))
	}
	return decodeAdvertisement(resp.Body, h.display())
}

// uploadPack implements remote.
func (h *httpRemote) uploadPack(ctx context.Context, body []byte) (io.ReadCloser, error) {
	u := *h.base
	u.Path = strings.TrimSuffix(u.Path, "/") + "/git-upload-pack"
	u.RawPath = ""
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return nil, invalidf(err, "the git URL %s cannot be requested", h.display())
	}
	req.Header.Set("User-Agent", userAgent)
	req.Header.Set("Content-Type", "application/x-git-upload-pack-request")
	req.Header.Set("Accept", "application/x-git-upload-pack-result")
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, transient("fetch from "+h.display(), err)
	}
	if err := h.status(resp); err != nil {
		closeBody(resp)
		return nil, err
	}
	if mediaType(resp) != "application/x-git-upload-pack-result" {
		closeBody(resp)
		return nil, invalid(fmt.Sprintf("%s answered an upload-pack request with %s", h.display(), describeType(resp)))
	}
	return resp.Body, nil
}

// close implements remote.
func (h *httpRemote) close() error {
	h.tr.CloseIdleConnections()
	return nil
}

// status turns an HTTP status other than 2xx into the request's failure
// (401, 403, 404 and other 4xx) or transient trouble (408, 429, 5xx),
// with the server's words (answerWords).
func (h *httpRemote) status(resp *http.Response) error {
	code := resp.StatusCode
	if code >= 200 && code < 300 {
		return nil
	}
	words := answerWords(resp)
	where := h.display()
	switch {
	case code == http.StatusUnauthorized && h.origin == "":
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("%s requires credentials and the tenant has none for it (HTTP 401)%s", where, words), nil)
	case code == http.StatusUnauthorized:
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("%s refused the tenant's credentials (HTTP 401)%s", where, words), nil)
	case code == http.StatusForbidden:
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("%s refused access (HTTP 403)%s", where, words), nil)
	case code == http.StatusNotFound:
		return refuse(v1.ReasonGitAuthFailed, fmt.Sprintf("%s: no such repository, or none the tenant's credentials can see (HTTP 404)%s", where, words), nil)
	case code == http.StatusRequestTimeout, code == http.StatusTooManyRequests, code >= 500:
		return &Error{Message: fmt.Sprintf("%s answered HTTP %d%s", where, code, words), Transient: true}
	case code >= 300 && code < 400:
		return invalid(fmt.Sprintf("%s answered a git request with a redirect it may not follow (HTTP %d)", where, code))
	}
	return invalid(fmt.Sprintf("%s answered HTTP %d%s", where, code, words))
}

// answerWords is what an error message tells of a refusal's body. Git
// servers (git http-backend, GitHub, GitLab, Gitea) word their refusals
// in text/plain, which is echoed; any other answer may come from a
// service that is no git server at all (the host policy names hosts, not
// services), whose body the tenant must not read through the worker:
// only its content type is said.
func answerWords(resp *http.Response) string {
	if mediaType(resp) != "text/plain" {
		return fmt.Sprintf(": an answer of %s, not shown", describeType(resp))
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if len(bytes.TrimSpace(b)) == 0 || bytes.Contains(b, []byte("<")) {
		return ""
	}
	return ": " + serverWords(string(b))
}

// describeType names an answer's content type for a message: its media
// type when it has a valid one, never the header's raw text.
func describeType(resp *http.Response) string {
	raw := resp.Header.Get("Content-Type")
	t, _, err := mime.ParseMediaType(raw)
	switch {
	case raw == "":
		return "no content type"
	case err != nil || !strings.Contains(t, "/"):
		return "an invalid content type"
	}
	return "type " + truncate(t, 100)
}

func mediaType(resp *http.Response) string {
	t, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if err != nil {
		return resp.Header.Get("Content-Type")
	}
	return t
}

// closeBody drains a little of a body, so its connection can be reused,
// and closes it.
func closeBody(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
}
