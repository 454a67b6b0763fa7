package worker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/buildq/buildq/internal/registry"
)

// TestCheckIndexedSharesOneHead: concurrent checks of one indexed image
// wait for a single HEAD and all get its answer; a check that gives up
// returns its own cause without failing the others, even when it started
// the HEAD; and nothing is remembered once the HEAD returns.
func TestCheckIndexedSharesOneHead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ref = "registry.test/acme/app@sha256:0123"
		reg := newGateRegistry(true)
		reg.exists[ref] = "sha256:0123"
		w := &builder{Worker: &Worker{registry: reg}}

		// The first check starts the HEAD, which the registry holds; its
		// caller then gives up.
		errGaveUp := errors.New("caller gave up")
		first, cancelFirst := context.WithCancelCause(context.Background())
		firstErr := make(chan error, 1)
		go func() { firstErr <- w.checkIndexed(first, ref) }()
		<-reg.entered

		const joiners = 8
		errs := make([]error, joiners)
		var wg sync.WaitGroup
		for i := range joiners {
			wg.Go(func() { errs[i] = w.checkIndexed(context.Background(), ref) })
		}
		synctest.Wait() // every joiner waits on the HEAD in flight
		cancelFirst(errGaveUp)
		if err := <-firstErr; !errors.Is(err, errGaveUp) {
			t.Fatalf("the check whose caller gave up returned %v, want its cause", err)
		}
		close(reg.release)
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("joiner %d: %v, want the shared HEAD's answer (present)", i, err)
			}
		}
		if n := reg.heads.Load(); n != 1 {
			t.Fatalf("%d HEADs for %d concurrent checks of one image, want 1", n, joiners+1)
		}

		// Nothing is remembered: the next check asks again, and sees the
		// image gone.
		delete(reg.exists, ref)
		if err := w.checkIndexed(context.Background(), ref); !errors.Is(err, registry.ErrNotFound) {
			t.Fatalf("a check after the image was deleted returned %v, want ErrNotFound", err)
		}
		if n := reg.heads.Load(); n != 2 {
			t.Fatalf("%d HEADs after a second, later check, want 2", n)
		}
	})
}
