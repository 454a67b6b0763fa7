package tenantapi

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/runs"
)

// slowResults is the results stream as the status service reads it: the
// request "x" has the stored result "succeeded"; reads for the ids in
// slow take until release is closed (reads of a busy subject under load).
type slowResults struct {
	slow    map[string]bool
	started chan string
	release chan struct{}
}

func (r *slowResults) read(ctx context.Context, id string) (*v1.ResultData, error) {
	if r.slow[id] {
		r.started <- id
		select {
		case <-r.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return nil, nil
	}
	if id == "x" {
		return &v1.ResultData{RequestID: "x", Tenant: "acme", Name: "web", Status: v1.StatusSucceeded, Origin: v1.OriginBuild}, nil
	}
	return nil, nil
}

func (r *slowResults) Recent(ctx context.Context, _, _, id string, _ time.Time) (*v1.ResultData, error) {
	return r.read(ctx, id)
}

func (r *slowResults) Find(ctx context.Context, _, _, id string, _ time.Time) (*v1.ResultData, error) {
	return r.read(ctx, id)
}

// A tenant's status requests past its share of reads of the results
// stream (scansPerTenant) are answered at once that the read could not be
// made, with the entry, so the SDK's Wait asks again: none waits for a
// turn holding one of the worker's request slots, where a flood of them
// would hold every slot ahead of other tenants' requests. And a cancel's
// reply never names a recorded result as the request's when it could not
// read what the stream stored. (From an attack on the bounded reads.)
func TestReadsPastATenantsShareAnswerAtOnceAndNameNothingUnconfirmed(t *testing.T) {
	ctx := t.Context()
	nc, builds, _, l := serviceBuckets(t)
	rs := runs.New()
	rs.UseBucket(builds)
	res := &slowResults{slow: map[string]bool{"slow-1": true, "slow-2": true}, started: make(chan string, 2), release: make(chan struct{})}
	svc := New(Config{Ledger: l, Runs: rs, NC: nc, Now: time.Now, Log: zap.NewNop(), Results: res,
		StopBuild: func(context.Context, string, string) error { return nil }, AnswerParked: func(context.Context, string) {}})

	// "x": a build's "succeeded" was stored first, and the entry holds a
	// cancel's "canceled", recorded, unmarked (its adopting write lost).
	key := strings.Repeat("b", 64)
	le, _, err := l.Open(ctx, "acme", "web", "x", key, 1, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	d := ledger.Decision{Tenant: "acme", Name: "web", Data: v1.ResultData{RequestID: "x", Tenant: "acme", Name: "web", Key: key}}.Canceled()
	if _, err := l.Record(ctx, le, d); err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"slow-1", "slow-2", "queued"} {
		if _, _, err := l.Open(ctx, "acme", "web", id, key, uint64(2+i), time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	// The tenant's two reads, held.
	var wg sync.WaitGroup
	for _, id := range []string{"slow-1", "slow-2"} {
		wg.Add(1)
		go func() { defer wg.Done(); svc.status(ctx, "acme", id) }()
	}
	defer func() { close(res.release); wg.Wait() }()
	<-res.started
	<-res.started

	// A third: answered at once, not after a wait for a turn (which,
	// bounded by this context, would end in its deadline).
	sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	rep := svc.status(sctx, "acme", "queued")
	if rep.Request == nil || !strings.Contains(rep.Error, errTooManyScans.Error()) {
		t.Fatalf("status past the tenant's share of reads = %+v; want the entry and %q, so Wait asks again", rep, errTooManyScans)
	}
	if rep.Request.Result != nil {
		t.Fatalf("status showed a result it could not check against the stream: %+v", rep.Request.Result)
	}
	crep := svc.cancel(sctx, "acme", "x")
	if crep.Canceled || !strings.Contains(crep.Message, notConfirmed) || strings.HasSuffix(crep.Message, ": "+string(v1.StatusCanceled)) {
		t.Fatalf("cancel reply %+v; want it to say the stored result could not be read (%q), not name the recorded %q as the request's",
			crep, notConfirmed, v1.StatusCanceled)
	}
}
