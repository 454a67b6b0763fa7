package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/gateway"
	"github.com/buildq/buildq/internal/testnats"
)

func TestGatewayHelp(t *testing.T) {
	t.Parallel()
	code, out, errOut := cli(t, "gateway", "--help")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"POST /hooks/github/<tenant>", "POST /hooks/gitlab/<tenant>", gateway.RequestedType,
		"--config", "--addr", "--tls-client-ca", "--metrics-addr", "--nats-url", "--max-event-bytes"} {
		if !strings.Contains(out, want) {
			t.Errorf("buildq gateway --help does not mention %q", want)
		}
	}
	code, out, _ = cli(t, "--help")
	if code != exitOK || !regexp.MustCompile(`(?m)^\s+gateway\s`).MatchString(out) {
		t.Errorf("buildq --help does not list gateway (exit %d)", code)
	}
}

// Every configuration problem stops the gateway before it serves, exit 2,
// with the file's places named and no secret shown.
func TestGatewayConfigErrorsExit2(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("hook", "the-hook-secret-value\n")
	write("key", strings.Repeat("k", 32))
	write("pw", "the-nats-password\n")
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"no config", nil, []string{"--config is required"}},
		{"missing file", []string{"--config", filepath.Join(dir, "nope.yaml")}, []string{"no such file"}},
		{"invalid file", []string{"--config", write("bad.yaml", `
tenants:
  - name: Bad_Name
    webhooks: {github: {secretFile: hook}}
    triggers: [{repository: "git@github.com:acme/web.git", name: web}]
`)}, []string{"tenants[0].name", "tenants[0].triggers[0].repository"}},
		{"not for production", []string{"--config", write("dev.yaml", "tenants: [{name: acme}]\n")},
			[]string{"msgIdKeyFile: is required", "tenant acme: nats: give its own NATS identity", "tenant acme: no way in"}},
		{"client certificates without a CA", []string{"--config", write("certs.yaml", `
msgIdKeyFile: key
tenants:
  - name: acme
    auth: {clientCertSubjects: ["CN=ci"]}
    nats: {user: acme, passwordFile: pw}
`)}, []string{"--tls-client-ca"}},
		{"half a TLS pair", []string{"--config", "x.yaml", "--tls-cert", "c.pem"}, []string{"--tls-cert and --tls-key go together"}},
		{"a bad log level", []string{"--config", "x.yaml", "--log-level", "loud"}, []string{"--log-level"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, errOut := cli(t, append([]string{"gateway"}, tc.args...)...)
			if code != exitInvalid {
				t.Fatalf("exit %d, want %d: %s", code, exitInvalid, errOut)
			}
			for _, w := range tc.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr does not say %q:\n%s", w, errOut)
				}
			}
			for _, secret := range []string{"the-hook-secret-value", "the-nats-password"} {
				if strings.Contains(errOut, secret) {
					t.Errorf("stderr holds a secret:\n%s", errOut)
				}
			}
		})
	}
}

