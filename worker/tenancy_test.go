package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
)

// Attacks of one tenant on another (issue 10). Tenant "acme" is the victim,
// "mallory" the attacker; both publish on their own request subjects.

func mallorys(seed string) *v1.Request {
	r := request(seed)
	r.Tenant = "mallory"
	r.Source.S3.Key = strings.Replace(r.Source.S3.Key, "contexts/acme/", "contexts/mallory/", 1)
	return r
}

// A request may name only its own tenant's context objects.
func TestRequestCannotNameAnotherTenantsContext(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	m := mallorys("other-context")
	m.Source.S3.Key = "contexts/acme/sha256/" + hex64("acme's") + ".tar.gz"
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(r.Data.Message, "contexts/mallory/") {
		t.Fatalf("result %s", mustJSON(t, r))
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
}

// Mallory names acme's repository as her destination: refused before
// anything is created — no Job, no copy of a cached image, no tag moved.
func TestTenantCannotPushIntoAnotherTenantsRepository(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	// acme builds key K into its own repository.
	victim := e.buildThrough(t, tr, results, request("victim-web"), 1)
	if victim.Data.Status != v1.StatusSucceeded {
		t.Fatalf("victim %s", mustJSON(t, victim))
	}
	for _, seed := range []string{"mallory-new-key", "victim-web"} { // a new key, and K (cached)
		r := mallorys(seed)
		r.Image = tr.host + "/acme/web"
		r.Tags = []string{"latest"}
		if _, err := e.pub.Publish(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	got := results.waitFor(t, 3, 10*time.Second)[1:]
	for _, r := range got {
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonInvalidRequest ||
			!strings.Contains(r.Data.Message, tr.host+"/mallory/**") {
			t.Errorf("mallory's push into acme/web: %s", mustJSON(t, r))
		}
	}
	if n := e.creates.total(); n != 1 {
		t.Errorf("%d jobs created, want only acme's", n)
	}
	ref, _ := name.ParseReference(tr.host+"/acme/web:latest", name.Insecure)
	if _, err := remote.Head(ref); err == nil {
		t.Error("acme/web:latest exists: mallory's request moved a tag in acme's repository")
	}
}

// Mallory pushes an image of her own under the tag acme's build key will
// use, in her repository, and asks for that key: the tag answers her own
// request only. acme's request for the key is built, not answered with
// mallory's image.
func TestPlantedTagAnswersOnlyItsPusher(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	victimReq := request("shared-content")
	key := v1.BuildKey(victimReq, kanikoID)
	evil := tr.push(t, tr.host+"/mallory/evil:"+v1.DefaultTag(key))
	m := mallorys("shared-content") // the same content, so the same key
	m.Image = tr.host + "/mallory/evil"
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	mr := results.waitFor(t, 1, 10*time.Second)[0]
	if mr.Data.Status != v1.StatusSucceeded || mr.Data.Origin != v1.OriginCache || mr.Data.Digest != evil {
		t.Fatalf("mallory %s", mustJSON(t, mr))
	}
	if rec := e.claim(key); rec != nil {
		t.Fatalf("a tag found in the registry entered the shared index: %+v", rec)
	}
	vr := e.buildThrough(t, tr, results, victimReq, 2)
	if vr.Data.Digest == evil || vr.Data.Origin != v1.OriginBuild {
		t.Fatalf("acme got %s; mallory's planted image is %s", mustJSON(t, vr), evil)
	}
}

// harborSpy is a Registry that records the Harbor projects it is asked to
// create and finds no image.
type harborSpy struct {
	mu       sync.Mutex
	projects []string
}

func (h *harborSpy) Head(context.Context, string) (string, error) { return "", registry.ErrNotFound }
func (h *harborSpy) Copy(context.Context, string, string) (string, error) {
	return "", errors.New("not used")
}
func (h *harborSpy) EnsureHarborProject(_ context.Context, _, project string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.projects = append(h.projects, project)
	return nil
}

// With Harbor, a request creates only its own tenant's project.
func TestHarborProjectIsOnlyTheTenantsOwn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	spy := &harborSpy{}
	e.startWorker("w1", func(c *Config) {
		c.Registry = spy
		c.Naming.Harbor = true
		c.Naming.Allowed = []string{"{registry}/**"} // an operator who lets anyone push anywhere
	})
	results := e.collect()
	m := mallorys("harbor")
	m.Image = "registry.test:5000/victim-project/web"
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	own := mallorys("harbor-own")
	if _, err := e.pub.Publish(context.Background(), own); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "two jobs", func() bool { return e.creates.total() == 2 })
	spy.mu.Lock()
	defer spy.mu.Unlock()
	if len(spy.projects) != 1 || spy.projects[0] != "mallory" {
		t.Fatalf("harbor projects created: %v, want only [mallory]", spy.projects)
	}
	_ = results
}

// Two tenants that happen to use the same request id each get their own
// request built and their own result: JetStream's dedupe and the ledger
// are keyed by tenant and id.
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

// mapContexts serves context objects from memory.
type mapContexts map[string][]byte

func (m mapContexts) Open(_ context.Context, _, key string) (io.ReadCloser, error) {
	b, ok := m[key]
	if !ok {
		return nil, s3store.ErrNotFound
	}
	return io.NopCloser(bytes.NewReader(b)), nil
}

// packDir packs files with contexttar and returns the digest and tar.gz.
func packDir(t *testing.T, files map[string]string) (string, []byte) {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	res, err := contexttar.Write(context.Background(), dir, &buf, contexttar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return res.Digest, buf.Bytes()
}

// The local executor builds only the bytes the request's contextDigest
// names: bytes someone planted under that object name are refused.
func TestLocalExecutorRefusesAPlantedContext(t *testing.T) {
	t.Parallel()
	digest, _ := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "the victim's"})
	_, planted := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "mallory's"})
	key := s3store.TenantContextKey("acme", digest)
	l := NewLocalBackend(mapContexts{key: planted}, noPusher{}, t.TempDir(), 0)
	req := request("planted")
	req.ContextDigest = digest
	req.Source = v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: key}}
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	out, err := l.Run(context.Background(), b, func(string, bool, string) {})
	if err != nil || out.Succeeded || out.Reason != v1.ReasonContextMismatch {
		t.Fatalf("planted context: %+v, %v", out, err)
	}
	// The genuine bytes get past the check (to the push, which this test's
	// pusher refuses).
	_, genuine := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "the victim's"})
	l = NewLocalBackend(mapContexts{key: genuine}, noPusher{}, t.TempDir(), 0)
	out, err = l.Run(context.Background(), b, func(string, bool, string) {})
	if err != nil || out.Reason != v1.ReasonPushFailed {
		t.Fatalf("genuine context: %+v, %v", out, err)
	}
}

