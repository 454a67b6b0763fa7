//go:build integration

package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/natsconf"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// TestNATSAuth runs buildq's NATS setup with an account per tenant on a real
// nats-server and a real `buildq worker` (its user, buildq-worker, in the
// BUILDQ account), in both of its forms, side by side:
//
//   - config file: deploy/nats/buildq.conf, unchanged, the users' public
//     nkeys from the environment;
//   - jwt: a decentralized setup made with internal/natsconf (operator,
//     SYS, BUILDQ, tenant accounts acme and globex), to which a tenant,
//     initech, is added live with `buildq nats-config --push`.
//
// In each, tenant acme (A) submits (CLI and SDK, without an inbox prefix),
// gets its results and events, queries and cancels its own requests; every
// attempt of tenant globex (B) on A's requests, results, events, inbox,
// services, the workers' internal subjects and the JetStream API is
// refused by the server (a permissions violation) or by the worker; B's
// default inbox sees nothing of A's or the workers' replies; and no reply
// subject B names — a bucket's, a stream's, the JetStream API's, the
// workers', A's — makes the server or the worker publish there
// (replyAttack).
func TestNATSAuth(t *testing.T) {
	t.Run("config file", func(t *testing.T) {
		t.Parallel()
		e := fileModeEnv(t)
		e.tenantsApart(t)
	})
	t.Run("jwt", func(t *testing.T) {
		t.Parallel()
		e := jwtModeEnv(t)
		e.tenantsApart(t)
		e.liveTenant(t, "initech")
	})
}

// natsAuthEnv is one mode's server, worker and users.
type natsAuthEnv struct {
	s *suite
	// auth is how the user with a key name (natsconf.WorkerKey,
	// AdminKey, a tenant) connects; cli the same as the command line's
	// flags, cliEnv as its variables.
	auth   func(t *testing.T, user string) nats.Option
	cli    func(user string) []string
	cliEnv func(user string) []string
	// jwtDir is the decentralized setup's directory (jwt mode only).
	jwtDir string
}

// fileModeEnv runs deploy/nats/buildq.conf as it is shipped: the users'
// public nkeys in $BUILDQ_<USER>_NKEY.
func fileModeEnv(t *testing.T) *natsAuthEnv {
	conf, err := filepath.Abs(filepath.Join("..", "deploy", "nats", "buildq.conf"))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := natsconf.NewUserKeys(natsconf.Users([]string{"acme", "globex"}))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	seed := func(user string) string { return filepath.Join(dir, user+".seed") }
	var env []string
	for _, k := range keys {
		if err := os.WriteFile(seed(k.User), k.Seed, 0o600); err != nil {
			t.Fatal(err)
		}
		env = append(env, natsconf.NKeyVar(k.User)+"="+k.Public)
	}
	e := &natsAuthEnv{
		auth: func(t *testing.T, user string) nats.Option {
			t.Helper()
			o, err := nats.NkeyOptionFromSeed(seed(user))
			if err != nil {
				t.Fatal(err)
			}
			return o
		},
		cli:    func(user string) []string { return []string{"--nats-nkey", seed(user)} },
		cliEnv: func(user string) []string { return []string{"BUILDQ_NATS_NKEY=" + seed(user)} },
	}
	h := newHolds(t, "held")
	e.s = newSuite(t, options{
		natsConfig: conf, natsEnv: env, natsOptions: []nats.Option{e.auth(t, natsconf.AdminKey)},
		workerArgs: []string{"--nats-nkey", seed(natsconf.WorkerKey)},
		faults:     h.fault,
	})
	return e
}

