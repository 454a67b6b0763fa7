package gitsource

import (
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

func TestSpecialAddressesAreRefusedByDefault(t *testing.T) {
	t.Parallel()
	for addr, kind := range map[string]string{
		"127.0.0.1": "loopback", "::1": "loopback", "127.9.9.9": "loopback",
		"10.1.2.3": "private", "172.16.0.1": "private", "192.168.1.1": "private", "fc00::1": "private",
		"fd00:ec2::254":   "private", // AWS metadata, IPv6
		"169.254.169.254": "link-local", "fe80::1": "link-local",
		"::ffff:169.254.169.254": "link-local", // IPv4-mapped
		"0.0.0.0":                "unspecified", "::": "unspecified",
		"224.0.0.1": "multicast", "ff02::1": "multicast",
		"100.100.100.200":    "reserved", // CGNAT (a cloud metadata address)
		"64:ff9b::a9fe:a9fe": "reserved", // NAT64 of 169.254.169.254
		"8.8.8.8":            "", "2606:4700::1111": "", "140.82.121.3": "",
	} {
		if got := specialKind(netip.MustParseAddr(addr)); got != kind {
			t.Errorf("specialKind(%s) = %q, want %q", addr, got, kind)
		}
	}
}

func TestPolicy_HostsAndAddresses(t *testing.T) {
	t.Parallel()
	p, err := compilePolicy(Policy{
		AllowedHosts:  []string{"git.example.com", "*.corp.example", "10.0.0.0/8", "192.168.1.5", "GitLab.Example.org."},
		InsecureHosts: []string{"*.corp.example"},
	})
	if err != nil {
		t.Fatal(err)
	}
	for host, ok := range map[string]bool{
		"git.example.com": true, "GIT.example.com": true, "evil.git.example.com": false, "example.com": false,
		"a.corp.example": true, "a.b.corp.example": true, "corp.example": false, "xcorp.example": false,
		"10.9.8.7": true, "11.0.0.1": false, "192.168.1.5": true, "192.168.1.6": false,
		"gitlab.example.org": true, "[::1]": false,
	} {
		u := &url.URL{Scheme: "https", Host: host}
		if got := p.checkURL(u) == nil; got != ok {
			t.Errorf("host %q allowed = %v, want %v", host, got, ok)
		}
	}
	if p.checkURL(&url.URL{Scheme: "http", Host: "git.example.com"}) == nil {
		t.Error("plain http to a host not insecure was allowed")
	}
	if p.checkURL(&url.URL{Scheme: "http", Host: "a.corp.example"}) != nil {
		t.Error("plain http to an insecure host was refused")
	}
	// Private addresses: only inside an IP/CIDR entry, or with AllowPrivate.
	for addr, refused := range map[string]bool{"10.1.1.1": false, "192.168.1.5": false, "192.168.1.6": true, "127.0.0.1": true, "8.8.8.8": false} {
		if got := p.refusedAddr(netip.MustParseAddr(addr)) != ""; got != refused {
			t.Errorf("address %s refused = %v, want %v", addr, got, refused)
		}
	}
	p.allowPrivate = true
	if p.refusedAddr(netip.MustParseAddr("169.254.169.254")) != "" {
		t.Error("AllowPrivate did not allow a link-local address")
	}
	for _, bad := range []string{"git example.com", "*.", "10.0.0.0/33", "http://x", "*foo.com"} {
		if err := (Policy{AllowedHosts: []string{bad}}).Validate(); err == nil {
			t.Errorf("Validate accepted %q", bad)
		}
	}
}

func TestFetch_HostPolicy(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"Dockerfile": reg("FROM scratch\n")})
	srv, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	u, _ := url.Parse(base + "/r.git")
	src := Source{URL: u.String(), Ref: "main"}
	byName := Source{URL: "http://localhost:" + u.Port() + "/r.git", Ref: "main"}

	for _, tc := range []struct {
		name   string
		policy Policy
		src    Source
		says   []string
	}{
		{"host not allowed", Policy{AllowedHosts: []string{"git.example.com"}, InsecureHosts: []string{"*"}}, src,
			[]string{`"127.0.0.1"`, "--allowed-git-host"}},
		{"git sources disabled", Policy{}, src, []string{"git sources are not enabled on this worker: --allowed-git-host is empty"}},
		{"loopback behind any host", Policy{AllowedHosts: []string{"*"}, InsecureHosts: []string{"*"}}, src,
			[]string{"127.0.0.1", "loopback"}},
		{"a name resolving to loopback", Policy{AllowedHosts: []string{"localhost"}, InsecureHosts: []string{"localhost"}}, byName,
			[]string{`"localhost"`, "loopback"}},
		{"plain http to a host not insecure", Policy{AllowedHosts: []string{"127.0.0.1"}}, src,
			[]string{"plain http://", "--insecure-git-host"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := srv.requestCount()
			fr := newFetcher(t)
			fr.Policy = tc.policy
			e := fetchErr(t, fr, tc.src, v1.ReasonGitHostRefused)
			mustContain(t, e.Message, tc.says...)
			if got := srv.requestCount(); got != n {
				t.Errorf("the server got %d requests from a refused fetch", got-n)
			}
		})
	}
	t.Run("AllowPrivate lets any allowed host be local", func(t *testing.T) {
		fr := newFetcher(t)
		fr.Policy = Policy{AllowedHosts: []string{"*"}, InsecureHosts: []string{"*"}, AllowPrivate: true}
		fetchOK(t, fr, src)
		fetchOK(t, fr, byName)
	})
}

