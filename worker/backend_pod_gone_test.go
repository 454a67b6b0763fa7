package worker

import (
	"context"
	"encoding/json"
	"testing"
	"time"

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
