package main

import (
	"testing"

	v1 "github.com/buildq/buildq/api/v1"
)

// Progress labels say what happened (issue 28): a cache hit built and
// pushed nothing, a retry says so.
func TestPhaseWordSaysWhatHappened(t *testing.T) {
	t.Parallel()
	cases := []struct {
		e    v1.Event
		want string
	}{
		{v1.Event{Phase: v1.PhaseFinished, Message: "succeeded (build): r/a@sha256:1"}, "pushed"},
		{v1.Event{Phase: v1.PhaseFinished, Message: "succeeded (inflight): r/a@sha256:1"}, "pushed"},
		{v1.Event{Phase: v1.PhaseFinished, Message: "succeeded (cache): answered from the cache, nothing built: r/a@sha256:1"}, "cached"},
		{v1.Event{Phase: v1.PhaseFinished, Message: "failed: BaseImageNotFound"}, "finished"},
		{v1.Event{Phase: v1.PhaseJobCreated, Message: "building locally (in-process executor, no Job)"}, "building"},
		{v1.Event{Phase: v1.PhaseWaiting, Message: "retrying in 2s (transient failure 1 of at most 5): InfrastructureError: …"}, "retry"},
		{v1.Event{Phase: v1.PhaseWaiting, Message: "requeued: the worker running the build it waited on let it go"}, "retry"},
		{v1.Event{Phase: v1.PhaseWaiting, Message: "joined a build in progress"}, "waiting"},
		{v1.Event{Phase: v1.PhaseQueued, Message: "taken by dev after 0s in the queue"}, "queued"},
	}
	for _, c := range cases {
		if got := phaseWord(c.e); got != c.want {
			t.Errorf("phaseWord(%s %q) = %q, want %q", c.e.Phase, c.e.Message, got, c.want)
		}
	}
}
