//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// TestNATSAuth runs the shipped NATS configuration (deploy/nats/buildq.conf,
// unchanged) on a real nats-server, a real `buildq worker` as the worker
// user, and two tenants, acme (A) and globex (B), as their own users:
// A submits (CLI and SDK), gets its results and events, queries and
// cancels its own requests; every attempt of B on A's requests, results,
// events, inbox, services, the workers' internal subjects and the
// JetStream API is refused by the server (a permissions violation) or by
// the worker, and each refusal is asserted.
func TestNATSAuth(t *testing.T) {
	conf, err := filepath.Abs(filepath.Join("..", "deploy", "nats", "buildq.conf"))
	if err != nil {
		t.Fatal(err)
	}
	keys := t.TempDir()
	seeds, env := map[string]string{}, []string{}
	for _, u := range []string{"worker", "admin", "acme", "globex"} {
		kp, err := nkeys.CreateUser()
		if err != nil {
			t.Fatal(err)
		}
		seed, _ := kp.Seed()
		pub, _ := kp.PublicKey()
		seeds[u] = filepath.Join(keys, u+".seed")
		if err := os.WriteFile(seeds[u], seed, 0o600); err != nil {
			t.Fatal(err)
		}
		env = append(env, "BUILDQ_"+strings.ToUpper(u)+"_NKEY="+pub)
	}
	adminOpt, err := nats.NkeyOptionFromSeed(seeds["admin"])
	if err != nil {
		t.Fatal(err)
	}
	h := newHolds(t, "held")
	s := newSuite(t, options{
		natsConfig: conf, natsEnv: env, natsOptions: []nats.Option{adminOpt},
		workerArgs: []string{"--nats-nkey", seeds["worker"]},
		faults:     h.fault,
	})
	s.startWorker("w1")
	s.streamInfo(v1.RequestsStream) // the worker set the streams up as its user
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	a := s.connectAs(seeds["acme"], publisher.InboxPrefix("acme"))
	b := s.connectAs(seeds["globex"], publisher.InboxPrefix("globex"))
	apub, err := publisher.New(a.nc)
	if err != nil {
		t.Fatal(err)
	}
	cliNATS := func(user string) []string {
		return []string{"--nats-url", s.natsURL, "--nats-nkey", seeds[user], "--inbox-prefix", publisher.InboxPrefix(user)}
	}
	s3 := []string{"--s3-endpoint", shared.minioEndpoint, "--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword, "--s3-bucket", shared.bucket}

	// ---- What tenant A may do. ----

	t.Run("A submits with the CLI and waits", func(t *testing.T) {
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a.txt /a.txt\n", "a.txt": "cli\n"})
		args := append([]string{"submit", dir, "--tenant", "acme", "--name", "web", "--wait", "--wait-timeout", "2m", "-o", "json"}, cliNATS("acme")...)
		stdout, stderr, code := runCLI(t, 3*time.Minute, append(args, s3...)...)
		if code != 0 {
			t.Fatalf("buildq submit --wait as acme: exit %d\nstdout: %s\nstderr: %s", code, stdout, stderr)
		}
		var d v1.ResultData
		if err := json.Unmarshal([]byte(stdout), &d); err != nil {
			t.Fatalf("stdout is not one JSON result: %v\n%s", err, stdout)
		}
		if d.Status != v1.StatusSucceeded || d.Tenant != "acme" || d.Digest == "" {
			t.Fatalf("result %+v", d)
		}
		// Progress events reached the CLI (core NATS, acme's subject).
		if !strings.Contains(stderr, " queued ") || !strings.Contains(stderr, " pushed ") {
			t.Errorf("no progress events on stderr:\n%s", stderr)
		}
	})

	// A's `buildq watch` (core subscription) runs during the SDK submit.
	watchOut := &lockedBuffer{}
	wctx, stopWatch := context.WithCancel(ctx)
	watch := exec.CommandContext(wctx, filepath.Join(shared.bin, "buildq"), append([]string{"watch", "--tenant", "acme", "-o", "json"}, cliNATS("acme")...)...)
	var watchErr bytes.Buffer
	watch.Stdout, watch.Stderr = watchOut, &watchErr
	if err := watch.Start(); err != nil {
		t.Fatal(err)
	}
	watchDone := make(chan struct{})
	go func() { _ = watch.Wait(); close(watchDone) }()
	defer func() { stopWatch(); <-watchDone }()

	var sdkReq *v1.Request
	t.Run("A submits with the SDK and gets its result and events", func(t *testing.T) {
		sdkReq = s.tenantRequest("acme", "sdk", "sdk\n")
		events := make(chan v1.Event, 64)
		ectx, stopEvents := context.WithCancel(ctx)
		defer stopEvents()
		go func() {
			_ = apub.Events(ectx, "acme", "sdk", func(e v1.Event) {
				if e.RequestID == sdkReq.RequestID {
					events <- e
				}
			})
		}()
		time.Sleep(200 * time.Millisecond) // let the events subscription reach the server
		if _, err := apub.Publish(ctx, sdkReq); err != nil {
			t.Fatalf("publish as acme: %v", err)
		}
		r, err := apub.Wait(ctx, "acme", "sdk", sdkReq.RequestID, time.Time{})
		if err != nil {
			t.Fatalf("wait as acme: %v", err)
		}
		if r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("result %+v", r.Data)
		}
		phases := map[v1.Phase]bool{}
		deadline := time.After(10 * time.Second)
		for !phases[v1.PhaseFinished] {
			select {
			case e := <-events:
				phases[e.Phase] = true
			case <-deadline:
				t.Fatalf("events of acme's request: %v, want queued … finished", phases)
			}
		}
		if !phases[v1.PhaseQueued] {
			t.Errorf("events %v: no queued", phases)
		}
		// Waiting again, after the result was published: the status
		// service answers with the decided result.
		again, err := apub.Wait(ctx, "acme", "sdk", sdkReq.RequestID, time.Time{})
		if err != nil || again.Data.Digest != r.Data.Digest || again.ID != r.ID {
			t.Fatalf("wait for a decided result: %v %+v, want %+v", err, again, r.Data)
		}
		eventually(t, 10*time.Second, "buildq watch --tenant acme to print the result", func() bool {
			return strings.Contains(watchOut.String(), sdkReq.RequestID)
		})
	})
	if sdkReq == nil {
		t.FailNow()
	}

	t.Run("A queries its request (CLI, variables only)", func(t *testing.T) {
		out, errOut, code := runCLIEnv(t, time.Minute, []string{"NATS_URL=" + s.natsURL, "BUILDQ_NATS_NKEY=" + seeds["acme"], "BUILDQ_INBOX_PREFIX=" + publisher.InboxPrefix("acme")},
			"status", sdkReq.RequestID, "--tenant", "acme", "-o", "json")
		if code != 0 {
			t.Fatalf("buildq status as acme: exit %d\n%s%s", code, out, errOut)
		}
		var rep worker.StatusReply
		if err := json.Unmarshal([]byte(out), &rep); err != nil || rep.Request == nil || rep.Request.State != string(v1.StatusSucceeded) {
			t.Fatalf("status: %v %s", err, out)
		}
	})

	// A build that stays running until A cancels it.
	held := s.tenantRequest("acme", "held", "held\n")
	heldEvents := make(chan v1.Event, 64)
	ectx, stopHeldEvents := context.WithCancel(ctx)
	defer stopHeldEvents()
	go func() {
		_ = apub.Events(ectx, "acme", "held", func(e v1.Event) { heldEvents <- e })
	}()
	time.Sleep(200 * time.Millisecond)
	if _, err := apub.Publish(ctx, held); err != nil {
		t.Fatal(err)
	}
	for running := false; !running; {
		select {
		case e := <-heldEvents:
			running = e.Phase == v1.PhaseJobCreated || e.Phase == v1.PhaseRunning
		case <-time.After(time.Minute):
			t.Fatal("acme's held build did not start")
		}
	}
	heldStatus := func(t *testing.T) worker.StatusReply {
		t.Helper()
		var rep worker.StatusReply
		s.request(t, a, v1.APIStatusSubject("acme"), held.RequestID, &rep)
		return rep
	}
	st := heldStatus(t)
	if st.Request == nil || st.Request.Result != nil || st.Key == "" || st.Build == nil {
		t.Fatalf("status of acme's held request: %+v", st)
	}
	heldKey := st.Key

	// ---- What tenant B may not do: each refusal is one subtest. ----

	refused := 0
	deny := func(name string, f func(t *testing.T)) {
		refused++
		t.Run("refused: "+name, f)
	}
	deny("B publishes a request on A's subject", func(t *testing.T) {
		req := s.tenantRequest("acme", "stolen", "stolen\n")
		req.RequestID, req.APIVersion = publisher.NewRequestID(), v1.APIVersion
		body, _ := json.Marshal(req)
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", req.RequestID))
		m.Data = body
		js, _ := jetstream.New(b.nc)
		pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
		defer pcancel()
		if _, err := js.PublishMsg(pctx, m); err == nil {
			t.Fatal("globex's publish on buildq.requests.acme got a PubAck")
		}
		b.refused(t, "Publish", v1.RequestSubject("acme"))
	})
	deny("B subscribes to A's results", func(t *testing.T) {
		b.subscribeRefused(t, "buildq.results.acme.>")
	})
	deny("B subscribes to every tenant's results", func(t *testing.T) {
		b.subscribeRefused(t, "buildq.results.>")
	})
	deny("B subscribes to A's events", func(t *testing.T) {
		b.subscribeRefused(t, "buildq.events.acme.>")
	})
	deny("B subscribes to A's inbox", func(t *testing.T) {
		b.subscribeRefused(t, publisher.InboxPrefix("acme")+".>")
	})
	deny("B subscribes to the default inbox (workers', operators')", func(t *testing.T) {
		b.subscribeRefused(t, "_INBOX.>")
	})
	deny("B requests A's status service", func(t *testing.T) {
		b.requestRefused(t, v1.APIStatusSubject("acme"), held.RequestID)
	})
	deny("B requests A's cancel service", func(t *testing.T) {
		b.requestRefused(t, v1.APICancelSubject("acme"), held.RequestID)
	})
	deny("B requests A's first-version cancel subject", func(t *testing.T) {
		b.requestRefused(t, v1.CancelSubject("acme", "held"), heldKey)
	})
	deny("B publishes on buildq.internal.cancel", func(t *testing.T) {
		if err := b.nc.Publish("buildq.internal.cancel", []byte(worker.RequestIndexKey("acme", held.RequestID))); err != nil {
			t.Fatal(err)
		}
		b.refused(t, "Publish", "buildq.internal.cancel")
	})
	deny("B subscribes to the workers' internal subjects", func(t *testing.T) {
		b.subscribeRefused(t, "buildq.internal.>")
	})
	deny("B answers A's status service in the workers' place", func(t *testing.T) {
		b.subscribeRefused(t, "buildq.api.status.*")
	})
	deny("B publishes a forged result for A", func(t *testing.T) {
		forged, _ := json.Marshal(v1.NewResult("/forged", v1.ResultData{RequestID: held.RequestID, Tenant: "acme", Name: "held", Status: v1.StatusSucceeded, Digest: "sha256:" + strings.Repeat("0", 64)}, time.Now()))
		if err := b.nc.Publish(v1.ResultSubject("acme", "held"), forged); err != nil {
			t.Fatal(err)
		}
		b.refused(t, "Publish", v1.ResultSubject("acme", "held"))
	})
	deny("B jumps the queue: publishes straight into a tenant's queue", func(t *testing.T) {
		for _, subj := range []string{"buildq.queue.globex.high", "buildq.queue.acme.normal"} {
			if err := b.nc.Publish(subj, []byte(`{}`)); err != nil {
				t.Fatal(err)
			}
			b.refused(t, "Publish", subj)
		}
	})
	deny("B takes or frees concurrency slots", func(t *testing.T) {
		if err := b.nc.Publish("$KV."+worker.SlotsBucket+".acme.0", []byte("x")); err != nil {
			t.Fatal(err)
		}
		b.refused(t, "Publish", "$KV."+worker.SlotsBucket+".acme.0")
	})
	for _, bucket := range []string{v1.BuildsBucket, "buildq-requests", worker.SlotsBucket} {
		deny("B opens the KV bucket "+bucket, func(t *testing.T) {
			js, _ := jetstream.New(b.nc)
			kctx, kcancel := context.WithTimeout(ctx, 2*time.Second)
			defer kcancel()
			if _, err := js.KeyValue(kctx, bucket); err == nil {
				t.Fatalf("globex opened %s", bucket)
			}
			b.refused(t, "Publish", "$JS.API.STREAM.INFO.KV_"+bucket)
		})
	}
	deny("B reads A's ledger entry by direct get", func(t *testing.T) {
		subj := "$JS.API.DIRECT.GET.KV_buildq-requests.$KV.buildq-requests." + worker.RequestIndexKey("acme", held.RequestID)
		b.requestRefused(t, subj, "")
	})
	deny("B reads the build record by direct get", func(t *testing.T) {
		b.requestRefused(t, "$JS.API.DIRECT.GET.KV_"+v1.BuildsBucket+".$KV."+v1.BuildsBucket+"."+heldKey, "")
	})
	deny("B writes the build index", func(t *testing.T) {
		if err := b.nc.Publish("$KV."+v1.BuildsBucket+"."+heldKey, []byte(`{"state":"succeeded"}`)); err != nil {
			t.Fatal(err)
		}
		b.refused(t, "Publish", "$KV."+v1.BuildsBucket+"."+heldKey)
	})
	deny("B watches the buckets' writes", func(t *testing.T) {
		b.subscribeRefused(t, "$KV.buildq-requests.>")
	})
	deny("B reads the results stream", func(t *testing.T) {
		js, _ := jetstream.New(b.nc)
		sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
		defer scancel()
		if _, err := js.Stream(sctx, v1.ResultsStream); err == nil {
			t.Fatal("globex read the BUILDQ_RESULTS stream info")
		}
		b.refused(t, "Publish", "$JS.API.STREAM.INFO."+v1.ResultsStream)
		b.requestRefused(t, "$JS.API.STREAM.MSG.GET."+v1.ResultsStream, `{"seq":1}`)
	})
	deny("B replays the requests stream (a consumer)", func(t *testing.T) {
		js, _ := jetstream.New(b.nc)
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		defer ccancel()
		if _, err := js.OrderedConsumer(cctx, v1.RequestsStream, jetstream.OrderedConsumerConfig{}); err == nil {
			t.Fatal("globex created a consumer on BUILDQ_REQUESTS")
		}
		b.refusedPrefix(t, "Publish", "$JS.API.CONSUMER.CREATE."+v1.RequestsStream)
	})
	deny("B's buildq watch without --tenant, and with --all", func(t *testing.T) {
		_, errOut, code := runCLI(t, time.Minute, append([]string{"watch"}, cliNATS("globex")...)...)
		if code != 1 || !strings.Contains(errOut, `Permissions Violation for Subscription to "buildq.results.*.*"`) {
			t.Fatalf("buildq watch as globex: exit %d, stderr %s", code, errOut)
		}
		_, errOut, code = runCLI(t, time.Minute, append([]string{"watch", "--tenant", "globex", "--all"}, cliNATS("globex")...)...)
		if code != 1 {
			t.Fatalf("buildq watch --all as globex: exit %d, stderr %s", code, errOut)
		}
	})
	deny("B asks its own status service for A's request and build", func(t *testing.T) {
		for _, target := range []string{held.RequestID, heldKey} {
			var rep worker.StatusReply
			s.request(t, b, v1.APIStatusSubject("globex"), target, &rep)
			if rep.Error == "" || rep.Request != nil || rep.Build != nil {
				t.Errorf("globex's status of acme's %s: %+v", target, rep)
			}
		}
	})
	deny("B cancels A's request and build through its own services", func(t *testing.T) {
		for _, c := range []struct{ subject, target string }{
			{v1.APICancelSubject("globex"), held.RequestID},
			{v1.APICancelSubject("globex"), heldKey},
			{v1.CancelSubject("globex", "held"), held.RequestID},
			{v1.CancelSubject("globex", "held"), heldKey},
		} {
			var rep worker.CancelReply
			s.request(t, b, c.subject, c.target, &rep)
			if rep.Canceled || rep.Stopped || rep.Requests != 0 {
				t.Errorf("globex's cancel of %s on %s: %+v", c.target, c.subject, rep)
			}
		}
	})
	deny("A publishes a request whose body says tenant B (the worker refuses it)", func(t *testing.T) {
		forged := s.tenantRequest("globex", "forged", "forged\n")
		forged.RequestID, forged.APIVersion = publisher.NewRequestID(), v1.APIVersion
		body, _ := json.Marshal(forged)
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", forged.RequestID))
		m.Data = body
		// globex must see nothing of it.
		bsub, err := b.nc.SubscribeSync("buildq.results.globex.>")
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = bsub.Unsubscribe() }()
		if err := b.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		js, _ := jetstream.New(a.nc)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatalf("acme's JetStream publish on its own subject: %v", err)
		}
		r, err := apub.Wait(ctx, "acme", "forged", forged.RequestID, time.Time{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || r.Data.Tenant != "acme" || !strings.Contains(r.Data.Message, "does not match the subject") {
			t.Fatalf("result of a request of globex on acme's subject: %+v", r.Data)
		}
		if m, err := bsub.NextMsg(time.Second); err == nil {
			t.Fatalf("globex received %s: %s", m.Subject, m.Data)
		}
		jobs, err := shared.kube.BatchV1().Jobs(s.ns).List(ctx, metav1.ListOptions{LabelSelector: kaniko.LabelName + "=forged"})
		if err != nil || len(jobs.Items) != 0 {
			t.Fatalf("Jobs for the forged request: %v %v", jobs, err)
		}
	})
	if refused < 8 {
		t.Fatalf("%d refused attempts, want at least 8", refused)
	}

	// A's held request went through all of that untouched.
	if st := heldStatus(t); st.Request == nil || st.Request.Result != nil || st.Request.Canceled || st.Build == nil || st.Build.State != worker.StateBuilding {
		t.Fatalf("acme's held request after globex's attempts: %+v", st)
	}

	t.Run("A cancels its own request (CLI)", func(t *testing.T) {
		out, errOut, code := runCLI(t, time.Minute, append([]string{"cancel", held.RequestID, "--tenant", "acme"}, cliNATS("acme")...)...)
		if code != 0 {
			t.Fatalf("buildq cancel as acme: exit %d\n%s%s", code, out, errOut)
		}
		r, err := apub.Wait(ctx, "acme", "held", held.RequestID, time.Time{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Data.Status != v1.StatusCanceled {
			t.Fatalf("result of the canceled request: %+v", r.Data)
		}
	})

	// The worker needed nothing its user is not allowed. (The server logs
	// every refusal with the connection's name; globex's are there.)
	if log := s.natsLog.String(); !strings.Contains(log, "Violation") {
		t.Errorf("the server logged none of globex's refusals; its log:\n%s", tail(log, 3000))
	} else {
		var lines []string
		for _, l := range strings.Split(log, "\n") {
			if strings.Contains(l, "Violation") && strings.Contains(l, "buildq-worker") {
				lines = append(lines, l)
			}
		}
		if len(lines) > 0 {
			t.Errorf("the worker's user was refused:\n%s", strings.Join(lines, "\n"))
		}
	}
}

// natsUser is one connection of the test as a NATS user, with the
// server's asynchronous errors (permission violations) it received.
type natsUser struct {
	nc   *nats.Conn
	mu   sync.Mutex
	errs []error
}

func (s *suite) connectAs(seedFile, inboxPrefix string) *natsUser {
	s.t.Helper()
	nk, err := nats.NkeyOptionFromSeed(seedFile)
	if err != nil {
		s.t.Fatal(err)
	}
	u := &natsUser{}
	nc, err := nats.Connect(s.natsURL, nk, nats.CustomInboxPrefix(inboxPrefix),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			u.mu.Lock()
			u.errs = append(u.errs, err)
			u.mu.Unlock()
		}))
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(nc.Close)
	u.nc = nc
	return u
}