// redirector answers every request with a redirect to target+path.
func redirector(t *testing.T, target string, seen *[]string, mu *sync.Mutex) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		*seen = append(*seen, r.Header.Get("Authorization"))
		mu.Unlock()
		http.Redirect(w, r, target+r.URL.RequestURI(), http.StatusFound)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestFetch_RedirectToMetadataIsRefusedBeforeConnecting(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen []string
	base := redirector(t, "http://169.254.169.254/latest/meta-data", &seen, &mu)

	// "*" lets the host name through; the address is refused in the
	// dialer's control hook, which runs before connect(2).
	fr := newFetcher(t)
	fr.Policy = Policy{AllowedHosts: []string{"127.0.0.1", "*"}, InsecureHosts: []string{"*"}}
	e := fetchErr(t, fr, Source{URL: base + "/r.git", Ref: "main"}, v1.ReasonGitHostRefused)
	mustContain(t, e.Message, "169.254.169.254", "link-local")
	var refused *addrRefused
	if !errors.As(e, &refused) || refused.addr != netip.MustParseAddr("169.254.169.254") {
		t.Errorf("refusal %v did not come from the dial hook", e)
	}

	// Without "*", the redirect's host is refused before any dial.
	fr.Policy = Policy{AllowedHosts: []string{"127.0.0.1"}, InsecureHosts: []string{"127.0.0.1"}}
	e = fetchErr(t, fr, Source{URL: base + "/r.git", Ref: "main"}, v1.ReasonGitHostRefused)
	mustContain(t, e.Message, `"169.254.169.254"`, "--allowed-git-host")
}

func TestFetch_RedirectsKeepCredentialsAtHome(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"Dockerfile": reg("FROM scratch\n")})
	var mu sync.Mutex
	var atTarget []string
	git := newGitServer(t, serverOpts{})
	git.repos["/r.git"] = repo
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		atTarget = append(atTarget, r.Header.Get("Authorization"))
		mu.Unlock()
		git.ServeHTTP(w, r)
	}))
	t.Cleanup(target.Close)
	var atOrigin []string
	origin := redirector(t, target.URL, &atOrigin, &mu)

	fr := newFetcher(t)
	fr.Credentials = creds(&Credentials{Password: "origin-only-token"})
	c := fetchOK(t, fr, Source{URL: origin + "/r.git", Ref: "main"})
	if c.URL != origin+"/r.git" {
		t.Errorf("Context.URL = %q, want the source's URL", c.URL)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(atOrigin) != 1 || atOrigin[0] == "" {
		t.Errorf("the origin got Authorization %q, want the tenant's credentials once", atOrigin)
	}
	if len(atTarget) < 2 || strings.Join(atTarget, "") != "" {
		t.Errorf("the redirect target (another origin) got Authorization %q, want none on each request", atTarget)
	}
}

