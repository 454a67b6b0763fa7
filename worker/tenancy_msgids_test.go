package worker

// Tenancy across components: message ids and publish headers. JetStream
// dedupes BUILDQ_REQUESTS stream-wide and NATS permissions guard subjects,
// not headers: whatever ids and headers a tenant publishes on its own
// subject, no other tenant's request, requeue or answer is touched
// (docs/design.md §1, §2b, §2c).

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// Attack: JetStream dedupes BUILDQ_REQUESTS on Nats-Msg-Id stream-wide, and
// NATS permissions guard subjects, not headers. Mallory publishes anything
// on her own subject with the header "acme/build-42" — the exact
// Nats-Msg-Id acme's publisher will use for its request id "build-42".
// The worker refuses her message as invalid, but JetStream has already
// taken the id: acme's real request, published within the duplicate
// window, is dropped as a duplicate (PubAck.Duplicate) and never gets a
// result. Breaks invariant 8 ("its id ... are its tenant's alone") and
// invariant 1, and docs/design.md §1 ("two tenants' equal ids never drop
// each other's request"). Request ids are caller-chosen (deterministic ids
// such as a commit or a deploy number are what idempotent producers use).
//
// Origin: issue 10, second round of the hostile-tenant review; failed on f94e5fe, fixed by 1630b78.
func TestForgedMsgIDHeaderNeverDropsAnotherTenantsRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()

	m := mallorys("forged-header")
	m.APIVersion, m.RequestID = v1.APIVersion, "whatever"
	body, _ := json.Marshal(m)
	msg := nats.NewMsg(v1.RequestSubject("mallory"))
	msg.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", "build-42"))
	msg.Data = body
	if _, err := e.js.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	// Mallory's message is refused (header and body disagree).
	results.waitFor(t, 1, 10*time.Second)

	a := request("acme-build-42")
	a.RequestID = "build-42"
	ack, err := e.pub.Publish(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	if ack.Duplicate {
		t.Fatalf("acme's request %s was dropped by JetStream as a duplicate of mallory's message (header %s)",
			a.RequestID, v1.MsgID("acme", "build-42"))
	}
	e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(a, kanikoID))), 0, digestOf("acme"))
	got := byID(results.waitFor(t, 2, 10*time.Second))[a.RequestID]
	if len(got) != 1 || got[0].Data.Tenant != "acme" || got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's result: %s", mustJSON(t, got))
	}
}