// `buildq gateway` for real: it connects as the tenant's own NATS user
// (user and password file), takes a CloudEvent with the tenant's token and
// stores it; SIGTERM (the context's end) drains and exits 0.
func TestGatewayCommandServes(t *testing.T) {
	t.Parallel()
	perms := &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: []string{v1.RequestSubject("acme")}},
		Subscribe: &server.SubjectPermission{Allow: []string{v1.InboxPrefix("acme") + ".>"}},
	}
	ns := testnats.Start(t, testnats.Config{Configure: func(o *server.Options) {
		o.Users = []*server.User{{Username: "admin", Password: "admin-pw"}, {Username: "acme-gw", Password: "acme-pw", Permissions: perms}}
	}})
	js, err := jetstream.New(ns.Connect(t, nats.UserInfo("admin", "admin-pw")))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: v1.RequestsStream, Subjects: []string{v1.RequestsPrefix + ".>"},
		Retention: jetstream.WorkQueuePolicy, Duplicates: 10 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	token := "acme-token"
	sum := sha256.Sum256([]byte(token))
	for name, content := range map[string]string{
		"key": strings.Repeat("z", 32), "pw": "acme-pw\n",
		"gateway.yaml": fmt.Sprintf("msgIdKeyFile: key\ntenants:\n  - name: acme\n    auth: {tokenSHA256: [%s]}\n    nats: {user: acme-gw, passwordFile: pw}\n", hex.EncodeToString(sum[:])),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	addr, metrics := freeAddr(t), freeAddr(t)
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		done <- run(runCtx, []string{"gateway", "--config", filepath.Join(dir, "gateway.yaml"), "--addr", addr, "--metrics-addr", metrics,
			"--nats-url", ns.URL(), "--log-level", "warn"}, io.Discard, &stderr)
	}()
	waitHTTP(t, "http://"+metrics+"/readyz", done)

	body, _ := json.Marshal(map[string]any{"name": "web", "source": map[string]any{"git": map[string]any{"url": "https://github.com/acme/web", "ref": "main"}}})
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/", bytes.NewReader(body))
	for k, v := range map[string]string{"Ce-Specversion": "1.0", "Ce-Type": gateway.RequestedType, "Ce-Source": "/t", "Ce-Id": "1",
		"Content-Type": "application/json", "Authorization": "Bearer " + token} {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("answer %d %s", resp.StatusCode, b)
	}
	st, err := js.Stream(ctx, v1.RequestsStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx, v1.RequestSubject("acme"))
	if err != nil {
		t.Fatal(err)
	}
	want := gateway.EventRequestID("acme", "/t", "1")
	if !v1.MsgIDMatches(m.Header.Get(v1.MsgIDHeader), "acme", want) {
		t.Errorf("stored with Nats-Msg-Id %q, want one of %s's", m.Header.Get(v1.MsgIDHeader), want)
	}
	// The metrics address serves the operations routes only.
	if r, err := http.Post("http://"+metrics+"/", "application/json", bytes.NewReader(body)); err == nil {
		r.Body.Close()
		if r.StatusCode == http.StatusAccepted {
			t.Error("--metrics-addr takes events")
		}
	}
	mr, err := http.Get("http://" + metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(mr.Body)
	mr.Body.Close()
	if !strings.Contains(string(mb), `buildq_gateway_requests_total{outcome="accepted",route="cloudevents",tenant="acme"} 1`) {
		t.Errorf("metrics lack the accepted request:\n%s", mb)
	}

	// Shutdown drains: a request whose handler is reading its body when
	// the context ends (SIGTERM) still gets its 202. "Expect:
	// 100-continue" shows when the handler has started reading.
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	inflight, _ := json.Marshal(map[string]any{"name": "web", "source": map[string]any{"git": map[string]any{"url": "https://github.com/acme/web", "ref": "main"}}})
	fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: %s\r\nCe-Specversion: 1.0\r\nCe-Type: %s\r\nCe-Source: /t\r\nCe-Id: in-flight\r\n"+
		"Content-Type: application/json\r\nAuthorization: Bearer %s\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n",
		addr, gateway.RequestedType, token, len(inflight))
	br := bufio.NewReader(conn)
	if line, err := br.ReadString('\n'); err != nil || !strings.Contains(line, "100 Continue") {
		t.Fatalf("no 100 Continue: %q %v", line, err)
	}
	if _, err := br.ReadString('\n'); err != nil { // the blank line after 100 Continue
		t.Fatal(err)
	}
	stop()
	// The listener closes: shutdown has begun while the request is open.
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("the gateway still accepts connections after the context ended")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, with a deadline
	}
	select {
	case code := <-done:
		t.Fatalf("exited %d with a request in flight", code)
	default:
	}
	if _, err := conn.Write(inflight); err != nil {
		t.Fatal(err)
	}
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("the request in flight got no answer: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("the request in flight: %d", resp.StatusCode)
	}
	select {
	case code := <-done:
		if code != exitOK {
			t.Fatalf("exit %d after the context ended: %s", code, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("buildq gateway did not stop")
	}
	if n, err := st.Info(ctx); err != nil || n.State.Msgs != 2 {
		t.Fatalf("stream holds %v messages (%v), want 2", n, err)
	}
}

// waitHTTP waits until url answers 200, or fails when the command exits.
func waitHTTP(t *testing.T, url string, exited <-chan int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case code := <-exited:
			t.Fatalf("the command exited %d before %s answered", code, url)
		default:
		}
		if r, err := http.Get(url); err == nil {
			r.Body.Close()
			if r.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not answer 200 in 30s", url)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition, with a deadline
	}
}

var gatewayRe = regexp.MustCompile(`registry=\S+\s+gateway=(http://\S+)\s`)