// jwtModeEnv makes a decentralized setup with internal/natsconf, laid out
// as `buildq nats-config --mode jwt --dir DIR` lays it out (so that command
// can add a tenant to it), and runs nats-server on its configuration.
func jwtModeEnv(t *testing.T) *natsAuthEnv {
	setup, err := natsconf.NewJWTSetup([]string{"acme", "globex"})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(rel string, data []byte, mode os.FileMode) {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, mode); err != nil {
			t.Fatal(err)
		}
	}
	files, err := setup.Files()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		mode := os.FileMode(0o644)
		if f.Secret {
			mode = 0o600
		}
		write(f.Path, f.Data, mode)
	}
	for _, u := range []string{natsconf.WorkerKey, natsconf.AdminKey, natsconf.SysKey, "acme", "globex"} {
		b, err := setup.UserCreds(u)
		if err != nil {
			t.Fatal(err)
		}
		write(natsconf.CredsDir+"/"+u+".creds", b, 0o600)
	}
	resolver := filepath.Join(dir, natsconf.ResolverDir)
	if err := os.MkdirAll(resolver, 0o700); err != nil {
		t.Fatal(err)
	}
	conf, err := setup.ServerConfig(resolver)
	if err != nil {
		t.Fatal(err)
	}
	write(natsconf.ConfigFile, conf, 0o644)

	creds := func(user string) string { return filepath.Join(dir, natsconf.CredsDir, user+".creds") }
	e := &natsAuthEnv{
		auth:   func(_ *testing.T, user string) nats.Option { return nats.UserCredentials(creds(user)) },
		cli:    func(user string) []string { return []string{"--nats-creds", creds(user)} },
		cliEnv: func(user string) []string { return []string{"BUILDQ_NATS_CREDS=" + creds(user)} },
		jwtDir: dir,
	}
	h := newHolds(t, "held")
	e.s = newSuite(t, options{
		natsConfig: filepath.Join(dir, natsconf.ConfigFile), natsOptions: []nats.Option{e.auth(t, natsconf.AdminKey)},
		workerArgs: []string{"--nats-creds", creds(natsconf.WorkerKey)},
		faults:     h.fault,
	})
	return e
}

// connect is a new connection as user, with the default inbox prefix
// (tenants need none of their own: their replies stay in their account).
func (e *natsAuthEnv) connect(t *testing.T, user string, extra ...nats.Option) *natsUser {
	t.Helper()
	return e.s.connectAs(t, append([]nats.Option{e.auth(t, user), nats.Name("it-" + user)}, extra...)...)
}

// cliNATS are the command line's flags to reach the server as user.
func (e *natsAuthEnv) cliNATS(user string) []string {
	return append([]string{"--nats-url", e.s.natsURL}, e.cli(user)...)
}

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
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a.txt /a.txt\n", "a.txt": "cli\n"})
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