// Mallory's request claims a key acme's request then joins. Mallory
// cancels the key: her request is canceled, acme's build goes on and
// succeeds.
func TestCancelOfASharedBuildSparesOtherTenants(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.Lease = time.Second })
	events := e.events()
	results := e.collect()
	m := mallorys("shared-cancel")
	if _, err := e.pub.Publish(context.Background(), m); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(m, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	a := request("shared-cancel")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "acme's request to join", func() bool { return events.has(a.RequestID, v1.PhaseWaiting) })

	rep := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), key)
	if !rep.Canceled || rep.Requests != 1 || rep.Stopped {
		t.Fatalf("mallory's cancel: %+v", rep)
	}
	if mr := results.waitFor(t, 1, 10*time.Second)[0]; mr.ID != m.RequestID || mr.Data.Status != v1.StatusCanceled {
		t.Fatalf("first result %s", mustJSON(t, mr))
	}
	if e.jobGone(job.Name)() {
		t.Fatal("mallory's cancel deleted the job acme waits on")
	}
	// Acme's request takes the run over and adopts the Job.
	eventually(t, 10*time.Second, "the run to be taken over", func() bool {
		r := e.claim(key)
		return r != nil && r.State == v1.StateBuilding && r.Owner != ""
	})
	// The run pushes where its Job says (mallory's repository); acme's
	// request gets the image copied into its own.
	digest := tr.push(t, destination(job))
	e.kubelet(job, 0, digest)
	ar := byID(results.waitFor(t, 2, 15*time.Second))[a.RequestID]
	if len(ar) != 1 || ar[0].Data.Status != v1.StatusSucceeded || ar[0].Data.Digest != digest ||
		!strings.HasPrefix(ar[0].Data.Image, tr.host+"/acme/") {
		t.Fatalf("acme got %s", mustJSON(t, ar))
	}
}

