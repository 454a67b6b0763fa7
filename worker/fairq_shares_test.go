package worker

// Fair queue (worker/internal/fairq), shares and priorities: a free slot
// goes to the tenant with the fewest requests running per weight, and
// within a tenant high goes before normal before low (docs/design.md §2d).

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
)

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

// A tenant with a backlog does not shut another out: with acme's 40
// requests queued behind its running build, globex's one request is the
// next to start when the slot frees.
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
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
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
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

// Within a tenant, high goes before normal before low, whatever the order
// they were submitted in.
//
// Origin: fair queueing, docs/design.md §2d (1f09732).
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
