package worker

// A build's Job made ahead of its run (docs/design.md §2d, "Claimed
// first"): while a fresh key's claim and its request's ledger entry's
// create are in flight, the handler has the claim's Job made, and the run
// creates it once the claim is taken.

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"sync"
	"time"

	batchv1 "k8s.io/api/batch/v1"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// preparedJobs are the Jobs made ahead of their runs, by run.
type preparedJobs struct {
	mu sync.Mutex
	m  map[string]preparedJob
}

// makeJob is the Job of b: its fetch-context URL presigned, its spec
// rendered.
func (k *KubeBackend) makeJob(ctx context.Context, b Build) (*batchv1.Job, error) {
	spec := kaniko.Spec{Request: b.Request, Key: b.Key, Destinations: b.Destinations, Run: b.Run}
	if s3 := b.Request.Source.S3; s3 != nil && k.cfg.FetchImage != "" {
		if k.presign == nil {
			return nil, errors.New("kube backend: --fetch-image is set but no presigner (S3 keys) is configured")
		}
		// Valid for the whole build: a Pod the Job retries late in the
		// deadline still fetches.
		u, err := k.presign(ctx, s3.Bucket, s3.Key, kaniko.Timeout(b.Request, k.cfg)+15*time.Minute)
		if err != nil {
			return nil, err
		}
		spec.ContextURL = u
		if b.KeepFirstTag && len(b.Destinations) > 0 && !mutant.On("pod-skips-tag-check") {
			spec.Absent = b.Destinations[0]
		}
	}
	return kaniko.Job(spec, k.cfg)
}

// preparedJob is a Job made ahead of its run (Prepare), with what it was
// made of.
type preparedJob struct {
	b   Build
	job *batchv1.Job
	at  time.Time
}

const (
	// preparedFresh is how long a Job made ahead waits for its run: a
	// run starts within moments of its claim or not at all.
	preparedFresh = 10 * time.Second
	// maxPrepared bounds the Jobs made ahead and not yet taken.
	maxPrepared = 1024
)

// Prepare implements Preparer: b's Job is made now (its context URL
// presigned, its spec rendered), for Run of the same build to create.
// Intake claims a fresh key beside the request's ledger entry's create,
// and the request's handler prepares the claim's Job while both are in
// flight: the round trips' wait, not the path from their answers to the
// Job's create, pays for it (P1 in docs/benchmarks.md). Run takes it
// only for a build equal in everything the Job is made of; a Job
// prepared for a claim that lost, or for a run that never starts, is
// dropped after preparedFresh.
func (k *KubeBackend) Prepare(ctx context.Context, b Build) {
	job, err := k.makeJob(ctx, b)
	if err != nil {
		return // Run makes it again, and says what failed
	}
	now := time.Now()
	k.prepared.mu.Lock()
	defer k.prepared.mu.Unlock()
	if k.prepared.m == nil {
		k.prepared.m = map[string]preparedJob{}
	}
	for run, p := range k.prepared.m {
		if now.Sub(p.at) >= preparedFresh {
			delete(k.prepared.m, run)
		}
	}
	if len(k.prepared.m) >= maxPrepared {
		clear(k.prepared.m)
	}
	k.prepared.m[b.Run] = preparedJob{b: b, job: job, at: now}
}

// takePrepared removes and returns the Job prepared for b's run when it
// was made of what b's would be, within preparedFresh; nil otherwise.
func (k *KubeBackend) takePrepared(b Build) *batchv1.Job {
	k.prepared.mu.Lock()
	p, ok := k.prepared.m[b.Run]
	delete(k.prepared.m, b.Run)
	k.prepared.mu.Unlock()
	if !ok || time.Since(p.at) >= preparedFresh {
		return nil
	}
	if mutant.On("prepared-job-unchecked") {
		return p.job
	}
	if p.b.Key != b.Key || p.b.KeepFirstTag != b.KeepFirstTag || !slices.Equal(p.b.Destinations, b.Destinations) ||
		!reflect.DeepEqual(p.b.Request, b.Request) {
		return nil
	}
	return p.job
}
