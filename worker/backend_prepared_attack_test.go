package worker

// Attacks on the Jobs made ahead of their runs (kubeprepare.go), on the
// backend alone: no NATS, no informers.

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
)

func preparingBackend(t *testing.T) *KubeBackend {
	t.Helper()
	var n atomic.Int64
	k := &KubeBackend{cfg: fetchKaniko().Defaults()}
	k.WithPresigner(func(_ context.Context, bucket, key string, _ time.Duration) (string, error) {
		return fmt.Sprintf("http://minio.test:9000/%s/%s?presign=%d", bucket, key, n.Add(1)), nil
	})
	return k
}

func preparedBuild(seed, run string) Build {
	req := request(seed)
	return Build{Request: req, Key: v1.BuildKey(req, kanikoID), Run: run,
		Destinations: []string{"registry.test:5000/" + req.Tenant + "/web:one"}, KeepFirstTag: true}
}

// A build of another tenant, or of other inputs, under the run id a Job
// was made for never gets that Job; a mismatch drops it.
func TestAttack_APreparedJobNeverGoesToAnotherTenantsOrInputsBuild(t *testing.T) {
	k := preparingBackend(t)
	changes := map[string]func(*Build){
		"tenant":            func(b *Build) { b.Request.Tenant = "globex" },
		"secret build args": func(b *Build) { b.Request.SecretBuildArgs = []string{"NPM_TOKEN"} },
		"build arg":         func(b *Build) { b.Request.BuildArgs["VERSION"] = "6.6.6" },
		"context object":    func(b *Build) { b.Request.Source.S3.Key += "x" },
		"timeout":           func(b *Build) { b.Request.Timeout = v1.Duration{Duration: time.Minute} },
		"dockerfile":        func(b *Build) { b.Request.Dockerfile = "Other.Dockerfile" },
		"destination":       func(b *Build) { b.Destinations = []string{"registry.test:5000/globex/web:one"} },
		"extra destination": func(b *Build) { b.Destinations = append(b.Destinations, "registry.test:5000/acme/web:two") },
		"tag check":         func(b *Build) { b.KeepFirstTag = false },
		"key":               func(b *Build) { b.Key = v1.BuildKey(request("other"), kanikoID) },
	}
	for name, change := range changes {
		k.Prepare(context.Background(), preparedBuild("cross", "run-"+name))
		given := preparedBuild("cross", "run-"+name)
		change(&given)
		if k.prepared.take(given) != nil {
			t.Errorf("%s differs, and the Job prepared for acme's build was taken", name)
		}
		if k.prepared.take(preparedBuild("cross", "run-"+name)) != nil {
			t.Errorf("%s: a Job prepared once was taken after a mismatch dropped it", name)
		}
	}
	k.Prepare(context.Background(), preparedBuild("cross", "run-same"))
	if k.prepared.take(preparedBuild("cross", "run-same")) == nil {
		t.Error("an equal build, decoded afresh, did not get the Job prepared for it")
	}
}

// The request a Job was made of is changed in place after Prepare (its
// maps and slices are shared with the handler's copy): the Job, made of
// the old values, is not taken.
func TestAttack_APreparedJobIsNotTakenForARequestChangedInPlace(t *testing.T) {
	k := preparingBackend(t)
	b := preparedBuild("alias", "run-alias")
	b.Request.BuildArgs = map[string]string{"VERSION": "1.2.3"}
	k.Prepare(context.Background(), b)
	b.Request.BuildArgs["VERSION"] = "9.9.9"
	if job := k.prepared.take(b); job != nil {
		t.Fatalf("the Job made with VERSION=1.2.3 was taken for a build with VERSION=9.9.9: %v", job.Spec.Template.Spec.Containers[0].Args)
	}
	d := preparedBuild("alias", "run-dests")
	k.Prepare(context.Background(), d)
	d.Destinations[0] = "registry.test:5000/acme/web:other"
	if k.prepared.take(d) != nil {
		t.Fatal("the Job made for web:one was taken for a build whose destination became web:other in place")
	}
}

// At most maxPrepared Jobs are kept: past it the oldest goes, not every
// one (one tenant's burst of fresh keys does not undo the others'); one
// made preparedFresh ago is never taken.
func TestAttack_PreparedJobsAreBoundedOldestFirst(t *testing.T) {
	k := preparingBackend(t)
	for i := range maxPrepared + 1 {
		k.Prepare(context.Background(), preparedBuild("bound", fmt.Sprintf("run-%d", i)))
	}
	k.prepared.mu.Lock()
	n := len(k.prepared.m)
	_, oldest := k.prepared.m["run-0"]
	k.prepared.mu.Unlock()
	if n != maxPrepared || oldest {
		t.Fatalf("%d Jobs kept (the oldest among them: %v), want %d without the oldest", n, oldest, maxPrepared)
	}
	if k.prepared.take(preparedBuild("bound", "run-1")) == nil {
		t.Fatal("the second oldest Job was dropped when the first went")
	}
	last := fmt.Sprintf("run-%d", maxPrepared)
	k.prepared.mu.Lock()
	p := k.prepared.m[last]
	p.at = time.Now().Add(-preparedFresh)
	k.prepared.m[last] = p
	k.prepared.mu.Unlock()
	if k.prepared.take(preparedBuild("bound", last)) != nil {
		t.Fatal("a Job prepared preparedFresh ago was taken")
	}
}
