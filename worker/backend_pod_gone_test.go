package worker

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// A finished Job whose Pod was deleted before the worker's cache saw its
// final status ends its run once the API server shows no Pod (podLook),
// with the digest from the registry, instead of waiting out the whole
// grace left for a Pod cache that lags the Job's. A Pod the API server
// still has is waited for as before.
//
// Origin: simulation seed 188 (always about 20 s: a take-over of a
// finished Job whose Pod had been deleted waited the full 10 s grace).
func TestAFinishedJobWhosePodIsGoneEndsItsRunWithoutWaitingOutTheGrace(t *testing.T) {
	t.Parallel()
	e := setup(t)
	_, watcher := e.startWorkerWith("w1", testKaniko, nil)
	backend, err := NewKubeBackend(e.kube, watcher, testKaniko)
	if err != nil {
		t.Fatal(err)
	}
	// A grace no test waits out: only the look at the API server can end
	// the run.
	backend.digestGrace = time.Hour
	want := digestOf("pod-gone")
	resolved := make(chan string, 1)
	backend.WithDigestResolver(func(_ context.Context, ref string) (string, error) {
		resolved <- ref
		return want, nil
	})
	req := request("pod-gone")
	b := Build{Request: req, Key: v1.BuildKey(req, kanikoID), Run: "run-1", Destinations: []string{"registry.test:5000/acme/web:pod-gone"}, KeepFirstTag: true}
	// The run's record, held by a worker with a long lease: the janitor
	// leaves its Job to it.
	now := time.Now().UTC()
	raw, _ := json.Marshal(v1.BuildRecord{Key: b.Key, State: v1.StateBuilding, Run: b.Run, Owner: "w2", LeaseMs: time.Hour.Milliseconds(),
		LeaseUntil: now.Add(time.Hour), RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, StartedAt: now})
	builds, err := e.js.KeyValue(context.Background(), v1.BuildsBucket)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := builds.Put(context.Background(), b.Key, raw); err != nil {
		t.Fatal(err)
	}
	type result struct {
		o   Outcome
		err error
	}
	done := make(chan result, 1)
	go func() {
		o, err := backend.Run(context.Background(), b, func(string, bool, string) {})
		done <- result{o, err}
	}()
	job := e.waitJob(kaniko.JobName(b.Key))
	if err := e.world.node.succeedPodGone(job); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if r.err != nil || !r.o.Succeeded || r.o.Digest != want || r.o.JobUID != string(job.UID) {
			t.Fatalf("outcome %+v, %v; want succeeded with the registry's digest %s", r.o, r.err, want)
		}
		if ref := <-resolved; ref != b.Destinations[0] {
			t.Fatalf("the registry was asked for %s, want the first destination %s", ref, b.Destinations[0])
		}
	case <-time.After(podLook + 20*time.Second):
		t.Fatalf("the run of a finished Job whose Pod is gone did not end; it waits out the grace (%v)", backend.digestGrace)
	}
}

// The reconciler's side of the same: a finished Job whose Pod is gone,
// of a run whose owner is gone too (killed before it stored the end),
// gets its outcome from the registry once the API server shows no Pod,
// and the run ends. It was skipped as "Pod still to come", forever: the
// run stayed building, the janitor leaves a building run's Job to its
// owner, and the Job stayed until a request for the key took the run
// over.
//
// Origin: simulation seed 188 (job-left-behind, once in about 100
// replays: the run's owner answered its request, failed to store the end
// in a NATS outage and was killed; the Pod had been deleted meanwhile).
func TestAFinishedJobWhosePodIsGoneEndsTheRunOfAnOwnerThatIsGone(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	req := request("orphan-pod-gone")
	key := v1.BuildKey(req, kanikoID)
	dest := "registry.test:5000/acme/web:" + v1.DefaultTag(key)
	spec, err := kaniko.Job(kaniko.Spec{Request: req, Key: key, Destinations: []string{dest}, Run: "r1"}, testKaniko.Defaults())
	if err != nil {
		t.Fatal(err)
	}
	job, err := e.kube.BatchV1().Jobs(testNamespace).Create(ctx, spec, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.world.node.succeedPodGone(job); err != nil {
		t.Fatal(err)
	}
	want := digestOf("orphan-pod-gone")
	r := e.startWorkerHooked("w1", nil, nil, func(w *Worker) {
		w.backend.(*KubeBackend).WithDigestResolver(func(_ context.Context, ref string) (string, error) {
			if ref != dest {
				return "", fmt.Errorf("asked the registry for %s, want the run's first destination %s", ref, dest)
			}
			return want, nil
		})
	})
	// A dead worker's claim: it stays unchanged.
	rec, _ := json.Marshal(v1.BuildRecord{Key: key, State: v1.StateBuilding, Run: "r1", Owner: "dead", LeaseMs: 1000,
		LeaseUntil: time.Now().Add(time.Hour), RequestID: "gone", Repository: "registry.test:5000/acme/web",
		Destinations: []string{dest}, StartedAt: time.Now().Add(-time.Hour)})
	if _, err := r.w.runs.Bucket().Put(ctx, key, rec); err != nil {
		t.Fatal(err)
	}
	// The next event for the finished Job makes the worker look at it.
	j, _ := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, job.Name, metav1.GetOptions{})
	j.Labels["touched"] = "yes"
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Update(ctx, j, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the run ended with the registry's digest", func() bool {
		cur, _, err := r.w.runs.Get(ctx, key)
		return err == nil && cur != nil && cur.State == v1.StateSucceeded && cur.Digest == want && cur.Run == "r1"
	})
}