// The status service shows a tenant its own requests and builds only.
func TestStatusShowsOnlyTheTenantsOwn(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	a := request("status-own")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	e.kubelet(e.waitJob(kaniko.JobName(key)), 0, digestOf("status"))
	results.waitFor(t, 1, 10*time.Second)

	ask := func(tenant, target string) v1.StatusReply {
		t.Helper()
		m, err := tenantAPIRequest(e.nc, tenant, v1.APIStatusSubject(tenant), target, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var rep v1.StatusReply
		if err := json.Unmarshal(m.Data, &rep); err != nil {
			t.Fatal(err)
		}
		return rep
	}
	own := ask("acme", a.RequestID)
	if own.Request == nil || own.Request.Result == nil || own.Request.Result.Digest != digestOf("status") || own.Build == nil {
		t.Fatalf("acme's own status: %+v", own)
	}
	for _, target := range []string{a.RequestID, key} {
		if rep := ask("mallory", target); rep.Request != nil || rep.Build != nil || rep.Error == "" {
			t.Errorf("mallory's status of acme's %s: %+v", target, rep)
		}
	}
}

// TestTakeOverBuildsAsTheClaimer: a run taken over by another tenant's
// request still builds as the run's claimer — its tenant and name label
// the Job and pick the registry Secret it mounts, as its repository is
// where the run pushes.
func TestTakeOverBuildsAsTheClaimer(t *testing.T) {
	t.Parallel()
	acme := request("takeover")
	w := &builder{Worker: &Worker{cfg: Config{Now: time.Now}}}
	claim := w.newClaim(acme, "k", "registry.test/acme/takeover", []string{"registry.test/acme/takeover:abc"}, 1)
	taker := request("takeover")
	taker.Tenant, taker.Name = "mallory", "other-name"
	r := runRequest(taker, claim)
	if r.Tenant != acme.Tenant || r.Name != acme.Name || taker.Tenant != "mallory" {
		t.Fatalf("the run builds as %s/%s, want the claimer %s/%s", r.Tenant, r.Name, acme.Tenant, acme.Name)
	}
}

// With ContextBucket set, a context in any other bucket is refused before
// anything is created (the worker's keys may reach other buckets).
func TestRequestCannotNameAnotherBucket(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", func(c *Config) { c.ContextBucket = "buildq" })
	results := e.collect()
	r := request("other-bucket")
	r.Source.S3.Bucket = "another-teams-bucket"
	if _, err := e.pub.Publish(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if got.Data.Status != v1.StatusFailed || got.Data.Reason != v1.ReasonInvalidRequest || !strings.Contains(got.Data.Message, `contexts must be in bucket "buildq"`) {
		t.Fatalf("result %s", mustJSON(t, got))
	}
	if n := e.creates.total(); n != 0 {
		t.Fatalf("%d jobs created", n)
	}
}

// A context prefix must hold {tenant} as a whole path segment: with
// "contexts/{tenant}" tenant acme could name contexts/acme-corp/….
func TestContextPrefixNeedsATenantSegment(t *testing.T) {
	t.Parallel()
	for prefix, ok := range map[string]bool{"contexts/{tenant}/": true, "": true, "contexts/{tenant}": false, "contexts/": false} {
		c := Config{ContextPrefix: prefix}.WithDefaults()
		if err := c.Validate(); (err == nil) != ok {
			t.Errorf("ContextPrefix %q: Validate() = %v, want ok=%v", prefix, err, ok)
		}
	}
}

// TestAPIAnswersOnlyOnATenantsOwnReplies: NATS checks the subject a client
// publishes to, never the reply subject it names. A tenant API request
// whose reply is a bucket's $KV subject, the workers' inbox, another
// tenant's inbox or a stream's subject is dropped unanswered and counted;
// the tenant's own inbox is answered. (A service import's reply, _R_.…,
// cannot be sent by a client at all — nats-server refuses it as reserved —
// so the worker sees one only from an import: tenantapi's TestReplyAllowed, and
// integration/natsauth_test.go on the account per tenant.)
// (Issue 23: a tenant in the workers' account had the worker's answers
// written into buildq-requests and buildq-builds.)
func TestAPIAnswersOnlyOnATenantsOwnReplies(t *testing.T) {
	t.Parallel()
	e := setup(t)
	reg := prometheus.NewRegistry()
	metrics := NewMetrics(reg)
	e.startWorker("w1", func(c *Config) { c.Metrics = metrics })
	// A responder is there once a legitimate request is answered.
	eventually(t, 5*time.Second, "the status service", func() bool {
		_, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), "nothing", time.Second)
		return err == nil
	})

	hostile := []string{
		"$KV." + v1.BuildsBucket + "." + hex64("k"),
		"$KV.buildq-requests.x",
		"$KV." + v1.SlotsBucket + ".acme.0",
		"_INBOX.abc.def",
		v1.InboxPrefix("globex") + ".abc",
		v1.InboxPrefix("acme"), // the prefix alone is no inbox
		"_INBOX_acme-corp.x",   // another tenant whose name starts with acme
		v1.ResultSubject("globex", "web"),
		"buildq.requests.globex",
		"buildq.internal.cancel",
		"$JS.API.STREAM.DELETE." + v1.RequestsStream,
	}
	spy, err := e.nc.SubscribeSync(">")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = spy.Unsubscribe() }()
	if err := e.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	subjects := []string{v1.APIStatusSubject("acme"), v1.APICancelSubject("acme"), v1.CancelSubject("acme", "web")}
	for _, reply := range hostile {
		for _, subj := range subjects {
			if err := e.nc.PublishRequest(subj, reply, []byte(hex64("k"))); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := float64(len(hostile) * len(subjects))
	eventually(t, 10*time.Second, "every hostile reply counted", func() bool {
		return testutil.ToFloat64(metrics.refused.WithLabelValues("acme")) == want
	})
	// Nothing was published on any of the hostile replies.
	for {
		m, err := spy.NextMsg(200 * time.Millisecond)
		if err != nil {
			break
		}
		if slices.Contains(hostile, m.Subject) {
			t.Errorf("the worker answered on %s: %s", m.Subject, m.Data)
		}
	}
	if n, _, _ := e.streamState(); n != 0 {
		t.Errorf("%d request messages stored", n)
	}

	// The tenant's own inbox is still answered.
	if _, err := tenantAPIRequest(e.nc, "acme", v1.APIStatusSubject("acme"), "nothing", 5*time.Second); err != nil {
		t.Fatalf("acme's own inbox: %v", err)
	}
	if got := testutil.ToFloat64(metrics.refused.WithLabelValues("acme")); got != want {
		t.Errorf("refused replies: %v, want %v", got, want)
	}
}