// Mallory knows acme's (caller-chosen, deterministic) request id. The
// requeue's Nats-Msg-Id is "acme/<id>/requeue-<ledger revision>": no
// nonce, and the revision is a small counter. Mallory sprays those
// headers on her own subject (refused as invalid, but JetStream keeps
// each id in BUILDQ_REQUESTS's duplicate window, stream-wide). When
// acme's parked request is requeued, JetStream drops the republish as a
// duplicate, requeue() deletes the waiter entry anyway: acme's request is
// stranded without a result.
//
// Origin: adversarial review of parking (docs/design.md §2c), invariant 4; fixed by 9f3c611.
func TestForgedRequeueIDsNeverStrandAnotherTenant(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w := e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	short := request("forged-requeue")
	short.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, short); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(short, kanikoID)
	first := e.waitJob(kaniko.JobName(key))
	victim := request("forged-requeue")
	victim.RequestID = "deploy-1234" // a deterministic id
	victim.Timeout = v1.Duration{Duration: time.Hour}
	if _, err := e.pub.Publish(ctx, victim); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's request parked", func() bool { return parkedCount(t, w.w, key) == 1 })

	// Mallory sprays a blind range of revisions (she cannot read the
	// ledger): 1..400 covers a young bucket; a real attack sprays wider
	// and repeats within the 10 m window.
	m := mallorys("spray")
	m.APIVersion, m.RequestID = v1.APIVersion, "spray"
	body, _ := json.Marshal(m)
	for n := 1; n <= 400; n++ {
		msg := nats.NewMsg(v1.RequestSubject("mallory"))
		msg.Header.Set(v1.MsgIDHeader, v1.MsgID("acme", victim.RequestID)+"/requeue-"+strconv.Itoa(n))
		msg.Data = body
		if _, err := e.js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	// The claimer's own deadline ends the run: the victim is requeued.
	deadlineExceeded(t, e, first)
	eventually(t, 30*time.Second, "the short request's result", func() bool {
		return len(storedOf(results, "acme", short.RequestID)) == 1
	})
	// Let the victim's rebuild finish (its requeue holds a message until
	// then; mallory's spray is refused meanwhile).
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && len(storedOf(results, "acme", victim.RequestID)) == 0 {
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil && j.UID != first.UID && len(j.Status.Conditions) == 0 {
			e.kubelet(j, 0, tr.push(t, destination(j)))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if len(storedOf(results, "acme", victim.RequestID)) == 0 {
		le, _ := w.w.ledger.Get(ctx, "acme", victim.RequestID)
		t.Fatalf("STRANDED: acme's parked request %s has no result; ledger %+v, parked waiters %d, queue empty",
			victim.RequestID, le.E, parkedCount(t, w.w, key))
	}
}

// mine() (build.go) and own()'s origin compare a record's RequestID and
// Seq, not its tenant. The requeue headers let mallory choose the Seq her
// ledger entry holds: with acme's (caller-chosen) request id, acme's
// message sequence (bracketed by her own PubAcks) and the same content
// (the documented capability), her request is taken for the claimer of
// acme's failed run and answered with acme's own-input failure
// (DeadlineExceeded of acme's 1-minute timeout, although she asked for
// 2 h), origin "build", and she "owns" the run's clean-up.
//
// Origin: adversarial review of parking (docs/design.md §2c), invariants 2 and 4; fixed by 9f3c611.
func TestForgedRequeueTokenNeverTakesAnotherTenantsFailure(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()
	ctx := context.Background()

	probe := mallorys("bracket")
	ack0, err := e.pub.Publish(ctx, probe)
	if err != nil {
		t.Fatal(err)
	}
	a := request("forged-seq")
	a.RequestID = "release-42"
	a.Timeout = v1.Duration{Duration: time.Minute}
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	guess := ack0.Sequence + 1 // mallory's guess of acme's sequence
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	deadlineExceeded(t, e, job)
	eventually(t, 30*time.Second, "acme's result", func() bool { return len(storedOf(results, "acme", a.RequestID)) == 1 })

	m := mallorys("forged-seq")
	m.APIVersion, m.RequestID = v1.APIVersion, a.RequestID
	m.Timeout = v1.Duration{Duration: 2 * time.Hour}
	body, _ := json.Marshal(m)
	msg := nats.NewMsg(v1.RequestSubject("mallory"))
	msg.Header.Set(v1.MsgIDHeader, v1.MsgID("mallory", m.RequestID)+"/requeue-1")
	// The token is the worker's secret: mallory can only guess one (and
	// the sequence she would have claimed is no header any more).
	msg.Header.Set(ledger.RequeueTokenHeader, fmt.Sprintf("%032d", guess))
	msg.Data = body
	if _, err := e.js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if rs := storedOf(results, "mallory", m.RequestID); len(rs) > 0 {
			if d := rs[0].Data; d.Reason == v1.ReasonDeadlineExceeded {
				t.Fatalf("mallory (timeout 2h) was answered with acme's own-input failure: %s (message %q)", decision(d), d.Message)
			}
			return
		}
		if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{}); err == nil && j.UID != job.UID && len(j.Status.Conditions) == 0 {
			e.kubelet(j, 0, tr.push(t, destination(j)))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("mallory got no result")
}

// Attack (ids, nonces and requeue tokens read from the stream): JetStream
// honours Nats-Expected-Last-Msg-Id on BUILDQ_REQUESTS (no stream setting
// turns it off), and when it does not match, the PubAck's error quotes the
// stream's last message id — whoever published it. Mallory's failed probe
// stores nothing, so by probing on her own subject she reads the
// Nats-Msg-Id of the request any tenant published last: its tenant, its
// request id and its nonce. That much is a known limit of one stream for
// every tenant (docs/design.md §2b): the id gives her no power — ids are
// per tenant, the nonce guards only against a header published first, and
// a published header is no longer first. What must not leak is what would
// give power: a requeue's id showed the requeue token, from which every
// later requeue's id follows, so she could publish one first and have
// JetStream drop acme's requeue (requeueMsgID now hides the token). And a
// leaked request header, published again on her own subject, is dropped
// by the duplicate window, touching nothing of acme's.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); failed there, fixed by 26b1795.
func TestExpectedLastMsgIDLeaksNothingThatGivesPower(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	store := newObjectStore()
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	probe := func(t *testing.T) string {
		t.Helper()
		_, err := publishRaw(e.js, v1.RequestSubject("mallory"), map[string]string{
			v1.MsgIDHeader:              v1.MsgID("mallory", "probe-"+nats.NewInbox()[7:]),
			"Nats-Expected-Last-Msg-Id": "mallory-guess",
		}, []byte(`{}`))
		if err == nil {
			t.Fatal("the probe was stored")
		}
		return err.Error()
	}

	t.Run("a leaked request header gives no power", func(t *testing.T) {
		digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a /a\n", "a": "1"})
		a := tenantRequestFor("acme", digest)
		a.RequestID = "acme-release-2026-12-01-prod"
		store.put(a.Source.S3.Key, archive)
		if _, err := e.pub.Publish(ctx, a); err != nil {
			t.Fatal(err)
		}
		leaked := probe(t)
		i := strings.Index(leaked, "acme/")
		if i < 0 {
			t.Fatalf("the probe no longer reads the stream's last message id (%s): docs/design.md §2b's known limit is gone; say so there and here", leaked)
		}
		header := leaked[i:]
		// Replayed on her own subject: a duplicate, stored nowhere.
		if ack, err := publishRaw(e.js, v1.RequestSubject("mallory"), map[string]string{v1.MsgIDHeader: header}, []byte(`{}`)); err != nil || !ack.Duplicate {
			t.Fatalf("mallory's replay of acme's header %q: %+v, %v; want a duplicate", header, ack, err)
		}
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(a, kanikoID))), 0, digestOf("acme"))
		if r := oneResult(t, results, a.RequestID); r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("acme: %s", mustJSON(t, r))
		}
	})

	t.Run("requeue token", func(t *testing.T) {
		digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY a /a\n", "a": "2"})
		a := tenantRequestFor("acme", digest)
		store.put(a.Source.S3.Key, archive)
		key := v1.BuildKey(a, kanikoID)
		// Mallory claims the key (she holds the content too), acme's
		// request parks on her run, her run fails for her own input (her
		// repository refuses the push): acme's request is requeued.
		m := tenantRequestFor("mallory", digest)
		store.put(m.Source.S3.Key, archive)
		if _, err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
		j1 := e.waitJob(kaniko.JobName(key))
		if _, err := e.pub.Publish(ctx, a); err != nil {
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, "acme's request parked", func() bool { return e.parkedAs(key, "acme", a.RequestID) })
		token := e.ledgerEntry("acme", a.RequestID).RequeueToken
		e.kubelet(j1, 1, "error pushing image: failed to push to destination "+destination(j1)+": unauthorized")
		eventually(t, 10*time.Second, "acme's request requeued", func() bool { return !e.parkedAs(key, "acme", a.RequestID) })
		time.Sleep(100 * time.Millisecond)
		if got := probe(t); token != "" && strings.Contains(got, token) {
			t.Errorf("mallory's probe reads the requeue token of acme's parked request (%s): %s", token, got)
		}
		var r2 *v1.BuildRecord
		eventually(t, 10*time.Second, "acme's own run", func() bool {
			r2 = e.claim(key)
			return r2 != nil && r2.Tenant == "acme" && r2.State == v1.StateBuilding
		})
		e.kubelet(e.runJob(key, r2.Run), 0, digestOf("acme2"))
		if r := oneResult(t, results, a.RequestID); r.Data.Status != v1.StatusSucceeded {
			t.Fatalf("acme: %s", mustJSON(t, r))
		}
	})
}

