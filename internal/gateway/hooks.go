package gateway

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"regexp"
	"strings"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
)

// Forges, as request ids and logs name them.
const (
	forgeGitHub = "github"
	forgeGitLab = "gitlab"
)

// hookAnswer is the answer to a webhook.
type hookAnswer struct {
	Message string `json:"message,omitempty"`
	// RequestIDs are the requests the push made, one per matching trigger
	// (stored now, or already by an earlier delivery of the same push).
	RequestIDs []string `json:"requestIds"`
}

var commitRe = regexp.MustCompile(`^([0-9a-f]{40}|[0-9a-f]{64})$`)

// hookTenant returns the tenant of a webhook URL with the forge's secret,
// or answers 404 (the same for an unknown tenant and for a tenant without
// that webhook).
func (s *Server) hookTenant(w http.ResponseWriter, r *http.Request, route string, secret func(*Tenant) []byte) *Tenant {
	name := r.PathValue("tenant")
	t := s.tenants[name]
	if t == nil || secret(t) == nil {
		what := "this tenant"
		if v1.DNSLabelProblem(name) == "" {
			what = "tenant " + name
		}
		s.answer(w, r, route, "", outcomeNotFound, http.StatusNotFound, problem{Error: fmt.Sprintf("no %s webhook is configured for %s", route, what)})
		return nil
	}
	return t
}

// readHook reads a webhook's body, at most MaxWebhookBytes.
func (s *Server) readHook(w http.ResponseWriter, r *http.Request, route, tenant string) ([]byte, bool) {
	if r.ContentLength > s.opts.MaxWebhookBytes {
		// Announced too large: refused unread.
		s.answer(w, r, route, tenant, outcomeTooLarge, http.StatusRequestEntityTooLarge, problem{Error: fmt.Sprintf("the body is larger than %d bytes", s.opts.MaxWebhookBytes)})
		return nil, false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxWebhookBytes))
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		s.answer(w, r, route, tenant, outcomeTooLarge, http.StatusRequestEntityTooLarge, problem{Error: fmt.Sprintf("the body is larger than %d bytes", mbe.Limit)})
		return nil, false
	}
	if err != nil {
		s.answer(w, r, route, tenant, outcomeInvalid, http.StatusBadRequest, problem{Error: "reading the body: " + err.Error()})
		return nil, false
	}
	return body, true
}

// handleGitHub takes a GitHub webhook: X-Hub-Signature-256 (HMAC-SHA256
// of the body with the tenant's secret) is checked in constant time;
// "push" builds, "ping" is answered 200, other events are ignored (202).
//
// Whatever can be refused without the body is refused before it is read:
// an unknown tenant (404), a missing or malformed signature header (401),
// an event that builds nothing (202, its signature unchecked: nothing is
// done for it). Only a push or a ping with a well-formed signature has its
// body read (at most MaxWebhookBytes), to check the signature.
func (s *Server) handleGitHub(w http.ResponseWriter, r *http.Request) {
	t := s.hookTenant(w, r, routeGitHub, func(t *Tenant) []byte { return t.githubSecret })
	if t == nil {
		return
	}
	unauthorized := func(msg string) {
		s.answer(w, r, routeGitHub, t.Name, outcomeUnauthorized, http.StatusUnauthorized, problem{Error: msg})
	}
	header := r.Header.Get("X-Hub-Signature-256")
	if header == "" {
		unauthorized("no X-Hub-Signature-256 header: give the webhook the tenant's secret")
		return
	}
	sig, ok := parseGitHubSignature(header)
	if !ok {
		unauthorized("X-Hub-Signature-256 is malformed (want 64 hex digits after its sha256 prefix), so it does not match the body and the tenant's webhook secret")
		return
	}
	ev := r.Header.Get("X-GitHub-Event")
	if ev != "push" && ev != "ping" {
		s.answer(w, r, routeGitHub, t.Name, outcomeIgnored, http.StatusAccepted,
			hookAnswer{Message: fmt.Sprintf("event %q ignored: only push events build", truncate(ev, 64)), RequestIDs: []string{}})
		return
	}
	body, ok := s.readHook(w, r, routeGitHub, t.Name)
	if !ok {
		return
	}
	if !validGitHubSignature(t.githubSecret, body, sig) {
		unauthorized("X-Hub-Signature-256 does not match the body and the tenant's webhook secret")
		return
	}
	if ev == "ping" {
		s.answer(w, r, routeGitHub, t.Name, outcomeIgnored, http.StatusOK, hookAnswer{Message: "pong: tenant " + t.Name + "'s GitHub webhook works", RequestIDs: []string{}})
		return
	}
	if mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); mt == "application/x-www-form-urlencoded" {
		// The webhook's content type "application/x-www-form-urlencoded":
		// the JSON is the form's payload field (signed as the raw body).
		form, err := url.ParseQuery(string(body))
		if err != nil {
			s.answer(w, r, routeGitHub, t.Name, outcomeInvalid, http.StatusBadRequest, problem{Error: "undecodable form body: " + err.Error()})
			return
		}
		body = []byte(form.Get("payload"))
	}
	var p githubPush
	if err := json.Unmarshal(body, &p); err != nil {
		s.answer(w, r, routeGitHub, t.Name, outcomeInvalid, http.StatusBadRequest, problem{Error: "undecodable push payload: " + err.Error()})
		return
	}
	// The request ids come from the push alone (pushDelivery), never from
	// X-GitHub-Delivery: the signature covers the body only, so anyone
	// holding one signed delivery could set a new header on each replay.
	s.buildPush(w, r, routeGitHub, forgeGitHub, t, p.push())
}

