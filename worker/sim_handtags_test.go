package worker

// Tags pushed by hand, in the fault simulation ("hand-tags"): before any
// request, an image nobody built is pushed to some requests' own first
// tag (an index lost, a tag pushed by hand). The preflight runs before a
// request claims its key and looks at that tag (docs/design.md, "The
// dedupe index"): the request is answered with the image there, origin
// cache, and no request's Job ever pushes to the tag. A claim made before
// its tag was checked, or a run taken over that pushed where its claimer
// never looked, would push over it: the oracle names that
// tag-overwritten.
//
// In the production shape (simSchedule.fetchContext) the build Pod checks
// the tag too, and a fresh key's build is started before the preflight,
// which goes once its Job is created: a Job may then name such a tag for
// a moment, and the
// rule is that none pushes to it — the preflight's answer stops the
// build, or the Pod's check refuses it.
//
// A platform's build of an image index is the exception both ways: its
// tag (the request's repository's tag of the platform's key, the same as
// a one-platform request's of that platform) is buildq's own, and the
// index is shared, so the platform takes no image found there — it
// builds, and its Job pushes over the tag (asPlatformPart). An index made
// of an image found by hand would name no known content (wrong-image).

import (
	"strings"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
)

// firstTag is the tag s's preflight checks: its repository's tag of its
// key (naming.Destinations' first).
func (w *simWorld) firstTag(s *simSub) string {
	repo, err := naming.Policy{Registry: w.world.reg.host}.Repository(s.req)
	if err != nil {
		return ""
	}
	return repo + ":" + v1.DefaultTag(s.key)
}

// pushHandTags pushes an image of its own to the first tag of about one
// submission's tag in three (an image index's requests excepted), chosen
// by the seed's hash, before the workers take any request.
func (w *simWorld) pushHandTags() {
	w.handTags = map[string]string{}
	for _, s := range w.subs {
		if multiPlatform(s.req) {
			continue
		}
		tag := w.firstTag(s)
		// Chosen by the tag without the registry's address (a port that
		// changes from run to run), so a seed pushes the same tags.
		if _, done := w.handTags[tag]; done || tag == "" || simHash(w.seed, "hand/"+strings.TrimPrefix(tag, w.world.reg.host), 0)%3 != 0 {
			continue
		}
		w.handTags[tag] = w.world.reg.push(w.t, tag)
		w.trace.add("setup %s pushed by hand: %s", tag, w.handTags[tag])
	}
}

// answeredByHand reports whether d answers s with the image pushed by hand
// to its first tag, as its preflight finds it.
func (w *simWorld) answeredByHand(s *simSub, d simDecision) bool {
	tag := w.firstTag(s)
	digest, ok := w.handTags[tag]
	if late, pushed := w.lateHand[tag]; pushed && !ok {
		digest, ok = late.digest, true
	}
	return ok && d.digest == digest && d.origin == v1.OriginCache && d.image == tag
}

// pushLateHandTag pushes an image of its own to s's first tag now, while
// the schedule runs ("late-hand-tags"), unless the tag had one pushed by
// hand already or s asks for an image index.
func (w *simWorld) pushLateHandTag(s *simSub) {
	if s == nil || multiPlatform(s.req) {
		return
	}
	tag := w.firstTag(s)
	w.mu.Lock()
	_, early := w.handTags[tag]
	// Taken under the lock before the push: two requests of one key
	// share the tag, and two pushes at once would leave the registry
	// with whichever landed last, not the one recorded last (seed 149).
	late := w.lateHandPushing[tag]
	if tag != "" && !early && !late {
		if w.lateHandPushing == nil {
			w.lateHandPushing = map[string]bool{}
		}
		w.lateHandPushing[tag] = true
	}
	w.mu.Unlock()
	if tag == "" || early || late {
		return
	}
	d := w.world.reg.push(w.t, tag)
	at := w.now()
	w.mu.Lock()
	if w.lateHand == nil {
		w.lateHand = map[string]simHandPush{}
	}
	w.lateHand[tag] = simHandPush{digest: d, at: at}
	w.mu.Unlock()
	w.trace.add("fault %s pushed by hand: %s", tag, d)
}

// lateHandTag reports whether ref is a tag pushed by hand while the
// schedule ran. For the judges: read once the schedule's pushes are done,
// with or without w.mu held.
func (w *simWorld) lateHandTag(ref string) bool {
	_, ok := w.lateHand[ref]
	return ok
}

// judgeHandTags: no Job pushes to a tag pushed by hand before any request,
// but an image index's platform's; where the Pods check no tag, none names
// it either. A platform's run taken over by another
// request's handler (a one-platform request of the same content, which
// joined it) is still that platform's: its Job names the taker, its
// record the claimer.
func (w *simWorld) judgeHandTags(out *simOutcome) {
	claimer := map[string]string{} // run → the request that claimed it
	for _, rv := range w.records {
		if rv.rec.Run != "" && claimer[rv.rec.Run] == "" {
			claimer[rv.rec.Run] = rv.rec.RequestID
		}
	}
	platformRun := func(id string) bool {
		s := w.subByID[id]
		return s != nil && multiPlatform(s.req)
	}
	fetch := w.sc.fetchContext()
	for _, j := range w.node.order {
		if platformRun(j.request) || platformRun(claimer[j.run]) {
			continue
		}
		check := "none"
		if j.checked != 0 {
			check = simSeconds(j.checked)
		}
		for _, d := range j.dests {
			if _, ok := w.handTags[d]; ok && !fetch {
				w.violate(out, "tag-overwritten", "job %s of %s for request %s, created by %s at %.3fs, pushes to %s, which held an image pushed by hand before any request: its preflight must have found it",
					j.uid, w.keyName(j.key), j.request, j.creator, j.created.Seconds(), d)
			}
			if _, ok := w.handTags[d]; ok && fetch && j.pushed != 0 {
				w.violate(out, "tag-overwritten", "job %s of %s for request %s, created by %s at %.3fs, its Pod's tag check at %s, began pushing to %s at %.3fs, which held an image pushed by hand before any request: its preflight or its Pod's check must have found it",
					j.uid, w.keyName(j.key), j.request, j.creator, j.created.Seconds(), check, d, j.pushed.Seconds())
			}
			// A tag pushed by hand while the schedule ran: a build may
			// push over it only if its Pod checked the tag before that
			// push was done (a build already under way, as kaniko's
			// would be); a Pod that checked after it must have found it.
			if late, ok := w.lateHand[d]; ok && j.pushed != 0 && j.pushed > late.at && (j.checked == 0 || j.checked > late.at) {
				w.violate(out, "tag-overwritten", "job %s of %s for request %s, created by %s at %.3fs, its Pod's tag check at %s, began pushing to %s at %.3fs, after an image was pushed there by hand at %.3fs: its Pod's check must have found it",
					j.uid, w.keyName(j.key), j.request, j.creator, j.created.Seconds(), check, d, j.pushed.Seconds(), late.at.Seconds())
			}
		}
	}
}
