package worker

// Tenant API (worker/internal/tenantapi): status and cancel answer a
// tenant about its own requests and builds only, and tell it nothing of
// another tenant's (docs/design.md §2b, §3).

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// The status service shows a tenant its own requests and builds only.
//
// Origin: issue 10, tenancy tests (fbfd804).
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

// Status and cancel of a build key answer mallory the same whether acme's
// build of it runs, or nobody ever built it; neither stops acme's build.
//
// Origin: second hostile-tenant review, of 26b1795; handled there, kept as a regression test.
func TestForeignKeyStatusAndCancelTellNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	store := newFaultyStore()
	e.startWorker("w1", func(c *Config) { c.Contexts = store })
	results := e.collect()
	ctx := context.Background()

	digest, archive := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY k /k\n", "k": "running"})
	a := tenantRequestFor("acme", digest)
	store.put(a.Source.S3.Key, archive)
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	job := e.waitJob(kaniko.JobName(key))
	unknown := hex64("a key nobody built")
	ask := func(subject, target string) string {
		t.Helper()
		m, err := tenantAPIRequest(e.nc, "mallory", subject, target, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return strings.ReplaceAll(string(m.Data), target, "<key>")
	}
	for _, subject := range []string{v1.APIStatusSubject("mallory"), v1.APICancelSubject("mallory"), v1.CancelSubject("mallory", "web")} {
		running, none := ask(subject, key), ask(subject, unknown)
		if running != none {
			t.Errorf("%s: acme's running key %s, a key nobody built %s", subject, running, none)
		}
		// acme's request id is mallory's unknown id.
		if byAcmeID, unknownID := ask(subject, a.RequestID), ask(subject, "no-such-id-0"); strings.ReplaceAll(byAcmeID, "<key>", "x") != strings.ReplaceAll(unknownID, "<key>", "x") {
			t.Errorf("%s: acme's request id %s, an unknown id %s", subject, byAcmeID, unknownID)
		}
	}
	if rec := e.claim(key); rec == nil || rec.State != v1.StateBuilding {
		t.Fatalf("acme's build after mallory's cancels: %+v", rec)
	}
	e.kubelet(job, 0, digestOf("acme built"))
	if r := oneResult(t, results, a.RequestID); r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("acme: %s", mustJSON(t, r))
	}
}

// Attack: the status service hides another tenant's build (same error for
// a key acme built as for a key nobody built), but the cancel service
// answers a bare build key with the state of whatever build holds it:
// "no build is known", "the build already finished: failed", or "no
// request of tenant mallory waits" (building). Mallory learns, for any
// predictable key, whether acme built it, is building it, and whether it
// failed — which the status service refuses her. Breaks invariant 8
// ("status and cancel are its tenant's alone").
//
// Origin: issue 10, second round of the hostile-tenant review; failed on f94e5fe, fixed by 1630b78.
func TestCancelRepliesRevealNoOtherTenantsBuild(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.startWorker("w1", nil)
	results := e.collect()
	a := request("cancel-oracle")
	if _, err := e.pub.Publish(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	e.kubelet(e.waitJob(kaniko.JobName(key)), 1, "error building image: secret step failed")
	results.waitFor(t, 1, 10*time.Second)

	unknown := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), hex64("nobody built this"))
	acmes := cancelRequest(t, e.nc, v1.APICancelSubject("mallory"), key)
	if acmes.Canceled || acmes.Stopped {
		t.Fatalf("mallory canceled acme's build: %+v", acmes)
	}
	if strings.ReplaceAll(acmes.Message, key, "K") != strings.ReplaceAll(unknown.Message, hex64("nobody built this"), "K") {
		t.Errorf("mallory's cancel tells acme's key from an unknown one:\n  acme's:  %q\n  unknown: %q", acmes.Message, unknown.Message)
	}
}