// refused asserts that the server refused op ("Publish", "Subscription")
// on subject to this user.
func (u *natsUser) refused(t *testing.T, op, subject string) {
	t.Helper()
	u.refusedMatch(t, fmt.Sprintf("Permissions Violation for %s to %q", op, subject))
}

// refusedPrefix asserts a refusal of op on a subject that starts with prefix.
func (u *natsUser) refusedPrefix(t *testing.T, op, prefix string) {
	t.Helper()
	u.refusedMatch(t, fmt.Sprintf("Permissions Violation for %s to \"%s", op, prefix))
}

func (u *natsUser) refusedMatch(t *testing.T, want string) {
	t.Helper()
	_ = u.nc.Flush()
	deadline := time.Now().Add(5 * time.Second)
	for {
		u.mu.Lock()
		for _, e := range u.errs {
			if errors.Is(e, nats.ErrPermissionViolation) && strings.Contains(e.Error(), want) {
				u.mu.Unlock()
				return
			}
		}
		got := fmt.Sprint(u.errs)
		u.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no %s from the server; errors received: %s", want, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// subscribeRefused subscribes to subject, asserts the server's refusal
// and that nothing arrives.
func (u *natsUser) subscribeRefused(t *testing.T, subject string) {
	t.Helper()
	sub, err := u.nc.SubscribeSync(subject)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	u.refused(t, "Subscription", subject)
	if m, err := sub.NextMsg(300 * time.Millisecond); err == nil {
		t.Fatalf("received %s on a refused subscription", m.Subject)
	}
}

// requestRefused sends a request on subject, asserts the server's refusal
// and that no answer came.
func (u *natsUser) requestRefused(t *testing.T, subject, payload string) {
	t.Helper()
	if m, err := u.nc.Request(subject, []byte(payload), 2*time.Second); err == nil {
		t.Fatalf("request on %s answered: %s", subject, m.Data)
	}
	u.refused(t, "Publish", subject)
}

// request asks one of the tenant API subjects as u and decodes the answer.
func (s *suite) request(t *testing.T, u *natsUser, subject, payload string, reply any) {
	t.Helper()
	m, err := u.nc.Request(subject, []byte(payload), 20*time.Second)
	if err != nil {
		t.Fatalf("request on %s: %v", subject, err)
	}
	if err := json.Unmarshal(m.Data, reply); err != nil {
		t.Fatalf("reply on %s: %v: %s", subject, err, m.Data)
	}
}

// tenantRequest uploads a one-file context and returns an unpublished
// request of tenant/name for it.
func (s *suite) tenantRequest(tenant, name, content string) *v1.Request {
	s.t.Helper()
	dir := contextDir(s.t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f.txt /f.txt\n", "f.txt": content})
	up, err := s.store.ForTenant(tenant).UploadContext(context.Background(), dir, contexttar.Options{}, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	return &v1.Request{Tenant: tenant, Name: name,
		Source:        v1.Source{S3: &v1.S3Source{Bucket: up.Bucket, Key: up.Key}},
		ContextDigest: up.Digest}
}

// runCLIEnv is runCLI with extra environment variables.
func runCLIEnv(t *testing.T, timeout time.Duration, env []string, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(shared.bin, "buildq"), args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		return out.String(), errOut.String(), ee.ExitCode()
	case err != nil:
		t.Fatalf("buildq %v: %v", args, err)
	}
	return out.String(), errOut.String(), 0
}
