package worker

// A build's Job made ahead of its run (docs/design.md §2d, "Claimed
// first"): while a fresh key's claim and its request's ledger entry's
// create are in flight, the handler has the claim's Job made, and the run
// creates it once the claim is taken.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
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
	// swept is when the stale ones were last dropped.
	swept time.Time
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
// made of: the request as its JSON at that moment (a request changed in
// place since is another request), the key, a copy of the destinations
// and the tag check.
type preparedJob struct {
	req          []byte
	key          string
	dests        []string
	keepFirstTag bool
	job          *batchv1.Job
	at           time.Time
}

const (
	// preparedFresh is how long a Job made ahead waits for its run: a
	// run starts within moments of its claim or not at all.
	preparedFresh = 10 * time.Second
	// maxPrepared bounds the Jobs made ahead and not yet taken; past it
	// the oldest goes.
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
	req, err := json.Marshal(b.Request)
	if err != nil {
		return
	}
	job, err := k.makeJob(ctx, b)
	if err != nil {
		return // Run makes it again, and says what failed
	}
	k.prepared.put(b, req, job)
}

// put keeps job, made of b (whose request encodes as req), for b's run.
func (p *preparedJobs) put(b Build, req []byte, job *batchv1.Job) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[string]preparedJob{}
	}
	p.sweep(now)
	if len(p.m) >= maxPrepared {
		oldest := ""
		for run, j := range p.m {
			if oldest == "" || j.at.Before(p.m[oldest].at) {
				oldest = run
			}
		}
		delete(p.m, oldest)
	}
	p.m[b.Run] = preparedJob{req: req, key: b.Key, dests: slices.Clone(b.Destinations), keepFirstTag: b.KeepFirstTag, job: job, at: now}
}

// sweep drops the Jobs made ahead that waited preparedFresh for their
// runs (their presigned URLs among them). Called with mu held.
func (p *preparedJobs) sweep(now time.Time) {
	if now.Sub(p.swept) < preparedFresh/10 {
		return
	}
	p.swept = now
	for run, j := range p.m {
		if now.Sub(j.at) >= preparedFresh {
			delete(p.m, run)
		}
	}
}

// take removes and returns the Job prepared for b's run when it was made
// of what b's would be, within preparedFresh; nil otherwise.
func (p *preparedJobs) take(b Build) *batchv1.Job {
	now := time.Now()
	p.mu.Lock()
	j, ok := p.m[b.Run]
	delete(p.m, b.Run)
	p.sweep(now)
	p.mu.Unlock()
	if !ok || now.Sub(j.at) >= preparedFresh {
		return nil
	}
	if mutant.On("prepared-job-unchecked") {
		return j.job
	}
	if j.key != b.Key || j.keepFirstTag != b.KeepFirstTag || !slices.Equal(j.dests, b.Destinations) {
		return nil
	}
	if req, err := json.Marshal(b.Request); err != nil || !bytes.Equal(req, j.req) {
		return nil
	}
	return j.job
}