// parseGitHubSignature parses X-Hub-Signature-256, "sha256=<64 hex
// digits>".
func parseGitHubSignature(header string) ([]byte, bool) {
	hexSig, ok := strings.CutPrefix(header, "sha256=")
	if !ok || len(hexSig) != 2*sha256.Size {
		return nil, false
	}
	sig, err := hex.DecodeString(hexSig)
	return sig, err == nil
}

// validGitHubSignature checks sig against HMAC-SHA256(secret, body), in
// constant time.
func validGitHubSignature(secret, body, sig []byte) bool {
	m := hmac.New(sha256.New, secret)
	m.Write(body)
	return hmac.Equal(sig, m.Sum(nil))
}

// githubPush is the part of GitHub's push event payload the gateway reads.
type githubPush struct {
	Ref        string `json:"ref"`
	Before     string `json:"before"`
	After      string `json:"after"`
	Deleted    bool   `json:"deleted"`
	HeadCommit *struct {
		ID string `json:"id"`
	} `json:"head_commit"`
	Repository struct {
		CloneURL string `json:"clone_url"`
		HTMLURL  string `json:"html_url"`
		SSHURL   string `json:"ssh_url"`
		GitURL   string `json:"git_url"`
		URL      string `json:"url"`
	} `json:"repository"`
}

func (p githubPush) push() push {
	commit := p.After
	if p.HeadCommit != nil && p.HeadCommit.ID != "" {
		// An annotated tag's "after" is the tag object; head_commit is
		// the commit it points to.
		commit = p.HeadCommit.ID
	}
	rp := p.Repository
	return push{ref: p.Ref, before: p.Before, after: p.After, commit: commit, deleted: p.Deleted,
		repoURLs: []string{rp.CloneURL, rp.HTMLURL, rp.SSHURL, rp.GitURL, rp.URL}}
}

// handleGitLab takes a GitLab webhook: X-Gitlab-Token is compared with
// the tenant's secret token in constant time; "Push Hook" and "Tag Push
// Hook" build, other events are ignored (202). The token and the event
// are checked before the body is read: a request without the token has
// none of its body read.
func (s *Server) handleGitLab(w http.ResponseWriter, r *http.Request) {
	t := s.hookTenant(w, r, routeGitLab, func(t *Tenant) []byte { return t.gitlabToken })
	if t == nil {
		return
	}
	token := r.Header.Get("X-Gitlab-Token")
	if token == "" {
		s.answer(w, r, routeGitLab, t.Name, outcomeUnauthorized, http.StatusUnauthorized, problem{Error: "no X-Gitlab-Token header: give the webhook the tenant's secret token"})
		return
	}
	// Hashes of equal length: the comparison's time says nothing about
	// the token's length or content.
	got, want := sha256.Sum256([]byte(token)), sha256.Sum256(t.gitlabToken)
	if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
		s.answer(w, r, routeGitLab, t.Name, outcomeUnauthorized, http.StatusUnauthorized, problem{Error: "X-Gitlab-Token is not the tenant's webhook secret token"})
		return
	}
	switch ev := r.Header.Get("X-Gitlab-Event"); ev {
	case "Push Hook", "Tag Push Hook":
	default:
		s.answer(w, r, routeGitLab, t.Name, outcomeIgnored, http.StatusAccepted,
			hookAnswer{Message: fmt.Sprintf("event %q ignored: only Push Hook and Tag Push Hook build", truncate(ev, 64)), RequestIDs: []string{}})
		return
	}
	body, ok := s.readHook(w, r, routeGitLab, t.Name)
	if !ok {
		return
	}
	var p gitlabPush
	if err := json.Unmarshal(body, &p); err != nil {
		s.answer(w, r, routeGitLab, t.Name, outcomeInvalid, http.StatusBadRequest, problem{Error: "undecodable push payload: " + err.Error()})
		return
	}
	// The request ids come from the push alone (pushDelivery), never from
	// Idempotency-Key or X-Gitlab-Event-UUID: the token authenticates the
	// sender, not the body, so a replayed body with a fresh header would
	// otherwise be a new build.
	s.buildPush(w, r, routeGitLab, forgeGitLab, t, p.push())
}

