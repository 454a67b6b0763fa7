//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/publisher"
)

// natsProxy puts a TCP proxy (apiProxy's) in front of the suite's NATS
// for one client: cut keeps that client away while the server and the
// workers go on, so results are stored while it is disconnected.
func natsProxy(t *testing.T, s *suite) (*apiProxy, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &apiProxy{ln: ln, target: s.natsAddr, conns: map[net.Conn]struct{}{}}
	go p.serve()
	t.Cleanup(func() { ln.Close(); p.cut() })
	return p, "nats://" + ln.Addr().String()
}

// watchProc is a running `buildq watch`.
type watchProc struct {
	stdout, stderr *lockedBuffer
	stop           func()
}

func startWatch(t *testing.T, args ...string) *watchProc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, filepath.Join(shared.bin, "buildq"), append([]string{"watch"}, args...)...)
	w := &watchProc{stdout: &lockedBuffer{}, stderr: &lockedBuffer{}}
	cmd.Stdout, cmd.Stderr = w.stdout, w.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	w.stop = func() { cancel(); <-done }
	t.Cleanup(w.stop)
	return w
}

// printed counts each request id among the JSON lines the watch printed
// (each line one result's data, as submit -o json prints it).
func (w *watchProc) printed(t *testing.T) map[string]int {
	t.Helper()
	n := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(w.stdout.String()), "\n") {
		if line == "" {
			continue
		}
		var d v1.ResultData
		if err := json.Unmarshal([]byte(line), &d); err != nil || d.RequestID == "" {
			t.Fatalf("watch -o json printed %q: not a result's data (%v)", line, err)
		}
		n[d.RequestID]++
	}
	return n
}

// Issue 28, finding 4: `buildq watch` as a tenant (core subscription, no
// JetStream) misses nothing across a NATS restart. A build finishes while
// NATS is down (its result is published once the server is back), another
// is answered after the restart while the watch is still disconnected (a
// proxy keeps it away), and a third after it is back: the watch prints
// each exactly once, the first two fetched from its stored-results
// service, and says on stderr that it replayed them.
func TestWatchResumesAcrossNATSRestart(t *testing.T) {
	const held = "wr-held"
	h := newHolds(t, held)
	e := tenantNATSEnv(t, h.fault)
	s := e.s
	s.startWorker("w1")
	res := s.collect()
	jobs := s.jobsCreated()
	proxy, url := natsProxy(t, s)
	w := startWatch(t, append([]string{"--tenant", "acme", "-o", "json", "--nats-url", url}, e.cli("acme")...)...)

	first := s.submit(contextDir(t, file("watch before "+s.ns)), "wr-before", 1)
	eventually(t, 2*time.Minute, "the watch to print the first result", func() bool { return w.printed(t)[first[0].RequestID] == 1 })

	heldReq := s.submit(contextDir(t, file("watch held "+s.ns)), held, 1)
	eventually(t, time.Minute, "the held build's Job", func() bool { return jobs() >= 2 })

	s.killNATS()
	proxy.cut()
	h.release(held)
	eventually(t, time.Minute, "the held build to finish while NATS is down", func() bool { return s.jobFinished(held) })
	s.startNATS()
	gap := s.submit(contextDir(t, file("watch gap "+s.ns)), "wr-gap", 1)
	s.answeredOnce(res, []string{heldReq[0].RequestID, gap[0].RequestID}, 3*time.Minute)
	if n := w.printed(t); n[heldReq[0].RequestID]+n[gap[0].RequestID] != 0 {
		t.Fatalf("the watch printed results while it was cut off: %v", n)
	}

	proxy.restore()
	eventually(t, 2*time.Minute, "the watch to print the results it missed", func() bool {
		n := w.printed(t)
		return n[heldReq[0].RequestID] > 0 && n[gap[0].RequestID] > 0
	})
	after := s.submit(contextDir(t, file("watch after "+s.ns)), "wr-after", 1)
	eventually(t, 2*time.Minute, "the watch to print a result after the restart", func() bool { return w.printed(t)[after[0].RequestID] > 0 })
	// Anything printed twice would be printed by now.
	time.Sleep(time.Second)
	n := w.printed(t)
	for _, id := range []string{first[0].RequestID, heldReq[0].RequestID, gap[0].RequestID, after[0].RequestID} {
		if n[id] != 1 {
			t.Errorf("request %s printed %d times; printed: %v", id, n[id], n)
		}
	}
	if len(n) != 4 {
		t.Errorf("the watch printed %d results, want 4: %v", len(n), n)
	}
	if errOut := w.stderr.String(); !strings.Contains(errOut, "reconnected; 2 result(s) published while disconnected printed") {
		t.Errorf("the watch did not say it replayed the gap; stderr:\n%s", errOut)
	}
}

