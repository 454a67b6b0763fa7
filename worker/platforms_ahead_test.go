package worker

import (
	"context"
	"testing"
	"time"

	"github.com/buildq/buildq/internal/naming"
)

// Found by the fault simulation (seed 154, once in 200): intake sent the
// preflight HEAD ahead for a one-platform request, and it found an image
// pushed by hand at the request's tag, which that request may take. An
// image index of the same tenant built that platform within
// lookAheadFresh, at the same tag, and its walk took the HEAD sent ahead:
// the index held the planted image. A platform of an index takes no image
// found at its tag, whoever's HEAD found it.
func TestAPlatformTakesNoPreflightSentAheadForAOnePlatformRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1 := e.startWorker("w1", withRegistry(tr))
	ctx := context.Background()
	b := w1.w.builds

	one := multiRequest("platform-ahead", "linux/arm64")
	key := b.keyOf(one)
	repo, err := w1.w.cfg.Naming.Repository(one)
	if err != nil {
		t.Fatal(err)
	}
	dests := naming.Destinations(repo, key, one.Tags)
	planted := tr.push(t, dests[0])

	b.sendPreflight(ctx, one, key, repo, dests)
	p, ok := b.preflightSent(one, dests)
	if !ok {
		t.Fatal("premise: no preflight sent ahead")
	}
	<-p.done
	if p.read.err != nil || p.read.found == nil || p.read.found.Digest != planted {
		t.Fatalf("premise: the HEAD sent ahead found %+v (%v), want the planted %s", p.read.found, p.read.err, planted)
	}
	answered := func() error { return nil }

	// The one-platform request's own walk takes it: the path is live.
	own := b.lookAhead(ctx, one, key, repo, dests, answered, time.Time{}, false)
	defer own.stop()
	if found, err := own.preflight(true); err != nil || found == nil || found.Digest != planted {
		t.Fatalf("premise: the request's own walk took %+v (%v), want the planted image", found, err)
	}

	// The index's platform, at the same tag, does not.
	part := b.lookAhead(asPlatformPart(ctx), one, key, repo, dests, answered, time.Time{}, false)
	defer part.stop()
	if found, err := part.preflight(true); err != nil || found != nil {
		t.Fatalf("an index's platform took the image a HEAD sent ahead found at its tag: %+v (%v); want none", found, err)
	}
}
