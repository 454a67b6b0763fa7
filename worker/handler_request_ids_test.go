package worker

// Handler (handle.go, process.go): a request's id is its tenant's. The
// Nats-Msg-Id JetStream dedupes on is the body's id; a refused message
// takes no other request's id, and two tenants' equal ids never meet
// (docs/design.md §1, §2 step 3).

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// The Nats-Msg-Id header JetStream dedupes on must be the body's id.
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestMsgIDHeaderMustMatchTheBody(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	for _, header := range []string{"someone-elses-id", ""} {
		req := request("header-" + header)
		req.APIVersion, req.RequestID = v1.APIVersion, "body-id-"+header
		body, _ := json.Marshal(req)
		m := nats.NewMsg(v1.RequestSubject("acme"))
		if header != "" {
			m.Header.Set(v1.MsgIDHeader, header)
		}
		m.Data = body
		if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range results.waitFor(t, 2, 10*time.Second) {
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(r.Data.Message, v1.MsgIDHeader) {
			t.Errorf("result %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
}

// decode refuses a message whose Nats-Msg-Id header differs from the
// body's requestId ("a body may not claim another id"), but invalid()
// then addresses the failed result — and the ledger entry — by the body's
// id. The body's id is taken all the same: its ledger entry is held by the
// bad message, so the genuine request with that id (another header, so
// JetStream does not drop it) is terminated as a duplicate with no result,
// and the results stream already holds an InvalidRequest under its id.
//
// Breaks invariant 1 for the genuine request and the point of the header
// check. Same-tenant only (the ledger key has the tenant).
//
// Origin: adversarial review of the issue-9 claim protocol, attack 6; failed on fa71058.
func TestMismatchedHeaderDoesNotTakeTheBodysRequestID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	victim := request("header-preempt")
	victim.APIVersion, victim.RequestID = v1.APIVersion, "victim-id"
	body, _ := json.Marshal(victim)
	m := nats.NewMsg(v1.RequestSubject("acme"))
	m.Header.Set(v1.MsgIDHeader, "forged-header")
	m.Data = body
	if _, err := e.js.PublishMsg(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	if r := results.waitFor(t, 1, 10*time.Second)[0]; r.Data.Reason != v1.ReasonInvalidRequest {
		t.Fatalf("forged message got %s", mustJSON(t, r))
	}
	// The genuine request, with its id in both places.
	if _, err := e.pub.Publish(context.Background(), victim); err != nil {
		t.Fatal(err)
	}
	name := kaniko.JobName(v1.BuildKey(victim, kanikoID))
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), name, metav1.GetOptions{}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the genuine request %s was never built; its results: %s", victim.RequestID, mustJSON(t, resultFor(results, victim.RequestID)))
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.kubelet(e.waitJob(name), 0, digestOf("header-preempt"))
	eventually(t, 10*time.Second, "the requests to be settled", func() bool {
		msgs, pending, _ := e.streamState()
		return msgs == 0 && pending == 0
	})
	for _, r := range e.resultsStored() {
		if r.ID == victim.RequestID && r.Data.Status == v1.StatusSucceeded {
			return
		}
	}
	t.Fatalf("no succeeded result stored under %s: %s", victim.RequestID, mustJSON(t, resultFor(results, victim.RequestID)))
}

// A refused request of mallory's takes and blocks only ids of mallory's:
// whatever tenant, id or header form her body and header name, its id
// is the subject's tenant's, and acme's request of the id she named is
// built and answered as if she had sent nothing.
//
// Origin: hostile-tenant review of 98418f0 (issue 23); refused there, kept as a regression test.
func TestRefusedRequestNeverTakesAnotherTenantsID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	ctx := context.Background()

	forged := request("refused-id")
	forged.APIVersion, forged.RequestID = v1.APIVersion, "build-7"
	body, _ := json.Marshal(forged) // tenant "acme" in the body, on mallory's subject
	for _, hdr := range []map[string]string{
		{v1.MsgIDHeader: "acme/build-7/nonce"},
		{v1.MsgIDHeader: "build-7"},
		{},
	} {
		if _, err := publishRaw(e.js, v1.RequestSubject("mallory"), hdr, body); err != nil {
			t.Fatal(err)
		}
	}
	// Two results: the bare header and no header both name mallory's
	// build-7 (one result id, mallory/build-7, the stream keeps once).
	got := results.waitFor(t, 2, 10*time.Second)
	time.Sleep(200 * time.Millisecond)
	for _, r := range results.snapshot() {
		if r.Data.Tenant != "mallory" || r.Data.Reason != v1.ReasonInvalidRequest {
			t.Fatalf("refusal %s", mustJSON(t, r))
		}
	}
	a := request("refused-id")
	a.RequestID = "build-7"
	ack, err := e.pub.Publish(ctx, a)
	if err != nil || ack.Duplicate {
		t.Fatalf("acme's publish: %+v %v", ack, err)
	}
	e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(a, kanikoID))), 0, digestOf("acme"))
	_ = got
	var mine []v1.Result
	eventually(t, 10*time.Second, "acme's result", func() bool {
		mine = nil
		for _, r := range results.snapshot() {
			if r.Data.Tenant == "acme" {
				mine = append(mine, r)
			}
		}
		return len(mine) > 0
	})
	time.Sleep(100 * time.Millisecond)
	if len(mine) != 1 || mine[0].ID != "build-7" || mine[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme's results: %s", mustJSON(t, mine))
	}
	if le := e.ledgerEntry("acme", "build-7"); le == nil || le.Result == nil || le.Result.Status != v1.StatusSucceeded {
		t.Fatalf("acme's ledger entry: %+v", le)
	}
}