// Invariant 8 for the stored-results service: tenant B (globex) cannot
// fetch tenant A's (acme's) results through it — not on A's subject (the
// server refuses it), not through its own with any body, not with a reply
// subject of A's, not by watching A — while A fetches its own.
func TestWatchStoredResultsTenantIsolation(t *testing.T) {
	e := tenantNATSEnv(t, nil)
	s := e.s
	s.startWorker("w1")
	res := s.collect()
	reqs := s.submit(contextDir(t, file("isolation "+s.ns)), "iso", 1)
	s.answeredOnce(res, ids(reqs), 3*time.Minute)
	id := reqs[0].RequestID
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	a := e.connect(t, "acme")
	b := e.connect(t, "globex")
	apub, err := publisher.New(a.nc)
	if err != nil {
		t.Fatal(err)
	}
	bpub, err := publisher.New(b.nc)
	if err != nil {
		t.Fatal(err)
	}
	hasA := func(rep *v1.ResultsReply) bool {
		for _, r := range rep.Results {
			if strings.Contains(string(r.Event), id) || strings.Contains(string(r.Event), `"tenant":"acme"`) {
				return true
			}
		}
		return false
	}

	t.Run("A fetches its own stored result", func(t *testing.T) {
		rep, err := apub.StoredResults(ctx, "acme", v1.ResultsRequest{})
		if err != nil || !hasA(rep) {
			t.Fatalf("acme's stored results: %v %+v", err, rep)
		}
	})
	t.Run("B on A's subject is refused by the server", func(t *testing.T) {
		b.requestRefused(t, v1.APIResultsSubject("acme"), `{}`)
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		defer rcancel()
		if _, err := bpub.StoredResults(rctx, "acme", v1.ResultsRequest{}); err == nil {
			t.Fatal("globex got an answer on acme's stored-results service")
		}
	})
	t.Run("B's own service with any body answers nothing of A's", func(t *testing.T) {
		for _, body := range []string{
			`{}`, `{"name":"iso"}`, `{"name":"*"}`, `{"name":">"}`, `{"name":"iso.>"}`,
			`{"tenant":"acme"}`, `{"tenant":"acme","name":"iso"}`, `{"name":"../acme"}`,
			`{"afterSeq":0,"since":"2000-01-01T00:00:00Z"}`, `acme`, `{"max":-1}`,
			`{"name":"iso","subject":"buildq.results.acme.iso"}`,
		} {
			m, err := bpub.TenantRequest(ctx, "globex", v1.APIResultsSubject("globex"), []byte(body))
			if err != nil {
				t.Fatalf("globex's own service, body %s: %v", body, err)
			}
			var rep v1.ResultsReply
			if err := json.Unmarshal(m.Data, &rep); err != nil {
				t.Fatalf("body %s: answer %s", body, m.Data)
			}
			if hasA(&rep) {
				t.Fatalf("body %s: globex got acme's result: %s", body, m.Data)
			}
		}
	})
	t.Run("B names A's inbox as the reply", func(t *testing.T) {
		// In B's account A's inbox is B's own subject: the answer (to B's
		// own, empty request) cannot reach A, and A's inbox gets nothing.
		spy, err := a.nc.SubscribeSync(v1.InboxPrefix("acme") + ".>")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = spy.Unsubscribe() }()
		if err := a.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		if err := b.nc.PublishRequest(v1.APIResultsSubject("globex"), v1.InboxPrefix("acme")+".x", []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
		if err := b.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		if m, err := spy.NextMsg(2 * time.Second); err == nil {
			t.Fatalf("acme's inbox received %s: %s", m.Subject, m.Data)
		}
	})
	t.Run("B cannot watch A", func(t *testing.T) {
		_, errOut, code := runCLI(t, time.Minute, append([]string{"watch", "--tenant", "acme"}, e.cliNATS("globex")...)...)
		if code != 1 || !strings.Contains(errOut, "Permissions Violation") {
			t.Fatalf("buildq watch --tenant acme as globex: exit %d, stderr %s", code, errOut)
		}
	})
}
