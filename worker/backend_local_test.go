package worker

// Backend (local.go): the local executor of buildq dev. It builds only
// verified bytes, honours the request's timeout, and a build that panics
// or is given up by one caller wedges nothing for the next.

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/s3store"
)

// blockingContexts makes the first Open wait for its context to end; later
// ones find no object.
type blockingContexts struct{ opened atomic.Int32 }

func (b *blockingContexts) Open(ctx context.Context, _, _ string) (io.ReadCloser, error) {
	if b.opened.Add(1) == 1 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return nil, s3store.ErrNotFound
}

type noPusher struct{}

func (noPusher) Push(context.Context, ggcrv1.Image, []string) (string, error) {
	return "", errors.New("not used")
}

func (noPusher) RemoteOptions(context.Context) []remote.Option { return nil }

// A local build that joins the same run in this process, whose first
// caller gives up (a cancel, a lost claim), runs the build itself instead
// of returning the first caller's "context canceled".
//
// Origin: issue 9, a defect of the claim protocol before runs and the request ledger (54e1b33).
func TestLocalJoinerOfAnUnwindingRunBuildsItself(t *testing.T) {
	t.Parallel()
	l := NewLocalBackend(&blockingContexts{}, noPusher{}, t.TempDir(), 0)
	req := request("local-join")
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	firstCtx, cancelFirst := context.WithCancel(context.Background())
	joined := make(chan struct{})
	var (
		wg       sync.WaitGroup
		firstErr error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, firstErr = l.Run(firstCtx, b, func(string, bool, string) {})
	}()
	eventually(t, 5*time.Second, "the first build to run", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.running[b.Key] != nil
	})
	var out Outcome
	var err error
	wg.Add(1)
	go func() {
		defer wg.Done()
		out, err = l.Run(context.Background(), b, func(_ string, created bool, _ string) {
			if !created {
				close(joined)
			}
		})
	}()
	<-joined
	cancelFirst()
	wg.Wait()
	if !errors.Is(firstErr, context.Canceled) {
		t.Fatalf("first caller: %v", firstErr)
	}
	if err != nil || out.Reason != v1.ReasonContextMissing {
		t.Fatalf("joiner got %+v, %v; want its own build's outcome (ContextMissing)", out, err)
	}
}

// The local executor honours the request's timeout: a build that runs
// past it fails with DeadlineExceeded instead of holding its slot.
//
// Origin: the local executor honours the request's timeout (03bd685).
func TestLocalBuildHonoursTheTimeout(t *testing.T) {
	t.Parallel()
	l := NewLocalBackend(&blockingContexts{}, noPusher{}, t.TempDir(), 0) // the context never arrives
	req := request("local-timeout")
	req.Timeout = v1.Duration{Duration: 200 * time.Millisecond}
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	out, err := l.Run(context.Background(), b, func(string, bool, string) {})
	if err != nil || out.Succeeded || out.Reason != v1.ReasonDeadlineExceeded {
		t.Fatalf("got %+v, %v; want DeadlineExceeded", out, err)
	}
}

// The local executor builds only the bytes the request's contextDigest
// names: bytes someone planted under that object name are refused.
//
// Origin: per-tenant context prefixes; the local executor builds only verified bytes (d981ef1).
func TestLocalExecutorRefusesAPlantedContext(t *testing.T) {
	t.Parallel()
	digest, _ := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "the victim's"})
	_, planted := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "mallory's"})
	key := s3store.TenantContextKey("acme", digest)
	l := NewLocalBackend(mapContexts{key: planted}, noPusher{}, t.TempDir(), 0)
	req := request("planted")
	req.ContextDigest = digest
	req.Source = v1.Source{S3: &v1.S3Source{Bucket: "buildq", Key: key}}
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	out, err := l.Run(context.Background(), b, func(string, bool, string) {})
	if err != nil || out.Succeeded || out.Reason != v1.ReasonContextMismatch {
		t.Fatalf("planted context: %+v, %v", out, err)
	}
	// The genuine bytes get past the check (to the push, which this test's
	// pusher refuses).
	_, genuine := packDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY app /app\n", "app": "the victim's"})
	l = NewLocalBackend(mapContexts{key: genuine}, noPusher{}, t.TempDir(), 0)
	out, err = l.Run(context.Background(), b, func(string, bool, string) {})
	if err != nil || out.Reason != v1.ReasonPushFailed {
		t.Fatalf("genuine context: %+v, %v", out, err)
	}
}

// panickyContexts panics on its first Open and finds no object afterwards.
type panickyContexts struct{ opened atomic.Int32 }

func (p *panickyContexts) Open(context.Context, string, string) (io.ReadCloser, error) {
	if p.opened.Add(1) == 1 {
		panic("context reader bug")
	}
	return nil, s3store.ErrNotFound
}

// LocalBackend.Run registers the build in l.running and removes it (and
// closes done) only when l.build returns normally. A panic in the build —
// which the worker recovers (safeProcess) so the process lives on — leaves
// the entry behind with done never closed: every later Run of that key in
// the process waits on it forever, whether it is a take-over of the same
// run (it "adopts" the dead build) or a new run (it cancels the dead build
// and waits for it to stop).
//
// Breaks invariant 1 for `buildq dev`: after one panic, no request for the
// key is ever answered by that worker (its handler heartbeats forever).
//
// Origin: adversarial review of the issue-9 claim protocol, attack 3; failed on fa71058.
func TestLocalBuildPanicDoesNotWedgeTheKey(t *testing.T) {
	t.Parallel()
	l := NewLocalBackend(&panickyContexts{}, noPusher{}, t.TempDir(), 0)
	req := request("local-panic")
	b := Build{Request: req, Key: v1.BuildKey(req, l.Identity()), Run: "r1", Destinations: []string{"registry.test/acme/web:x"}}
	func() {
		defer func() { _ = recover() }() // as safeProcess does
		_, _ = l.Run(context.Background(), b, func(string, bool, string) {})
		t.Fatal("the first build did not panic")
	}()
	for _, run := range []string{"r1", "r2"} { // a take-over, then a new run
		b.Run = run
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		out, err := l.Run(ctx, b, func(string, bool, string) {})
		cancel()
		if err != nil || out.Reason != v1.ReasonContextMissing {
			t.Fatalf("run %s after a panicked build: %+v, %v; want its own build's outcome (ContextMissing), not a wait on the dead build", run, out, err)
		}
	}
}
