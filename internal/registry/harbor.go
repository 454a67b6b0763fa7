package registry

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"unicode/utf8"

	"github.com/google/go-containerregistry/pkg/name"
)

const (
	// harborBodyRead bounds how much of an error response is read.
	harborBodyRead = 4 << 10
	// harborBodyShow bounds how much of it ends up in an error message.
	harborBodyShow = 300
)

// EnsureHarborProject creates the Harbor project on registry (host[:port])
// if it does not exist, because Harbor refuses pushes to missing projects
// (and kaniko cannot create them). New projects are private.
//
// It first asks HEAD /api/v2.0/projects?project_name=p (200: exists, done),
// so that credentials without the right to create projects (e.g. a robot
// account of that project) work once the project is there. Otherwise it
// POSTs /api/v2.0/projects with {"project_name": p, "metadata": {"public":
// "false"}}; 201 and 409 (someone else created it first) are success, 401
// and 403 mean the configured credentials cannot create projects. The
// registry's basic credentials come from the docker config; the scheme is
// http for Insecure registries, https otherwise.
func (c *Client) EnsureHarborProject(ctx context.Context, registry, project string) error {
	registry = strings.TrimSpace(registry)
	if _, err := name.NewRegistry(registry, name.StrictValidation); err != nil {
		return fmt.Errorf("registry: harbor: registry %q must be host[:port]: %w", registry, err)
	}
	if err := checkHarborProject(project); err != nil {
		return err
	}
	scheme := "https"
	if c.insecure[strings.ToLower(registry)] {
		scheme = "http"
	}
	endpoint := scheme + "://" + registry + "/api/v2.0/projects"
	h := harborAPI{c: c, registry: registry, client: &http.Client{Transport: c.httpTransport()}}

	status, _, err := h.do(ctx, http.MethodHead, endpoint+"?"+url.Values{"project_name": {project}}.Encode(), nil)
	if err != nil {
		return err
	}
	if status == http.StatusOK {
		return nil
	}
	// 404 is the expected "missing"; for anything else the POST still
	// settles it (409 if it exists) and reports a clearer error.

	body, err := json.Marshal(map[string]any{
		"project_name": project,
		"metadata":     map[string]string{"public": "false"},
	})
	if err != nil {
		return err
	}
	status, excerpt, err := h.do(ctx, http.MethodPost, endpoint, body)
	if err != nil {
		return err
	}
	switch status {
	case http.StatusOK, http.StatusCreated, http.StatusConflict:
		return nil
	case http.StatusUnauthorized, http.StatusForbidden:
		who := "anonymous requests"
		if user, _, ok := h.basic(); ok {
			who = fmt.Sprintf("the credentials for %s (user %q)", registry, user)
		}
		return fmt.Errorf("registry: harbor project %q does not exist on %s and %s cannot create projects: HTTP %d%s",
			project, registry, who, status, excerpt)
	default:
		return fmt.Errorf("registry: harbor: create project %q on %s: HTTP %d%s", project, registry, status, excerpt)
	}
}

// checkHarborProject applies Harbor's project name rule (lower-case
// letters, digits and ._- , at most 255) so that a bad name fails here,
// clearly, instead of as a 400 from Harbor.
func checkHarborProject(p string) error {
	if p == "" || len(p) > 255 {
		return fmt.Errorf("registry: harbor: invalid project name %q: 1 to 255 characters", p)
	}
	for _, r := range p {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("registry: harbor: invalid project name %q: only a-z, 0-9, '.', '_' and '-'", p)
		}
	}
	return nil
}

type harborAPI struct {
	c        *Client
	registry string
	client   *http.Client
}

// basic returns the registry's username and password from the docker
// config; Harbor's API takes basic auth (users and robot accounts).
func (h harborAPI) basic() (string, string, bool) {
	cfg, ok := h.c.creds.lookup(h.registry)
	if !ok || cfg.Username == "" || cfg.Password == "" {
		return "", "", false
	}
	return cfg.Username, cfg.Password, true
}

// do sends one request and returns the status and, for failures, a
// bounded excerpt of the body (": …" or "").
func (h harborAPI) do(ctx context.Context, method, u string, body []byte) (int, string, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return 0, "", fmt.Errorf("registry: harbor: %w", err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", h.c.userAgent)
	if user, pass, ok := h.basic(); ok {
		req.SetBasicAuth(user, pass)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return 0, "", fmt.Errorf("registry: harbor: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, harborBodyRead))
	if err != nil {
		return 0, "", fmt.Errorf("registry: harbor: %s %s: HTTP %d: read body: %w", method, u, resp.StatusCode, err)
	}
	return resp.StatusCode, excerpt(b), nil
}

// excerpt renders a response body for an error message: single line,
// valid UTF-8, bounded.
func excerpt(b []byte) string {
	s := strings.Join(strings.Fields(strings.ToValidUTF8(string(b), "?")), " ")
	if s == "" {
		return ""
	}
	if len(s) > harborBodyShow {
		cut := harborBodyShow
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return ": " + s
}

// httpTransport is Options.Transport or http.DefaultTransport.
func (c *Client) httpTransport() http.RoundTripper {
	if c.transport != nil {
		return c.transport
	}
	return http.DefaultTransport
}