// JetStream's publish controls a tenant can put on its request: the
// stream has no rollup, TTL, schedules, counters or atomic batches, so
// the server refuses those outright; Nats-Msg-Id and the Nats-Expected-*
// checks are honoured (see TestExpectedLastMsgIDLeaksNothingThatGivesPower
// for what their errors tell), and intake strips every Nats-* header
// before the queue (TestJetStreamHeaderNeverStrandsARequestInIntake).
// None of them lets mallory's publish touch another subject's messages.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); refused there, kept as a regression test.
func TestJetStreamPublishControlsOnRequestsTouchNothingElse(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// The streams, with no worker to take the requests: acme's waits in
	// the work queue.
	if _, _, err := EnsureStreams(context.Background(), e.js, testConfig("setup")); err != nil {
		t.Fatal(err)
	}
	a := request("controls")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	body := []byte(`{}`)
	refused := []map[string]string{
		{"Nats-Rollup": "all"},
		{"Nats-Rollup": "sub"},
		{"Nats-TTL": "1s"},
		{"Nats-Schedule": "@at 2030-01-01T00:00:00Z", "Nats-Schedule-Target": v1.RequestSubject("acme")},
		{"Nats-Incr": "1"},
		{"Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1", "Nats-Batch-Commit": "1"},
		{"Nats-Expected-Stream": "KV_buildq-builds"},
	}
	for _, h := range refused {
		if ack, err := publishRaw(e.js, v1.RequestSubject("mallory"), h, body); err == nil {
			t.Errorf("headers %v: stored (%+v)", h, ack)
		}
	}
	// Stored as an ordinary message of hers (the marker headers are
	// only the server's to act on).
	for _, h := range []map[string]string{{"Nats-Marker-Reason": "Purge"}, {"Nats-Schedule-Rollup": "all"}} {
		_, _ = publishRaw(e.js, v1.RequestSubject("mallory"), h, body)
	}
	st, err := e.js.Stream(context.Background(), v1.RequestsStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(context.Background(), v1.RequestSubject("acme"))
	if err != nil {
		t.Fatalf("acme's request is gone: %v", err)
	}
	if !strings.Contains(string(m.Data), a.RequestID) {
		t.Fatalf("acme's stored request changed: %s", m.Data)
	}
}
