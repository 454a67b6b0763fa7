package worker

// Helpers for the fair queue's tests: requests of several tenants, the
// Jobs each tenant runs, the requests intake admitted, and a concurrency
// limit watched.

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

// waitAdmitted waits until n requests sit in the tenants' queues.
// waitAdmitted waits until n requests have passed intake: queued, or
// taken straight from intake by a worker's handler (dispatched direct,
// their messages held in BUILDQ_REQUESTS), and none waiting for intake;
// the same count twice in a row, so an admission under way is not
// counted as a request taken direct.
func (e *env) waitAdmitted(n uint64) {
	e.t.Helper()
	last := uint64(0)
	eventually(e.t, 10*time.Second, fmt.Sprintf("%d requests admitted", n), func() bool {
		got, ok := e.admitted()
		same := ok && got == last
		last = got
		return same && got == n
	})
}

// admitted is the requests queued plus those held from BUILDQ_REQUESTS
// by their handlers; ok false while any waits for intake (undelivered, or
// a message of BUILDQ_REQUESTS that nobody holds).
func (e *env) admitted() (uint64, bool) {
	ctx := context.Background()
	q, err := ReadQueueState(ctx, e.js)
	if err != nil {
		return 0, false
	}
	s, err := e.js.Stream(ctx, v1.RequestsStream)
	if err != nil {
		return 0, false
	}
	si, err := s.Info(ctx)
	if err != nil {
		return 0, false
	}
	c, err := e.js.Consumer(ctx, v1.RequestsStream, v1.WorkersConsumer)
	if err != nil {
		return 0, false
	}
	ci, err := c.Info(ctx)
	if err != nil || ci.NumPending != 0 || uint64(ci.NumAckPending) != si.State.Msgs {
		return 0, false
	}
	return q.Messages, true // both streams' messages
}

// neverTwoAtOnce fails the test if acme ever runs more than one of jobs at
// once during d.
func neverTwoAtOnce(t *testing.T, e *env, names map[string]string, d time.Duration, why string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if n := e.running(names)["acme"]; n > 1 {
			t.Fatalf("acme runs %d builds at once, its concurrency limit is 1: %s", n, why)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// holderAndNext publishes acme's request id1, waits for its Job, runs
// then (a second worker's start), and publishes acme's high-priority id2,
// which waits on the tenant's one slot. names maps both Jobs to acme.
func holderAndNext(t *testing.T, e *env, id1, id2 string, then func()) (r1, r2 *v1.Request, names map[string]string) {
	t.Helper()
	ctx := context.Background()
	names = map[string]string{}
	r1 = tenantRequest("acme", id1)
	names[jobOf(r1)] = "acme"
	if _, err := e.pub.Publish(ctx, r1); err != nil {
		t.Fatal(err)
	}
	e.waitJob(jobOf(r1))
	then()
	r2 = tenantRequest("acme", id2)
	r2.Priority = v1.PriorityHigh
	names[jobOf(r2)] = "acme"
	if _, err := e.pub.Publish(ctx, r2); err != nil {
		t.Fatal(err)
	}
	e.waitAdmitted(2)
	return r1, r2, names
}

// intakeEmpty reports whether BUILDQ_REQUESTS holds no request.
func (e *env) intakeEmpty() bool {
	s, err := e.js.Stream(context.Background(), v1.RequestsStream)
	if err != nil {
		return false
	}
	si, err := s.Info(context.Background())
	return err == nil && si.State.Msgs == 0
}

// admittedAll reports whether n requests are stored in BUILDQ_REQUESTS and
// BUILDQ_QUEUE together, none of them waiting for intake.
func (e *env) admittedAll(n uint64) bool {
	got, ok := e.admitted()
	return ok && got == n
}
