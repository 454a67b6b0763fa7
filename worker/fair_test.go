package worker

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// tenantRequest is request(seed) of another tenant.
func tenantRequest(tenant, seed string) *v1.Request {
	r := request(tenant + "/" + seed)
	r.Tenant = tenant
	r.Source.S3.Key = strings.Replace(r.Source.S3.Key, "contexts/acme/", "contexts/"+tenant+"/", 1)
	return r
}

func jobOf(r *v1.Request) string {
	return kaniko.JobName(v1.BuildKey(r, "kaniko@"+testKaniko.ExecutorImage))
}

// jobs lists the Jobs that exist now by name.
func (e *env) jobs() map[string]*batchv1.Job {
	e.t.Helper()
	l, err := e.kube.BatchV1().Jobs(testNamespace).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]*batchv1.Job{}
	for i := range l.Items {
		out[l.Items[i].Name] = &l.Items[i]
	}
	return out
}

// running counts the Jobs of each tenant's requests that exist now.
func (e *env) running(byJob map[string]string) map[string]int {
	out := map[string]int{}
	for name := range e.jobs() {
		if t, ok := byJob[name]; ok {
			out[t]++
		}
	}
	return out
}

// nextJob waits for a Job among names that is not in seen and returns it.
func (e *env) nextJob(names map[string]string, seen map[string]bool) (string, *batchv1.Job) {
	e.t.Helper()
	var name string
	var job *batchv1.Job
	eventually(e.t, 10*time.Second, "the next Job", func() bool {
		for n, j := range e.jobs() {
			if _, ok := names[n]; ok && !seen[n] {
				name, job = n, j
				return true
			}
		}
		return false
	})
	seen[name] = true
	return name, job
}

// waitAdmitted waits until n requests sit in the tenants' queues.
func (e *env) waitAdmitted(n uint64) {
	e.t.Helper()
	eventually(e.t, 10*time.Second, fmt.Sprintf("%d requests admitted", n), func() bool {
		q, err := ReadQueueState(context.Background(), e.js)
		return err == nil && q.Messages == n && e.intakeEmpty()
	})
}

func (e *env) intakeEmpty() bool {
	s, err := e.js.Stream(context.Background(), v1.RequestsStream)
	if err != nil {
		return false
	}
	si, err := s.Info(context.Background())
	return err == nil && si.State.Msgs == 0
}

// A tenant with a backlog does not shut another out: with acme's 40
// requests queued behind its running build, globex's one request is the
// next to start when the slot frees.
func TestFairShareBacklogDoesNotShutOthersOut(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.MaxInFlight = 1 })
	results := e.collect()
	ctx := context.Background()
	names := map[string]string{}
	var first *v1.Request
	for i := range 40 {
		r := tenantRequest("acme", fmt.Sprint("backlog-", i))
		names[jobOf(r)] = "acme"
		if first == nil {
			first = r
		}
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]bool{}
	n, job := e.nextJob(names, seen)
	if names[n] != "acme" {
		t.Fatalf("first Job %s", n)
	}
	e.waitAdmitted(40)
	b := tenantRequest("globex", "one")
	names[jobOf(b)] = "globex"
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(41)
	e.kubelet(job, 0, tr.push(t, destination(job)))
	n, job = e.nextJob(names, seen)
	if n != jobOf(b) {
		t.Fatalf("after acme's build, %s (%s) started, want globex's request", n, names[n])
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, 2, 10*time.Second)
	if got[1].Data.Tenant != "globex" || got[1].Data.Status != v1.StatusSucceeded {
		t.Fatalf("second result %s", mustJSON(t, got[1]))
	}
}

// Weights divide the slots: acme of weight 2 runs twice as many requests
// as globex while both have backlogs.
func TestFairShareFollowsWeights(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	// The streams, before any worker takes a request.
	sw, err := New(e.nc, nil, testConfig("setup"))
	if err != nil {
		t.Fatal(err)
	}
	if err := sw.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	names := map[string]string{}
	for i := range 10 {
		for _, tenant := range []string{"acme", "globex"} {
			r := tenantRequest(tenant, fmt.Sprint("w-", i))
			names[jobOf(r)] = tenant
			if _, err := e.pub.Publish(ctx, r); err != nil {
				t.Fatal(err)
			}
		}
	}
	e.startWorker("w1", func(c *Config) {
		c.MaxInFlight = 6
		c.Fair.Weights = map[string]int{"acme": 2}
	})
	eventually(t, 10*time.Second, "six Jobs", func() bool { return len(e.jobs()) == 6 })
	// The first six may be taken while intake is still admitting the
	// backlog (a tenant not queued yet gets no share). Once all are
	// admitted, each slot that frees goes to the tenant with the fewest
	// running per weight: end the first six, acme's first, and the
	// slots settle at 4:2 whatever the first fill was.
	e.waitAdmitted(20)
	first := e.jobs()
	for _, tenant := range []string{"acme", "globex"} {
		for name, job := range first {
			if names[name] != tenant {
				continue
			}
			e.kubelet(job, 0, digestOf(name))
			eventually(t, 10*time.Second, "a new Job in the freed slot", func() bool {
				now := e.jobs()
				_, still := now[name]
				return !still && len(now) == 6
			})
		}
	}
	if got := e.running(names); got["acme"] != 4 || got["globex"] != 2 {
		t.Fatalf("running %v, want acme 4 and globex 2 (weights 2:1)", got)
	}
}