// buildq dev serves the gateway on --gateway-addr, named in its ready
// line, and takes CloudEvents there without credentials; it refuses a
// non-loopback address.
func TestGatewayInDev(t *testing.T) {
	t.Parallel()
	if code, _, errOut := cli(t, "dev", "--gateway-addr", "0.0.0.0:8088"); code != exitInvalid || !strings.Contains(errOut, "loopback") {
		t.Fatalf("dev --gateway-addr 0.0.0.0:8088: exit %d: %s", code, errOut)
	}
	data := t.TempDir() // before the cleanup that stops dev: removed after it
	// --gateway-config: a tenant's webhook and trigger (dev needs no NATS
	// identity or msgIdKeyFile: it publishes over its own NATS).
	if err := os.WriteFile(filepath.Join(data, "hook"), []byte("dev-hook-secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(data, "gateway.yaml")
	if err := os.WriteFile(config, []byte(`tenants:
  - name: acme
    webhooks: {github: {secretFile: hook}}
    triggers: [{repository: "https://github.com/acme/web", name: web}]
`), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		code := run(ctx, []string{"dev", "--data", data, "--nats-addr", "127.0.0.1:0", "--s3-addr", "127.0.0.1:0",
			"--registry-addr", "127.0.0.1:0", "--gateway-addr", "127.0.0.1:0", "--gateway-config", config, "--log-level", "warn"}, io.Discard, pw)
		pw.Close()
		done <- code
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-done:
			if code != exitOK {
				t.Errorf("buildq dev exited %d", code)
			}
		case <-time.After(30 * time.Second):
			t.Error("buildq dev did not stop")
		}
	})
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "buildq dev ready") {
				lines <- sc.Text()
			}
		}
		close(lines)
	}()
	var url string
	select {
	case l, ok := <-lines:
		m := gatewayRe.FindStringSubmatch(l)
		if !ok || m == nil {
			t.Fatalf("the ready line names no gateway: %q", l)
		}
		url = m[1]
	case <-time.After(60 * time.Second):
		t.Fatal("buildq dev not ready in 60s")
	}
	waitHTTP(t, url+"/readyz", nil)
	body, _ := json.Marshal(map[string]any{"tenant": "devtenant", "name": "web",
		"source": map[string]any{"git": map[string]any{"url": "https://github.com/acme/web", "ref": "main"}}})
	req, _ := http.NewRequest(http.MethodPost, url+"/", bytes.NewReader(body))
	for k, v := range map[string]string{"Ce-Specversion": "1.0", "Ce-Type": gateway.RequestedType, "Ce-Source": "/dev", "Ce-Id": "1", "Content-Type": "application/json"} {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var a struct {
		RequestID string `json:"requestId"`
		Tenant    string `json:"tenant"`
	}
	if resp.StatusCode != http.StatusAccepted || json.Unmarshal(b, &a) != nil || a.Tenant != "devtenant" || a.RequestID != gateway.EventRequestID("devtenant", "/dev", "1") {
		t.Fatalf("answer %d %s", resp.StatusCode, b)
	}

	// The configured tenant's GitHub webhook.
	push := []byte(`{"ref":"refs/heads/main","before":"85a5d3681c47658c4e0a667472a17a754c22055d","after":"9e597618cb9102c993b3245f4e7c0843131ce335",` +
		`"deleted":false,"head_commit":{"id":"9e597618cb9102c993b3245f4e7c0843131ce335"},"repository":{"full_name":"acme/web","clone_url":"https://github.com/acme/web.git"}}`)
	mac := hmac.New(sha256.New, []byte("dev-hook-secret"))
	mac.Write(push)
	req, _ = http.NewRequest(http.MethodPost, url+"/hooks/github/acme", bytes.NewReader(push))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-GitHub-Event", "push")
	req.Header.Set("X-GitHub-Delivery", "dev-delivery-1")
	req.Header.Set("X-Hub-Signature-256", "sha256="+hex.EncodeToString(mac.Sum(nil)))
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	var h struct {
		RequestIDs []string `json:"requestIds"`
	}
	if resp.StatusCode != http.StatusAccepted || json.Unmarshal(b, &h) != nil || len(h.RequestIDs) != 1 {
		t.Fatalf("dev's GitHub webhook: %d %s", resp.StatusCode, b)
	}
}

// dev's default gateway address taken (another buildq dev): dev goes on
// without a gateway; an address given explicitly must be free.
func TestGatewayDevAddressInUse(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ns := testnats.Start(t, testnats.Config{})
	g := &devGateway{addr: ln.Addr().String(), optional: true}
	url, stop, err := g.start(ns.URL(), zap.NewNop())
	if err != nil || url != "" {
		t.Fatalf("the default address in use: url %q, %v; want no gateway and no error", url, err)
	}
	stop()
	g.optional = false
	if _, _, err := g.start(ns.URL(), zap.NewNop()); err == nil {
		t.Fatal("an explicit address in use was accepted")
	}
	free := &devGateway{addr: freeAddr(t)}
	url, stop, err = free.start(ns.URL(), zap.NewNop())
	if err != nil || url != "http://"+free.addr {
		t.Fatalf("a free address: %q, %v", url, err)
	}
	stop()
}
