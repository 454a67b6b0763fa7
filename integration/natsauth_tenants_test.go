//go:build integration

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// tenantsApart is what both modes must do: acme works, globex is refused,
// and the reply-subject attack matrix lands nowhere.
func (e *natsAuthEnv) tenantsApart(t *testing.T) {
	s := e.s
	s.startWorker("w1")
	s.streamInfo(v1.RequestsStream) // the worker set the streams up as its user
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	a := e.connect(t, "acme")
	b := e.connect(t, "globex")
	apub, err := publisher.New(a.nc)
	if err != nil {
		t.Fatal(err)
	}
	s3 := []string{"--s3-endpoint", shared.minioEndpoint, "--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword, "--s3-bucket", shared.bucket}

	// ---- What tenant A may do. ----

	// A's `buildq watch` (core subscription) runs from here; it must
	// print the SDK submit's result below.
	watchOut := &lockedBuffer{}
	wctx, stopWatch := context.WithCancel(ctx)
	watch := exec.CommandContext(wctx, filepath.Join(shared.bin, "buildq"), append([]string{"watch", "--tenant", "acme", "-o", "json"}, e.cliNATS("acme")...)...)
	var watchErr lockedBuffer
	watch.Stdout, watch.Stderr = watchOut, &watchErr
	if err := watch.Start(); err != nil {
		t.Fatal(err)
	}
	watchDone := make(chan struct{})
	go func() { _ = watch.Wait(); close(watchDone) }()
	defer func() { stopWatch(); <-watchDone }()

	t.Run("A submits with the CLI and waits", func(t *testing.T) {
		// Content of this mode alone: both modes share the registry and
		// run side by side, and a build of the other's content would
		// answer this one from the image at its tag (no "pushed" event).
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a.txt /a.txt\n", "a.txt": "cli " + t.Name() + "\n"})
		args := append([]string{"submit", dir, "--tenant", "acme", "--name", "web", "--wait", "--wait-timeout", "2m", "-o", "json"}, e.cliNATS("acme")...)
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

	var sdkReq *v1.Request
	t.Run("A submits with the SDK and gets its result and events", func(t *testing.T) {
		req := s.tenantRequest(t, "acme", "sdk", "sdk\n")
		events := a.events(t, "acme", "sdk")
		if _, err := apub.Publish(ctx, req); err != nil {
			t.Fatalf("publish as acme: %v", err)
		}
		r, err := apub.Wait(ctx, "acme", "sdk", req.RequestID, time.Time{})
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
				if e.RequestID == req.RequestID {
					phases[e.Phase] = true
				}
			case <-deadline:
				t.Fatalf("events of acme's request: %v, want queued … finished", phases)
			}
		}
		if !phases[v1.PhaseQueued] {
			t.Errorf("events %v: no queued", phases)
		}
		// Waiting again, after the result was published: the status
		// service answers with the decided result.
		again, err := apub.Wait(ctx, "acme", "sdk", req.RequestID, time.Time{})
		if err != nil || again.Data.Digest != r.Data.Digest || again.ID != r.ID {
			t.Fatalf("wait for a decided result: %v %+v, want %+v", err, again, r.Data)
		}
		eventually(t, 10*time.Second, "buildq watch --tenant acme to print the result", func() bool {
			return strings.Contains(watchOut.String(), req.RequestID)
		})
		sdkReq = req
	})
	if sdkReq == nil {
		t.FailNow()
	}

	t.Run("A queries its request (CLI, variables only)", func(t *testing.T) {
		out, errOut, code := runCLIEnv(t, time.Minute, append([]string{"NATS_URL=" + s.natsURL}, e.cliEnv("acme")...),
			"status", sdkReq.RequestID, "--tenant", "acme", "-o", "json")
		if code != 0 {
			t.Fatalf("buildq status as acme: exit %d\n%s%s", code, out, errOut)
		}
		var rep v1.StatusReply
		if err := json.Unmarshal([]byte(out), &rep); err != nil || rep.Request == nil || rep.Request.State != string(v1.StatusSucceeded) {
			t.Fatalf("status: %v %s", err, out)
		}
	})

	// A build that stays running until A cancels it.
	held := s.tenantRequest(t, "acme", "held", "held\n")
	heldEvents := a.events(t, "acme", "held")
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
	heldStatus := func(t *testing.T) v1.StatusReply {
		t.Helper()
		var rep v1.StatusReply
		request(t, a, v1.APIStatusSubject("acme"), held.RequestID, &rep)
		return rep
	}
	st := heldStatus(t)
	if st.Request == nil || st.Request.Result != nil || st.Key == "" || st.Build == nil {
		t.Fatalf("status of acme's held request: %+v", st)
	}
	heldKey := st.Key

	// ---- What tenant B may not do: each refusal is one subtest, all at once. ----

	var refused atomic.Int32
	t.Run("refused", func(t *testing.T) {
		deny := func(name string, f func(t *testing.T)) {
			refused.Add(1)
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				f(t)
			})
		}
		// The slowest first: at most GOMAXPROCS subtests run at once.
		deny("B's buildq watch without --tenant, and with --all", func(t *testing.T) {
			_, errOut, code := runCLI(t, time.Minute, append([]string{"watch"}, e.cliNATS("globex")...)...)
			if code != 1 || !strings.Contains(errOut, `Permissions Violation for Subscription to "buildq.results.*.*"`) {
				t.Fatalf("buildq watch as globex: exit %d, stderr %s", code, errOut)
			}
			_, errOut, code = runCLI(t, time.Minute, append([]string{"watch", "--tenant", "globex", "--all"}, e.cliNATS("globex")...)...)
			if code != 1 {
				t.Fatalf("buildq watch --all as globex: exit %d, stderr %s", code, errOut)
			}
		})
		deny("A publishes a request whose body says tenant B (the worker refuses it)", func(t *testing.T) {
			forged := s.tenantRequest(t, "globex", "forged", "forged\n")
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
		deny("B publishes a request on A's subject", func(t *testing.T) {
			req := s.tenantRequest(t, "acme", "stolen", "stolen\n")
			req.RequestID, req.APIVersion = publisher.NewRequestID(), v1.APIVersion
			body, _ := json.Marshal(req)
			m := nats.NewMsg(v1.RequestSubject("acme"))
			m.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", req.RequestID))
			m.Data = body
			js, _ := jetstream.New(b.nc)
			pctx, pcancel := context.WithTimeout(ctx, jsRefusedWait)
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
		deny("B subscribes to everything", func(t *testing.T) {
			b.subscribeRefused(t, ">")
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
			if err := b.nc.Publish("$KV."+v1.SlotsBucket+".acme.0", []byte("x")); err != nil {
				t.Fatal(err)
			}
			b.refused(t, "Publish", "$KV."+v1.SlotsBucket+".acme.0")
		})
		for _, bucket := range []string{v1.BuildsBucket, v1.RequestsBucket, v1.SlotsBucket} {
			deny("B opens the KV bucket "+bucket, func(t *testing.T) {
				js, _ := jetstream.New(b.nc)
				kctx, kcancel := context.WithTimeout(ctx, jsRefusedWait)
				defer kcancel()
				if _, err := js.KeyValue(kctx, bucket); err == nil {
					t.Fatalf("globex opened %s", bucket)
				}
				b.refused(t, "Publish", "$JS.API.STREAM.INFO.KV_"+bucket)
			})
		}
		deny("B reads A's ledger entry by direct get", func(t *testing.T) {
			subj := "$JS.API.DIRECT.GET.KV_" + v1.RequestsBucket + ".$KV." + v1.RequestsBucket + "." + worker.RequestIndexKey("acme", held.RequestID)
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
			b.subscribeRefused(t, "$KV."+v1.RequestsBucket+".>")
		})
		deny("B reads the results stream", func(t *testing.T) {
			js, _ := jetstream.New(b.nc)
			sctx, scancel := context.WithTimeout(ctx, jsRefusedWait)
			defer scancel()
			if _, err := js.Stream(sctx, v1.ResultsStream); err == nil {
				t.Fatal("globex read the BUILDQ_RESULTS stream info")
			}
			b.refused(t, "Publish", "$JS.API.STREAM.INFO."+v1.ResultsStream)
			b.requestRefused(t, "$JS.API.STREAM.MSG.GET."+v1.ResultsStream, `{"seq":1}`)
		})
		deny("B replays the requests stream (a consumer)", func(t *testing.T) {
			js, _ := jetstream.New(b.nc)
			cctx, ccancel := context.WithTimeout(ctx, jsRefusedWait)
			defer ccancel()
			if _, err := js.OrderedConsumer(cctx, v1.RequestsStream, jetstream.OrderedConsumerConfig{}); err == nil {
				t.Fatal("globex created a consumer on BUILDQ_REQUESTS")
			}
			b.refusedPrefix(t, "Publish", "$JS.API.CONSUMER.CREATE."+v1.RequestsStream)
		})
		deny("B names a reply subject the server reserves (service import, JetStream ack)", func(t *testing.T) {
			// _R_. replies are the server's own (a service import's) and
			// $JS.ACK. replies a consumer's: a client may name neither.
			for _, c := range []struct{ subject, reply string }{
				{v1.RequestSubject("globex"), "_R_.abcdef.ghijkl"},
				{v1.APIStatusSubject("globex"), "_R_.abcdef.mnopqr"},
				{v1.RequestSubject("globex"), "$JS.ACK." + v1.QueueStream + ".buildq-q-normal-acme.1.1.1.1.0"},
			} {
				if err := b.nc.PublishRequest(c.subject, c.reply, []byte(held.RequestID)); err != nil {
					t.Fatal(err)
				}
				b.refusedMatch(t, fmt.Sprintf("Permissions Violation for Publish with Reply of %q", c.reply))
			}
		})
		deny("B asks its own status service for A's request and build", func(t *testing.T) {
			for _, target := range []string{held.RequestID, heldKey} {
				var rep v1.StatusReply
				request(t, b, v1.APIStatusSubject("globex"), target, &rep)
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
				var rep v1.CancelReply
				request(t, b, c.subject, c.target, &rep)
				if rep.Canceled || rep.Stopped || rep.Requests != 0 {
					t.Errorf("globex's cancel of %s on %s: %+v", c.target, c.subject, rep)
				}
			}
		})
	})
	if n := refused.Load(); n < 8 {
		t.Fatalf("%d refused attempts, want at least 8", n)
	}

	// With an account per tenant, B may subscribe to _INBOX.> — in its
	// own account, where only its own replies arrive.
	t.Run("B's default inbox sees nothing of A's or the workers' replies", func(t *testing.T) {
		spy := e.connect(t, "globex")
		sub, err := spy.nc.SubscribeSync("_INBOX.>")
		if err != nil {
			t.Fatal(err)
		}
		if err := spy.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		// Replies A gets on the default inbox and on its own prefix: a
		// status answer (for which the worker reads its buckets through
		// the JetStream API, replies on the workers' _INBOX.), a PubAck
		// and A's result, decided by the worker; and an operator's
		// JetStream API reply.
		var rep v1.StatusReply
		request(t, a, v1.APIStatusSubject("acme"), held.RequestID, &rep)
		if rep.Request == nil {
			t.Fatalf("acme's status of its held request: %+v", rep)
		}
		if _, err := apub.TenantRequest(ctx, "acme", v1.APIStatusSubject("acme"), []byte(held.RequestID)); err != nil {
			t.Fatal(err)
		}
		id := publisher.NewRequestID()
		m := nats.NewMsg(v1.RequestSubject("acme"))
		m.Header.Set(v1.MsgIDHeader, v1.RequestMsgID("acme", id, nuid.Next()))
		m.Data = []byte(fmt.Sprintf(`{"apiVersion":%q,"requestId":%q,"tenant":"acme","name":"nosource"}`, v1.APIVersion, id))
		js, _ := jetstream.New(a.nc)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatalf("acme's JetStream publish (default inbox): %v", err)
		}
		if r, err := apub.Wait(ctx, "acme", "nosource", id, time.Time{}); err != nil || r.Data.Reason != v1.ReasonInvalidRequest {
			t.Fatalf("result of acme's request without a source: %v %+v", err, r)
		}
		streamMsgs(ctx, t, s.js(), v1.ResultsStream)
		if err := spy.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		if n, _, _ := sub.Pending(); n != 0 {
			m, _ := sub.NextMsg(0)
			t.Fatalf("globex's _INBOX.> received %d message(s), the first on %s: %s", n, m.Subject, m.Data)
		}
		if errs := spy.errors(); len(errs) != 0 {
			t.Fatalf("globex's subscription to _INBOX.> refused: %v", errs)
		}
	})

	t.Run("reply-subject attack matrix", func(t *testing.T) {
		e.replyAttack(t, "globex", "acme", held, heldKey, sdkReq)
	})

	// A's held request went through all of that untouched.
	if st := heldStatus(t); st.Request == nil || st.Request.Result != nil || st.Request.Canceled || st.Build == nil || st.Build.State != v1.StateBuilding {
		t.Fatalf("acme's held request after globex's attempts: %+v", st)
	}

	t.Run("A cancels its own request (CLI, --inbox-prefix _INBOX_acme)", func(t *testing.T) {
		out, errOut, code := runCLI(t, time.Minute, append([]string{"cancel", held.RequestID, "--tenant", "acme", "--inbox-prefix", publisher.InboxPrefix("acme")}, e.cliNATS("acme")...)...)
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

	e.checkServerLog(t)
}