// A tenant's concurrency limit holds across workers: acme, limited to 2,
// never runs a third build while 3 workers have free slots; it waits
// (no failure, no redelivery) and its next request starts when one ends.
// Another tenant is not held back by it.
func TestConcurrencyLimitIsExactAcrossWorkers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for i := range 3 {
		e.startWorker(fmt.Sprintf("w%d", i), func(c *Config) {
			withRegistry(tr)(c)
			c.MaxInFlight = 3
			c.Fair.Concurrency = map[string]int{"acme": 2}
		})
	}
	results := e.collect()
	ctx := context.Background()
	names := map[string]string{}
	for i := range 6 {
		r := tenantRequest("acme", fmt.Sprint("limit-", i))
		names[jobOf(r)] = "acme"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		r := tenantRequest("globex", fmt.Sprint("free-", i))
		names[jobOf(r)] = "globex"
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "acme 2 and globex 3 running", func() bool {
		got := e.running(names)
		return got["acme"] == 2 && got["globex"] == 3
	})
	for range 20 { // it stays at the limit
		if got := e.running(names); got["acme"] > 2 {
			t.Fatalf("acme runs %d builds, its limit is 2", got["acme"])
		}
		time.Sleep(50 * time.Millisecond)
	}
	// One ends: the next starts, and acme is still at 2.
	var ended string
	for n, j := range e.jobs() {
		if names[n] == "acme" {
			ended = n
			e.kubelet(j, 0, tr.push(t, destination(j)))
			break
		}
	}
	eventually(t, 10*time.Second, "acme's next build", func() bool {
		js := e.jobs()
		_, still := js[ended]
		return !still && e.running(names)["acme"] == 2
	})
	if got := results.snapshot(); len(got) != 1 || got[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("results %+v, want the one finished build's", got)
	}
	if _, _, redelivered := e.streamState(); redelivered != 0 {
		t.Fatalf("%d requests redelivered: a tenant at its limit must not burn deliveries", redelivered)
	}
}

// Within a tenant, high goes before normal before low, whatever the order
// they were submitted in.
func TestPrioritiesWithinATenant(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) { withRegistry(tr)(c); c.MaxInFlight = 1 })
	ctx := context.Background()
	names := map[string]string{}
	block := tenantRequest("acme", "block")
	names[jobOf(block)] = "block"
	if _, err := e.pub.Publish(ctx, block); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	_, job := e.nextJob(names, seen)
	for _, p := range []string{"low", "", "high", "low", "high"} {
		r := tenantRequest("acme", "prio-"+p+fmt.Sprint(len(names)))
		r.Priority = p
		names[jobOf(r)] = p
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	e.waitAdmitted(6)
	var order []string
	for range 5 {
		e.kubelet(job, 0, tr.push(t, destination(job)))
		var n string
		n, job = e.nextJob(names, seen)
		order = append(order, names[n])
	}
	if got, want := strings.Join(order, ","), "high,high,,low,low"; got != want {
		t.Fatalf("started in priority order %q, want %q", got, want)
	}
}

// A tenant's queue-length limit refuses requests beyond it with one clear
// failed/QuotaExceeded result each; other tenants are not affected, and
// the tenant may submit again once its queue shrinks.
func TestQueueLimitRefusesWithQuotaExceeded(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", func(c *Config) {
		withRegistry(tr)(c)
		c.MaxInFlight = 1
		c.Fair.QueueLimit = map[string]int{"acme": 2}
	})
	results := e.collect()
	ctx := context.Background()
	var acme []*v1.Request
	for i := range 4 {
		r := tenantRequest("acme", fmt.Sprint("quota-", i))
		acme = append(acme, r)
		if _, err := e.pub.Publish(ctx, r); err != nil {
			t.Fatal(err)
		}
		if i < 2 {
			e.waitAdmitted(uint64(i + 1))
		}
	}
	got := results.waitFor(t, 2, 10*time.Second)
	for _, r := range got {
		if r.Data.Tenant != "acme" || r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonQuotaExceeded ||
			!strings.Contains(r.Data.Message, "limit is 2") {
			t.Fatalf("result %s, want failed/QuotaExceeded", mustJSON(t, r))
		}
		if r.Data.RequestID != acme[2].RequestID && r.Data.RequestID != acme[3].RequestID {
			t.Fatalf("refused %s, one of the first two admitted", r.Data.RequestID)
		}
	}
	other := tenantRequest("globex", "quota")
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		var job *batchv1.Job
		eventually(t, 10*time.Second, "a Job", func() bool {
			for _, j := range e.jobs() {
				if len(j.Status.Conditions) == 0 {
					job = j
					return true
				}
			}
			return false
		})
		e.kubelet(job, 0, tr.push(t, destination(job)))
	}
	got = results.waitFor(t, 5, 15*time.Second)
	ok := 0
	for _, r := range got[2:] {
		if r.Data.Status == v1.StatusSucceeded {
			ok++
		}
	}
	if ok != 3 {
		t.Fatalf("want acme's 2 admitted and globex's request built: %+v", got)
	}
	// acme's queue is empty again: a new request is admitted.
	again := tenantRequest("acme", "again")
	if _, err := e.pub.Publish(ctx, again); err != nil {
		t.Fatal(err)
	}
	aj := e.waitJob(jobOf(again))
	e.kubelet(aj, 0, tr.push(t, destination(aj)))
	got = results.waitFor(t, 6, 10*time.Second)
	if got[5].Data.RequestID != again.RequestID || got[5].Data.Status != v1.StatusSucceeded {
		t.Fatalf("last result %s", mustJSON(t, got[5]))
	}
}
