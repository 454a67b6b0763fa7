package worker

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/naming"
)

// withRegistry points a worker's naming policy and registry checks at tr.
func withRegistry(tr *testRegistry) func(*Config) {
	return func(c *Config) {
		c.Registry = tr.client
		c.Naming = naming.Policy{Registry: tr.host}
	}
}

// build publishes req, plays a kubelet that pushes to the Job's destination
// and returns the result.
func (e *env) buildThrough(t *testing.T, tr *testRegistry, results *resultCollector, req *v1.Request, want int) v1.Result {
	t.Helper()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	got := results.waitFor(t, want, 10*time.Second)
	return got[want-1]
}

func TestKnownKeyIsAnsweredFromTheIndex(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	first := e.buildThrough(t, tr, results, request("cached"), 1)
	if first.Data.Origin != v1.OriginBuild {
		t.Fatalf("first %s", mustJSON(t, first))
	}
	// Same content, same repository: no Job, origin cache.
	if _, err := e.pub.Publish(context.Background(), request("cached")); err != nil {
		t.Fatal(err)
	}
	second := results.waitFor(t, 2, 10*time.Second)[1]
	if second.Data.Origin != v1.OriginCache || second.Data.Digest != first.Data.Digest || second.Data.Status != v1.StatusSucceeded {
		t.Fatalf("second %s", mustJSON(t, second))
	}
	// Same content, another repository and an extra tag: copied, not rebuilt.
	other := request("cached")
	other.Image = tr.host + "/acme/elsewhere/app"
	other.Tags = []string{"stable"}
	if _, err := e.pub.Publish(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	third := results.waitFor(t, 3, 10*time.Second)[2]
	if third.Data.Origin != v1.OriginCache || third.Data.Digest != first.Data.Digest || third.Data.ImageRef != other.Image+"@"+first.Data.Digest {
		t.Fatalf("third %s", mustJSON(t, third))
	}
	for _, ref := range []string{third.Data.Image, other.Image + ":stable"} {
		r, err := name.ParseReference(ref, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		desc, err := remote.Head(r)
		if err != nil || desc.Digest.String() != first.Data.Digest {
			t.Errorf("%s: %v %v, want %s", ref, desc, err, first.Data.Digest)
		}
	}
	if c := e.creates.total(); c != 1 {
		t.Errorf("%d jobs created, want 1", c)
	}
}

func TestDeletedImageIsRebuilt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	first := e.buildThrough(t, tr, results, request("deleted"), 1)
	// Delete it as a registry GC would: the tag and the manifest.
	for _, ref := range []string{first.Data.Image, first.Data.ImageRef} {
		r, err := name.ParseReference(ref, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Delete(r); err != nil {
			t.Fatal(err)
		}
	}
	// The index still says built; the registry says gone: build again.
	eventually(t, 5*time.Second, "first job cleaned up", func() bool {
		_, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), first.Data.Job, metav1.GetOptions{})
		return err != nil
	})
	second := e.buildThrough(t, tr, results, request("deleted"), 2)
	if second.Data.Origin != v1.OriginBuild || second.Data.Status != v1.StatusSucceeded {
		t.Fatalf("second %s", mustJSON(t, second))
	}
	if c := e.creates.total(); c != 2 {
		t.Errorf("%d jobs created, want 2", c)
	}
}

func TestRegistryErrorIsRetriedWithoutJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	tr.fail.Store(true)
	e.startWorker("w1", withRegistry(tr))
	results := e.collect()

	req := request("flaky-registry")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	// The 500 is never read as "exists" nor as "missing": no Job, and the
	// request is handed back for a later try.
	eventually(t, 10*time.Second, "a redelivery", func() bool {
		_, _, redelivered := e.streamState()
		return redelivered > 0
	})
	if c := e.creates.total(); c != 0 {
		t.Fatalf("%d jobs created while the registry failed", c)
	}
	if n := len(results.snapshot()); n != 0 {
		t.Fatalf("%d results while the registry failed", n)
	}
	tr.fail.Store(false)
	job := e.waitJob(kaniko.JobName(v1.BuildKey(req, "kaniko@"+testKaniko.ExecutorImage)))
	e.kubelet(job, 0, tr.push(t, destination(job)))
	r := results.waitFor(t, 1, 10*time.Second)[0]
	if r.Data.Status != v1.StatusSucceeded || r.Data.Attempts < 2 {
		t.Fatalf("result %s", mustJSON(t, r))
	}
}