// Two tenants that happen to use the same request id each get their own
// request built and their own result: JetStream's dedupe and the ledger
// are keyed by tenant and id.
//
// Origin: issue 10, tenants apart (fa71058).
func TestSameRequestIDInTwoTenants(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	a, m := request("id-acme"), mallorys("id-mallory")
	a.RequestID, m.RequestID = "build-42", "build-42"
	for _, r := range []*v1.Request{m, a} {
		ack, err := e.pub.Publish(context.Background(), r)
		if err != nil || ack.Duplicate {
			t.Fatalf("publish %s: %+v %v", r.Tenant, ack, err)
		}
	}
	for _, r := range []*v1.Request{a, m} {
		e.kubelet(e.waitJob(kaniko.JobName(v1.BuildKey(r, kanikoID))), 0, digestOf(r.Tenant))
	}
	got := results.waitFor(t, 2, 10*time.Second)
	byTenant := map[string]v1.ResultData{}
	for _, r := range got {
		byTenant[r.Data.Tenant] = r.Data
	}
	for _, tenant := range []string{"acme", "mallory"} {
		if d := byTenant[tenant]; d.Status != v1.StatusSucceeded || d.Digest != digestOf(tenant) {
			t.Errorf("%s: %s", tenant, mustJSON(t, d))
		}
	}
}

// A request on a subject whose tenant token is not a valid tenant is
// refused on the "_invalid" result subject, never on the tenant its body
// names.
//
// Origin: issue 10, tenants apart (fa71058).
func TestBodyNeverChoosesTheResultTenant(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	var victim []*nats.Msg
	var mu sync.Mutex
	sub, err := e.nc.Subscribe(v1.ResultsPrefix+".acme.>", func(m *nats.Msg) { mu.Lock(); victim = append(victim, m); mu.Unlock() })
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	r := request("forged")
	r.APIVersion, r.RequestID = v1.APIVersion, "acme-real-id"
	body, _ := json.Marshal(r)
	msg := nats.NewMsg("buildq.requests.NOT_A_LABEL")
	msg.Header.Set(v1.MsgIDHeader, r.RequestID)
	msg.Data = body
	if _, err := e.js.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if got.Data.Tenant != "_invalid" || got.Data.Reason != v1.ReasonInvalidRequest {
		t.Fatalf("result %s", mustJSON(t, got))
	}
	_ = e.nc.Flush()
	mu.Lock()
	defer mu.Unlock()
	if len(victim) != 0 {
		t.Fatalf("a forged result landed on acme's subject %s", victim[0].Subject)
	}
}