// gitlabPush is the part of GitLab's push and tag push payloads the
// gateway reads.
type gitlabPush struct {
	Ref         string  `json:"ref"`
	Before      string  `json:"before"`
	After       string  `json:"after"`
	CheckoutSHA *string `json:"checkout_sha"`
	Project     struct {
		GitHTTPURL string `json:"git_http_url"`
		GitSSHURL  string `json:"git_ssh_url"`
		WebURL     string `json:"web_url"`
		HTTPURL    string `json:"http_url"`
		SSHURL     string `json:"ssh_url"`
	} `json:"project"`
	Repository struct {
		GitHTTPURL string `json:"git_http_url"`
		GitSSHURL  string `json:"git_ssh_url"`
		Homepage   string `json:"homepage"`
		URL        string `json:"url"`
	} `json:"repository"`
}

func (p gitlabPush) push() push {
	commit := p.After
	if p.CheckoutSHA != nil && *p.CheckoutSHA != "" {
		// A tag push's checkout_sha is the commit, "after" may be an
		// annotated tag object.
		commit = *p.CheckoutSHA
	}
	pr, rp := p.Project, p.Repository
	return push{ref: p.Ref, before: p.Before, after: p.After, commit: commit, deleted: zeroCommit(p.After),
		repoURLs: []string{pr.GitHTTPURL, pr.GitSSHURL, pr.WebURL, pr.HTTPURL, pr.SSHURL, rp.GitHTTPURL, rp.GitSSHURL, rp.Homepage, rp.URL}}
}

// buildPush publishes one request per trigger of t that the push matches,
// with the pushed ref and commit, and answers 202 with their ids. The ids
// are derived from the push itself (pushDelivery) and the trigger, so
// every delivery of one push, whatever its headers, is the same requests.
func (s *Server) buildPush(w http.ResponseWriter, r *http.Request, route, forge string, t *Tenant, p push) {
	invalid := func(msg string) {
		s.answer(w, r, route, t.Name, outcomeInvalid, http.StatusBadRequest, problem{Error: msg})
	}
	ignored := func(msg string) {
		s.answer(w, r, route, t.Name, outcomeIgnored, http.StatusAccepted, hookAnswer{Message: msg, RequestIDs: []string{}})
	}
	switch {
	case p.ref == "":
		invalid("the push payload names no ref")
		return
	case v1.GitRefProblem(p.ref) != "":
		invalid("the pushed ref " + v1.GitRefProblem(p.ref))
		return
	case p.deleted || zeroCommit(p.after):
		ignored(fmt.Sprintf("%s was deleted: nothing to build", p.ref))
		return
	case !commitRe.MatchString(p.commit):
		invalid(fmt.Sprintf("the pushed commit %q is not a full commit hash", truncate(p.commit, 80)))
		return
	}
	pushID := pushDelivery(p)
	ids := []string{}
	for i, tr := range t.Triggers {
		if !t.matches(i, p) {
			continue
		}
		req := tr.request(t.Name, hookRequestID(forge, t.Name, pushID, tr), p.ref, p.commit)
		req.SubmittedAt = s.opts.Now().UTC()
		if err := req.Validate(); err != nil {
			s.answer(w, r, route, t.Name, outcomeInvalid, http.StatusUnprocessableEntity, problem{Error: err.Error()})
			return
		}
		dup, err := s.publishRequest(r.Context(), req)
		if err != nil {
			// The requests published so far are stored; the forge's
			// retry publishes them again as duplicates.
			s.publishFailure(w, r, route, t.Name, err, zap.Strings("requestIds", ids))
			return
		}
		s.log.Info("push build requested", zap.String("route", route), zap.String("tenant", t.Name), zap.String("requestId", req.RequestID),
			zap.String("name", req.Name), zap.String("ref", p.ref), zap.String("commit", p.commit), zap.Bool("duplicate", dup))
		ids = append(ids, req.RequestID)
	}
	if len(ids) == 0 {
		repo := ""
		for _, u := range p.repoURLs {
			if repo = normalizeRepo(u); repo != "" {
				break
			}
		}
		ignored(fmt.Sprintf("no trigger of tenant %s builds %s of %s", t.Name, p.ref, truncate(repo, 200)))
		return
	}
	s.answer(w, r, route, t.Name, outcomeAccepted, http.StatusAccepted,
		hookAnswer{Message: fmt.Sprintf("%d build(s) requested", len(ids)), RequestIDs: ids}, zap.Strings("requestIds", ids))
}