// checkServerLog: the server logged globex's refusals, and none of the
// worker's (it needed nothing its user is not allowed).
func (e *natsAuthEnv) checkServerLog(t *testing.T) {
	t.Helper()
	log := e.s.natsLog.String()
	if !strings.Contains(log, "Violation") {
		t.Errorf("the server logged none of globex's refusals; its log:\n%s", tail(log, 3000))
		return
	}
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

// liveTenant adds tenant to the running server of jwt mode with the real
// `buildq nats-config --mode jwt --dir DIR --tenant T --push URL`, and the
// new tenant submits and gets its result: no restart of the server or the
// worker.
func (e *natsAuthEnv) liveTenant(t *testing.T, tenant string) {
	s := e.s
	s.natsMu.Lock()
	server := s.nats
	s.natsMu.Unlock()
	t.Run("a tenant added live submits and gets its result", func(t *testing.T) {
		if _, err := os.Stat(filepath.Join(e.jwtDir, natsconf.CredsDir, tenant+".creds")); err == nil {
			t.Fatalf("%s already has %s's credentials", e.jwtDir, tenant)
		}
		out, errOut, code := runCLI(t, time.Minute, "nats-config", "--mode", "jwt", "--dir", e.jwtDir, "--tenant", tenant, "--push", s.natsURL)
		if code != 0 {
			t.Fatalf("buildq nats-config --push: exit %d\n%s%s", code, out, errOut)
		}
		if !strings.Contains(errOut, "pushed tenant "+tenant) {
			t.Fatalf("buildq nats-config --push did not report the push:\n%s", errOut)
		}
		dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY i.txt /i.txt\n", "i.txt": tenant + "\n"})
		args := append([]string{"submit", dir, "--tenant", tenant, "--name", "app", "--wait", "--wait-timeout", "2m", "-o", "json"}, e.cliNATS(tenant)...)
		stdout, stderr, code := runCLI(t, 3*time.Minute, append(args, "--s3-endpoint", shared.minioEndpoint, "--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword, "--s3-bucket", shared.bucket)...)
		if code != 0 {
			t.Fatalf("buildq submit --wait as %s: exit %d\nstdout: %s\nstderr: %s", tenant, code, stdout, stderr)
		}
		var d v1.ResultData
		if err := json.Unmarshal([]byte(stdout), &d); err != nil {
			t.Fatalf("stdout is not one JSON result: %v\n%s", err, stdout)
		}
		if d.Status != v1.StatusSucceeded || d.Tenant != tenant || d.Digest == "" {
			t.Fatalf("result %+v", d)
		}
		// The same nats-server process, started once.
		s.natsMu.Lock()
		same := s.nats == server
		s.natsMu.Unlock()
		if !same || server.Process.Signal(syscall.Signal(0)) != nil {
			t.Fatal("nats-server was restarted")
		}
		if n := strings.Count(s.natsLog.String(), "Server is ready"); n != 1 {
			t.Fatalf("nats-server started %d times", n)
		}
		// The new tenant is apart from the others too.
		u := e.connect(t, tenant)
		u.subscribeRefused(t, "buildq.results.acme.>")
		if err := u.nc.Publish(v1.RequestSubject("acme"), []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
		u.refused(t, "Publish", v1.RequestSubject("acme"))
	})
}

// hostileReply is a reply subject an attacker names: a subject the server
// or a worker publishes on.
type hostileReply struct {
	subject string
	// legit recognizes the legitimate traffic on the subject (nil: there
	// is none while the attack runs): anything else there is the attack's.
	legit func(data []byte) bool
}

// replyAttack is the reply-subject attack matrix. NATS checks the subject a
// client publishes to, never the reply subject it names: tenant attacker
// sends, for every subject family the server or a worker publishes on —
// each bucket's $KV subjects, each stream's, buildq.internal.>, $JS.API.>,
// victim's results, events, dead letters, services and inboxes — (a) a
// JetStream publish on its own request subject, (b) a status request and
// (c) cancel requests (buildq.api.cancel.<attacker> and
// buildq.cancel.<attacker>.<name>) with that subject as the reply. All of
// it is allowed (no permission covers a reply subject); the service imports
// give every one a reply subject of the server's (_R_.…) in BUILDQ and
// route its PubAck or answer back into the attacker's own account, under
// the subject it named, where nothing of BUILDQ's or the victim's is.
//
// Asserted: an operator subscribed in BUILDQ to every hostile subject
// receives nothing of the attack; the named keys do not exist or are
// unchanged; the streams, the bucket stream and the consumer still exist
// and hold nothing the attack put there; the victim's held request is
// untouched; the victim receives nothing; and each of the attacker's sends
// was answered — on the attacker's own subject, as the one it could read
// (_INBOX.<token>) shows — and its own PubAcks and status answers still
// come back.
//
// The victim must have only held in flight (done finished), and nobody
// else may use the tenant API while it runs: it counts the answers.
func (e *natsAuthEnv) replyAttack(t *testing.T, attacker, victim string, held *v1.Request, heldKey string, done *v1.Request) {
	s := e.s
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	js := s.js()
	token := nuid.Next() // unique in every family where legitimate traffic is
	name := "u" + strings.ToLower(token)
	slot := func() string {
		n, err := rand.Int(rand.Reader, big.NewInt(1e9))
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(1000 + n.Int64())
	}
	doneLedger := worker.RequestIndexKey(victim, done.RequestID)
	heldLedger := worker.RequestIndexKey(victim, held.RequestID)
	wake := regexp.MustCompile(`^[a-z0-9_-]+( (high|normal|low))?$`)

	kvBuilds := "$KV." + v1.BuildsBucket + "." + randomHex(t, 32)
	kvLedger := "$KV." + v1.RequestsBucket + "." + randomHex(t, 20)
	kvVictimSlot := "$KV." + v1.SlotsBucket + "." + victim + "." + slot()
	kvAttackerSlot := "$KV." + v1.SlotsBucket + "." + attacker + "." + slot()
	queueVictim := v1.QueuePrefix + "." + victim + ".high"
	queueAttacker := v1.QueuePrefix + "." + attacker + ".high"
	victimResult := v1.ResultSubject(victim, name)
	hostile := []hostileReply{
		// The buckets: new keys, and existing ones of the victim's.
		{subject: kvBuilds},
		{subject: "$KV." + v1.BuildsBucket + "." + heldKey, legit: func(d []byte) bool {
			var r v1.BuildRecord
			return json.Unmarshal(d, &r) == nil && r.Key == heldKey && r.State != ""
		}},
		{subject: kvLedger},
		{subject: "$KV." + v1.RequestsBucket + "." + doneLedger},
		{subject: "$KV." + v1.RequestsBucket + "." + heldLedger, legit: func(d []byte) bool {
			var r v1.RequestEntry
			return json.Unmarshal(d, &r) == nil && r.RequestID == held.RequestID && r.State != ""
		}},
		{subject: kvVictimSlot},
		{subject: kvAttackerSlot},
		{subject: "$KV." + v1.SlotsBucket + "." + victim + ".0", legit: func(d []byte) bool {
			return bytes.Contains(d, []byte(`"holder"`))
		}},
		// The streams.
		{subject: v1.RequestSubject(victim)},
		{subject: queueVictim},
		{subject: queueAttacker},
		{subject: victimResult},
		{subject: v1.DeadLetterSubject(victim)},
		{subject: v1.DeadLetterSubject(attacker)},
		// The workers' own subjects. buildq.internal.queued carries
		// "<tenant>[ <priority>]" as the attacker's requests are admitted.
		{subject: "buildq.internal.cancel"},
		{subject: "buildq.internal.queued", legit: wake.Match},
		{subject: "buildq.internal." + token},
		// The JetStream API.
		{subject: "$JS.API.STREAM.DELETE." + v1.ResultsStream},
		{subject: "$JS.API.STREAM.PURGE." + v1.ResultsStream},
		{subject: "$JS.API.STREAM.DELETE.KV_" + v1.BuildsBucket},
		{subject: "$JS.API.CONSUMER.DELETE." + v1.RequestsStream + "." + v1.WorkersConsumer},
		// The victim's events, services and inboxes.
		{subject: v1.EventSubject(victim, name)},
		{subject: v1.APIStatusSubject(victim)},
		{subject: v1.CancelSubject(victim, held.Name)},
		{subject: v1.InboxPrefix(victim) + "." + token},
		// The default inbox: the workers' and operators' in BUILDQ, the
		// victim's in its account — and the attacker's own in its
		// account, where the answers arrive.
		{subject: "_INBOX." + token},
	}

	// Observers, subscribed before the attack.
	var (
		mu     sync.Mutex
		landed []string
	)
	land := func(who string, m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		landed = append(landed, fmt.Sprintf("%s received on %s: %s", who, m.Subject, tail(string(m.Data), 300)))
	}
	admin := s.nc
	for _, h := range hostile {
		sub, err := admin.Subscribe(h.subject, func(m *nats.Msg) {
			if h.legit == nil || !h.legit(m.Data) {
				land("an operator in BUILDQ", m)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = sub.Unsubscribe() }()
	}
	// Every PubAck and answer to a request that came through a service
	// import is published on its _R_. reply in BUILDQ.
	var answered atomic.Int64
	rsub, err := admin.Subscribe("_R_.>", func(*nats.Msg) { answered.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rsub.Unsubscribe() }()
	// The victim: its results, events and inboxes, in its own account.
	vspy := e.connect(t, victim)
	for _, subj := range []string{v1.ResultsPrefix + "." + victim + ".>", v1.EventsPrefix + "." + victim + ".>", "_INBOX.>", v1.InboxPrefix(victim) + ".>"} {
		if _, err := vspy.nc.Subscribe(subj, func(m *nats.Msg) {
			if m.Subject != v1.EventSubject(victim, held.Name) { // the held build's own progress
				land(victim, m)
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	// The attacker: a connection of its own (its errors are the attack's),
	// reading the one hostile subject it may read, and its results.
	att := e.connect(t, attacker)
	own, err := att.nc.SubscribeSync("_INBOX." + token)
	if err != nil {
		t.Fatal(err)
	}
	const attackName = "attack"
	results, err := att.nc.SubscribeSync(v1.ResultSubject(attacker, attackName))
	if err != nil {
		t.Fatal(err)
	}
	for _, nc := range []*nats.Conn{admin, vspy.nc, att.nc} {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if errs := append(vspy.errors(), att.errors()...); len(errs) != 0 {
		t.Fatalf("subscriptions refused: %v", errs)
	}

	// What must not change.
	ledger, err := js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		t.Fatal(err)
	}
	doneEntry, err := ledger.Get(ctx, doneLedger)
	if err != nil {
		t.Fatalf("the ledger entry of %s's finished request: %v", victim, err)
	}
	doneResult, err := lastMsg(ctx, js, v1.ResultsStream, v1.ResultSubject(victim, done.Name))
	if err != nil {
		t.Fatalf("%s's finished result: %v", victim, err)
	}
	deadLetters := streamMsgs(ctx, t, js, v1.DeadLetterStream)

	// The attack: four sends per hostile subject, every one allowed.
	attackMsg := func(id string) *nats.Msg {
		m := nats.NewMsg(v1.RequestSubject(attacker))
		m.Header.Set(v1.MsgIDHeader, v1.RequestMsgID(attacker, id, nuid.Next()))
		// No source: the worker answers it InvalidRequest, quickly and
		// on the attacker's own result subject.
		m.Data = []byte(fmt.Sprintf(`{"apiVersion":%q,"requestId":%q,"tenant":%q,"name":%q}`, v1.APIVersion, id, attacker, attackName))
		return m
	}
	var ids []string
	for _, h := range hostile {
		id := publisher.NewRequestID()
		ids = append(ids, id)
		m := attackMsg(id)
		m.Reply = h.subject
		if err := att.nc.PublishMsg(m); err != nil {
			t.Fatal(err)
		}
		for _, r := range []struct{ subject, payload string }{
			{v1.APIStatusSubject(attacker), held.RequestID},
			{v1.APICancelSubject(attacker), held.RequestID},
			{v1.CancelSubject(attacker, held.Name), heldKey},
		} {
			if err := att.nc.PublishRequest(r.subject, h.subject, []byte(r.payload)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := att.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	sends := int64(4 * len(hostile))
	eventually(t, time.Minute, fmt.Sprintf("the server and the worker to answer the %d sends", sends), func() bool {
		return answered.Load() >= sends
	})

	// Each answer went back into the attacker's account under the subject
	// it named: the one it may read got all four.
	kinds := map[string]int{}
	for range 4 {
		m, err := own.NextMsg(10 * time.Second)
		if err != nil {
			t.Fatalf("the answers on %s, the attacker's own default inbox: %v (got %v)", "_INBOX."+token, err, kinds)
		}
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(m.Data, &fields); err != nil {
			t.Fatalf("answer %s: %v", m.Data, err)
		}
		switch {
		case fields["stream"] != nil:
			var pa jetstream.PubAck
			if json.Unmarshal(m.Data, &pa) != nil || pa.Stream != v1.RequestsStream {
				t.Fatalf("PubAck %s", m.Data)
			}
			kinds["puback"]++
		case fields["canceled"] != nil:
			var rep v1.CancelReply
			if json.Unmarshal(m.Data, &rep) != nil || rep.Canceled || rep.Stopped || rep.Requests != 0 {
				t.Fatalf("cancel answer %s", m.Data)
			}
			kinds["cancel"]++
		default:
			var rep v1.StatusReply
			if json.Unmarshal(m.Data, &rep) != nil || rep.Error == "" || rep.Request != nil || rep.Build != nil {
				t.Fatalf("status answer %s", m.Data)
			}
			kinds["status"]++
		}
	}
	if kinds["puback"] != 1 || kinds["status"] != 1 || kinds["cancel"] != 2 {
		t.Fatalf("answers on the attacker's inbox: %v, want a PubAck, a status answer, two cancel answers", kinds)
	}

	// Its legitimate requests are answered as ever: a PubAck and the
	// status of its own request, on its own inboxes.
	ajs, err := jetstream.New(att.nc)
	if err != nil {
		t.Fatal(err)
	}
	ownID := publisher.NewRequestID()
	pa, err := ajs.PublishMsg(ctx, attackMsg(ownID))
	if err != nil || pa.Stream != v1.RequestsStream {
		t.Fatalf("the attacker's own JetStream publish: %v %+v", err, pa)
	}
	ids = append(ids, ownID)
	// The worker answers every request the attack stored, on the
	// attacker's own result subject.
	answers := map[string]bool{}
	for len(answers) < len(ids) {
		m, err := results.NextMsg(time.Minute)
		if err != nil {
			t.Fatalf("results of the attacker's %d requests: %d came: %v", len(ids), len(answers), err)
		}
		var r v1.Result
		if err := json.Unmarshal(m.Data, &r); err != nil || r.Data.Tenant != attacker || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest {
			t.Fatalf("result %v %s", err, m.Data)
		}
		answers[r.Data.RequestID] = true
	}
	for _, id := range ids {
		if !answers[id] {
			t.Fatalf("no result for the attacker's request %s", id)
		}
	}
	var rep v1.StatusReply
	request(t, att, v1.APIStatusSubject(attacker), ownID, &rep) // default inbox
	if rep.Request == nil || rep.Request.RequestID != ownID || rep.Request.State != string(v1.StatusFailed) {
		t.Fatalf("the attacker's status of its own request: %+v", rep)
	}
	apub, err := publisher.New(att.nc)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := apub.Wait(ctx, attacker, attackName, ownID, time.Time{}); err != nil || r.Data.RequestID != ownID { // _INBOX_<attacker>
		t.Fatalf("the attacker's wait for its own result: %v %+v", err, r)
	}

	// Everything is delivered: every connection's earlier messages come
	// before the answer to its flush.
	for _, nc := range []*nats.Conn{admin, vspy.nc, att.nc} {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	if len(landed) > 0 {
		t.Errorf("the attack's replies landed:\n%s", strings.Join(landed, "\n"))
	}
	mu.Unlock()
	if errs := att.errors(); len(errs) != 0 {
		t.Errorf("the server refused some of the attack (it must let all of it through; nothing may land): %v", errs)
	}

	// The keys named: absent, or unchanged.
	for _, subj := range []string{kvBuilds, kvLedger, kvVictimSlot, kvAttackerSlot} {
		bucket := strings.SplitN(subj, ".", 3)[1]
		if m, err := lastMsg(ctx, js, "KV_"+bucket, subj); !errors.Is(err, jetstream.ErrMsgNotFound) {
			t.Errorf("%s: %v %v, want no message", subj, err, m)
		}
	}
	if got, err := ledger.Get(ctx, doneLedger); err != nil {
		t.Errorf("the ledger entry of %s's finished request: %v", victim, err)
	} else if got.Revision() != doneEntry.Revision() || !bytes.Equal(got.Value(), doneEntry.Value()) {
		t.Errorf("the ledger entry of %s's finished request: revision %d, had %d: %s", victim, got.Revision(), doneEntry.Revision(), got.Value())
	}
	if got, err := ledger.Get(ctx, heldLedger); err != nil {
		t.Errorf("the ledger entry of %s's held request: %v", victim, err)
	} else {
		var le v1.RequestEntry
		if err := json.Unmarshal(got.Value(), &le); err != nil || le.RequestID != held.RequestID || le.Canceled || le.Result != nil {
			t.Errorf("the ledger entry of %s's held request: %v %s", victim, err, got.Value())
		}
	}
	// The streams: still there, and nothing of the attack's in them.
	for _, c := range []struct{ stream, subject string }{
		{v1.QueueStream, queueVictim},
		{v1.QueueStream, queueAttacker},
		{v1.ResultsStream, victimResult},
	} {
		if m, err := lastMsg(ctx, js, c.stream, c.subject); !errors.Is(err, jetstream.ErrMsgNotFound) {
			t.Errorf("%s in %s: %v %v, want no message", c.subject, c.stream, err, m)
		}
	}
	if m, err := lastMsg(ctx, js, v1.ResultsStream, v1.ResultSubject(victim, done.Name)); err != nil || m.Sequence != doneResult.Sequence {
		t.Errorf("%s's finished result after the attack: %v %v, was at sequence %d", victim, err, m, doneResult.Sequence)
	}
	if n := streamMsgs(ctx, t, js, v1.DeadLetterStream); n != deadLetters {
		t.Errorf("%s holds %d messages, had %d", v1.DeadLetterStream, n, deadLetters)
	}
	if _, err := js.Stream(ctx, "KV_"+v1.BuildsBucket); err != nil {
		t.Errorf("the bucket %s: %v", v1.BuildsBucket, err)
	}
	if _, err := js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer); err != nil {
		t.Errorf("the consumer %s: %v", v1.WorkersConsumer, err)
	}
	// The worker answered each send once (the attacker's own requests
	// since then: the PubAck, the status request, and Wait's status
	// request).
	if got, want := answered.Load(), sends+3; got != want {
		t.Errorf("%d answers on _R_. replies, want %d", got, want)
	}
}

func randomHex(t *testing.T, n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// lastMsg is the last message on subject in stream.
func lastMsg(ctx context.Context, js jetstream.JetStream, stream, subject string) (*jetstream.RawStreamMsg, error) {
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	return st.GetLastMsgForSubject(ctx, subject)
}

func streamMsgs(ctx context.Context, t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	return info.State.Msgs
}

// natsUser is one connection of the test as a NATS user, with the
// server's asynchronous errors (permission violations) it received.
type natsUser struct {
	nc   *nats.Conn
	mu   sync.Mutex
	errs []error
}

func (s *suite) connectAs(t *testing.T, opts ...nats.Option) *natsUser {
	t.Helper()
	u := &natsUser{}
	nc, err := nats.Connect(s.natsURL, append(opts,
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			u.mu.Lock()
			u.errs = append(u.errs, err)
			u.mu.Unlock()
		}))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	u.nc = nc
	return u
}

func (u *natsUser) errors() []error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]error(nil), u.errs...)
}

// events subscribes to tenant/name's progress events (before the request
// is published: the subscription is on the server when this returns).
func (u *natsUser) events(t *testing.T, tenant, name string) <-chan v1.Event {
	t.Helper()
	ch := make(chan v1.Event, 64)
	sub, err := u.nc.Subscribe(v1.EventSubject(tenant, name), func(m *nats.Msg) {
		var e v1.Event
		if json.Unmarshal(m.Data, &e) == nil {
			select {
			case ch <- e:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := u.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return ch
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
	var got []error
	eventuallyOK := func() bool {
		got = u.errors()
		for _, e := range got {
			if errors.Is(e, nats.ErrPermissionViolation) && strings.Contains(e.Error(), want) {
				return true
			}
		}
		return false
	}
	deadline := time.Now().Add(5 * time.Second)
	for !eventuallyOK() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s from the server; errors received: %v", want, got)
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
	inbox := u.nc.NewInbox()
	sub, err := u.nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := u.nc.PublishRequest(subject, inbox, []byte(payload)); err != nil {
		t.Fatal(err)
	}
	u.refused(t, "Publish", subject)
	if m, err := sub.NextMsg(300 * time.Millisecond); err == nil {
		t.Fatalf("request on %s answered: %s", subject, m.Data)
	}
}

// jsRefusedWait is how long a JetStream call the server refuses is given
// to fail (nothing answers it: the refusal itself is asserted apart).
const jsRefusedWait = 500 * time.Millisecond

// request asks one of the tenant API subjects as u (default inbox) and
// decodes the answer.
func request(t *testing.T, u *natsUser, subject, payload string, reply any) {
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
func (s *suite) tenantRequest(t *testing.T, tenant, name, content string) *v1.Request {
	t.Helper()
	dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f.txt /f.txt\n", "f.txt": content})
	up, err := s.store.ForTenant(tenant).UploadContext(context.Background(), dir, contexttar.Options{}, nil)
	if err != nil {
		t.Fatal(err)
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
