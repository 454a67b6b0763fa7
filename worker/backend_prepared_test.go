package worker

// A build's Job prepared ahead of it (KubeBackend.Prepare: while its
// claim is in flight) is the Job its run creates, and only when the build
// is the one it was prepared for.

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/publisher"
)

// fetchURL is the context URL job's fetch-context container is given.
func fetchURL(job *batchv1.Job) string { return fetchArg(job, "--url") }

func TestAPreparedJobIsCreatedOnlyForTheBuildItWasMadeFor(t *testing.T) {
	t.Parallel()
	e := setup(t)
	kc := fetchKaniko()
	_, watcher := e.startWorkerWith("w1", kc, nil)
	backend, err := NewKubeBackend(e.kube, watcher, kc)
	if err != nil {
		t.Fatal(err)
	}
	var presigned atomic.Int64
	backend.WithPresigner(func(_ context.Context, bucket, key string, _ time.Duration) (string, error) {
		return fmt.Sprintf("http://minio.test:9000/%s/%s?presign=%d", bucket, key, presigned.Add(1)), nil
	})

	// run starts b and returns its Job once created; the build is then
	// ended (its Pod succeeds) and its outcome checked.
	run := func(b Build) *batchv1.Job {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			o, err := backend.Run(context.Background(), b, func(string, bool, string) {})
			if err == nil && !o.Succeeded {
				err = fmt.Errorf("outcome %+v", o)
			}
			done <- err
		}()
		job := e.waitJob(kaniko.JobName(b.Key))
		e.kubelet(job, 0, digestOf(b.Run))
		if err := <-done; err != nil {
			t.Fatalf("run %s: %v", b.Run, err)
		}
		return job
	}
	build := func(seed, run string, dests ...string) Build {
		req := request(seed)
		return Build{Request: req, Key: v1.BuildKey(req, kanikoID), Run: run, Destinations: dests, KeepFirstTag: true}
	}

	// Prepared, then run as prepared: the Job made ahead is the one
	// created, with nothing made twice.
	b := build("prepared-same", "run-1", "registry.test:5000/acme/web:one")
	backend.Prepare(context.Background(), b)
	if n := presigned.Load(); n != 1 {
		t.Fatalf("Prepare presigned %d URLs, want 1", n)
	}
	same := b
	same.Request = request("prepared-same") // decoded again by the handler: equal, not the same pointer
	job := run(same)
	if got := fetchURL(job); got != "http://minio.test:9000/buildq/"+b.Request.Source.S3.Key+"?presign=1" {
		t.Fatalf("the created Job fetches %q, want the URL prepared ahead", got)
	}
	if n := presigned.Load(); n != 1 {
		t.Fatalf("%d URLs presigned, want only the prepared one", n)
	}

	// Prepared for one build, run as another (each thing the Job is made
	// of differs in turn): the Job is made again from what Run was given.
	differ := []struct {
		name   string
		change func(*Build)
	}{
		{"destinations", func(b *Build) { b.Destinations = []string{"registry.test:5000/acme/web:other"} }},
		{"request", func(b *Build) { b.Request.BuildArgs = map[string]string{"VERSION": "9.9.9"} }},
		{"tag check", func(b *Build) { b.KeepFirstTag = false }},
		{"key", func(b *Build) { b.Key = v1.BuildKey(request("another key"), kanikoID) }},
	}
	for i, d := range differ {
		prepared := build(fmt.Sprintf("prepared-differs-%d", i), fmt.Sprintf("run-d%d", i), "registry.test:5000/acme/web:d")
		backend.Prepare(context.Background(), prepared)
		want := presigned.Load() + 1
		given := prepared
		given.Request = request(fmt.Sprintf("prepared-differs-%d", i))
		d.change(&given)
		job := run(given)
		if got := fetchURL(job); got != fmt.Sprintf("http://minio.test:9000/buildq/%s?presign=%d", given.Request.Source.S3.Key, want) {
			t.Fatalf("%s differs: the created Job fetches %q, want a URL presigned for the run (%d)", d.name, got, want)
		}
		if got := destination(job); got != given.Destinations[0] {
			t.Fatalf("%s differs: the created Job pushes to %q, want %q", d.name, got, given.Destinations[0])
		}
		if got, want := absentArg(job) != "", given.KeepFirstTag; got != want {
			t.Fatalf("%s differs: the created Job checks its tag: %v, want %v", d.name, got, want)
		}
	}

	// A run nobody prepared is made as before.
	want := presigned.Load() + 1
	job = run(build("unprepared", "run-u", "registry.test:5000/acme/web:u"))
	if got := fetchURL(job); got != fmt.Sprintf("http://minio.test:9000/buildq/%s?presign=%d", request("unprepared").Source.S3.Key, want) {
		t.Fatalf("an unprepared run's Job fetches %q", got)
	}
}

// The handler of a fresh key's request taken straight from intake has
// the claim's Job prepared while the request's ledger entry's create and
// the key's claim are still in flight, and that Job is the one created.
func TestAFreshKeysJobIsPreparedWhileItsClaimIsInFlight(t *testing.T) {
	t.Parallel()
	req := request("prepared-in-flight")
	req.RequestID = publisher.NewRequestID()
	lk := RequestIndexKey("acme", req.RequestID)
	var presigned atomic.Int64
	var preparedInFlight atomic.Bool
	e := setup(t)
	tr := newTestRegistry(t)
	w, _ := e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, func(w *Worker) {
		w.backend.(*KubeBackend).WithPresigner(func(_ context.Context, bucket, key string, _ time.Duration) (string, error) {
			return fmt.Sprintf("http://minio.test:9000/%s/%s?presign=%d", bucket, key, presigned.Add(1)), nil
		})
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onCreate: func(k string, _ []byte) error {
			if k != lk {
				return nil
			}
			// The entry's create is held until the Job is prepared,
			// for up to 5 s: a Job made only once the create is in
			// cannot be.
			deadline := time.Now().Add(5 * time.Second)
			for presigned.Load() == 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			preparedInFlight.Store(presigned.Load() > 0)
			return nil
		}})
	})
	results := e.collect()
	waitIdle(t, w)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	if !preparedInFlight.Load() {
		t.Error("the Job was not prepared while the request's entry was being created")
	}
	if got := fetchURL(job); got != "http://minio.test:9000/buildq/"+req.Source.S3.Key+"?presign=1" {
		t.Fatalf("the Job fetches %q, want the URL prepared while the entry's create was held", got)
	}
	if n := presigned.Load(); n != 1 {
		t.Fatalf("%d URLs presigned for one build, want 1", n)
	}
	e.kubelet(job, 0, tr.push(t, destination(job)))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}