func TestFetch_PoliciesOfTwoFetchersStayApart(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	repo.commitFiles("main", map[string]f{"Dockerfile": reg("FROM scratch\n")})
	_, base := serve(t, serverOpts{}, map[string]*testRepo{"r": repo})
	src := Source{URL: base + "/r.git", Ref: "main"}
	open := newFetcher(t)
	strict := newFetcher(t)
	strict.Policy = Policy{AllowedHosts: []string{"*"}, InsecureHosts: []string{"*"}} // no private addresses

	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for range 10 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			c, err := open.Fetch(t.Context(), "tenant", src, nil)
			if err != nil {
				errs <- err
				return
			}
			_ = c.Remove()
		}()
		go func() {
			defer wg.Done()
			var e *Error
			if _, err := strict.Fetch(t.Context(), "tenant", src, nil); !errors.As(err, &e) || e.Reason != v1.ReasonGitHostRefused {
				errs <- errors.New("the strict fetcher was not refused: " + errString(err))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

func TestFetch_HTTPS(t *testing.T) {
	t.Parallel()
	repo := newRepo(t)
	files := map[string]f{"Dockerfile": reg("FROM scratch\n")}
	repo.commitFiles("main", files)
	git := newGitServer(t, serverOpts{})
	git.repos["/r.git"] = repo
	srv := httptest.NewUnstartedServer(git)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshake the test fails on purpose
	srv.StartTLS()
	t.Cleanup(srv.Close)
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())

	fr := newFetcher(t)
	fr.Policy.InsecureHosts = nil
	fr.RootCAs = pool
	if c := fetchOK(t, fr, Source{URL: srv.URL + "/r.git", Ref: "main"}); c.Digest != uploadDigest(t, files, "") {
		t.Errorf("digest %s", c.Digest)
	}
	// Without the server's CA the TLS handshake fails: trouble, not the request's fault.
	fr.RootCAs = nil
	_ = fetchErr(t, fr, Source{URL: srv.URL + "/r.git", Ref: "main"}, "")

	// A redirect from https down to http is refused, credentials or not.
	var mu sync.Mutex
	var seen []string
	down := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.URL.Path)
		mu.Unlock()
		http.Redirect(w, r, "http://127.0.0.1:1"+r.URL.RequestURI(), http.StatusFound)
	}))
	t.Cleanup(down.Close)
	pool.AddCert(down.Certificate())
	fr.RootCAs = pool
	fr.Policy.InsecureHosts = []string{"127.0.0.1"}
	e := fetchErr(t, fr, Source{URL: down.URL + "/r.git", Ref: "main"}, v1.ReasonGitHostRefused)
	mustContain(t, e.Message, "from https to http")
}

func TestFetch_NetworkTroubleIsTransient(t *testing.T) {
	t.Parallel()
	unavailable := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "try later", http.StatusServiceUnavailable)
	}))
	t.Cleanup(unavailable.Close)
	e := fetchErr(t, newFetcher(t), Source{URL: unavailable.URL + "/r.git", Ref: "main"}, "")
	mustContain(t, e.Message, "503")

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	_ = ln.Close()
	e = fetchErr(t, newFetcher(t), Source{URL: "http://" + closed + "/r.git", Ref: "main"}, "")
	mustContain(t, e.Message, "connection refused")
}
