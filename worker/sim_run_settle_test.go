package worker

import (
	"github.com/prometheus/client_golang/prometheus/testutil"

	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/naming"
)

// The end of a simulated schedule: settling, the images and the index
// checked, the workers shut down, and the outcome reported.

// settle waits until every accepted request has a stored result, the queue
// is empty and every Job is gone; what does not happen in time is a
// violation.
func (w *simWorld) settle(out *simOutcome) {
	ctx := context.Background()
	accepted := map[string]bool{}
	w.mu.Lock()
	for _, s := range w.subs {
		if s.accepted {
			accepted[s.id] = true
		}
	}
	w.mu.Unlock()
	var stored []simStored
	resultsIn := simPoll(simResultsTimeout, func() bool {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		st, err := w.storedResults(c)
		if err != nil {
			return false
		}
		stored = st
		have := map[string]bool{}
		for _, r := range st {
			have[r.id] = true
		}
		for id := range accepted {
			if !have[id] {
				return false
			}
		}
		return true
	})
	w.trace.add("----  %s", map[bool]string{true: "every accepted request has a result", false: "gave up waiting for results"}[resultsIn])
	qTimeout := simQueueTimeout
	if !resultsIn {
		qTimeout = 5 * time.Second
	}
	var msgs, pending uint64
	var ackPending int
	queueEmpty := simPoll(qTimeout, func() bool {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		var err error
		msgs, pending, ackPending, err = w.queueState(c)
		return err == nil && msgs == 0 && pending == 0 && ackPending == 0
	})
	quiet := w.now()
	if !queueEmpty {
		w.violate(out, "queue-not-empty", "after every result: %d messages in %s, consumer pending %d, awaiting ack %d",
			msgs, v1.RequestsStream, pending, ackPending)
	} else {
		w.trace.add("----  the requests stream is empty and the consumer idle")
	}
	jobsGone := simPoll(simJobsTimeout, func() bool { return len(w.liveJobs()) == 0 })
	if !jobsGone {
		for _, j := range w.liveJobs() {
			w.violate(out, "job-left-behind", "job %s still exists %s after the queue went quiet", j, simJobsTimeout)
		}
	}
	// The last word on stored results, and the images in the registry.
	c, cancel := context.WithTimeout(ctx, 10*time.Second)
	if st, err := w.storedResults(c); err == nil {
		stored = st
	} else {
		w.t.Errorf("harness: read results: %v", err)
	}
	cancel()
	w.mu.Lock()
	w.finalStored = stored
	w.quiet = quiet
	w.mu.Unlock()
	w.checkImages()
}

// checkImages looks up every succeeded result's image in the registry.
func (w *simWorld) checkImages() {
	w.mu.Lock()
	var refs []string
	for _, r := range w.finalStored {
		if r.r.Data.Status == v1.StatusSucceeded && r.r.Data.Image != "" {
			refs = append(refs, r.r.Data.Image)
		}
	}
	w.mu.Unlock()
	found := map[string]string{}
	for _, ref := range refs {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		d, err := w.world.reg.client.Head(ctx, ref)
		cancel()
		if err != nil {
			d = "error: " + err.Error()
		}
		found[ref] = d
	}
	w.mu.Lock()
	w.registry = found
	w.mu.Unlock()
}

// checkIndexed looks up, in the registry, the image every succeeded build
// record indexes (Repository@Digest): where a request answered from the
// index is sent, and what a worker asks the registry before answering
// from it. Nothing in the simulation deletes an image.
func (w *simWorld) checkIndexed(recs []simRecordRev) map[string]error {
	out := map[string]error{}
	for _, rv := range recs {
		if rv.deleted || rv.rec.State != v1.StateSucceeded || rv.rec.Repository == "" || rv.rec.Digest == "" {
			continue
		}
		ref := rv.rec.Repository + "@" + rv.rec.Digest
		if _, ok := out[ref]; ok {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := w.world.reg.client.Head(ctx, ref)
		cancel()
		out[ref] = err
	}
	return out
}

// shutdown stops every worker and waits for them.
func (w *simWorld) shutdown() {
	w.mu.Lock()
	procs := slices.Clone(w.procs)
	w.mu.Unlock()
	for _, p := range procs {
		p.cancel()
	}
	for _, p := range procs {
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			w.t.Errorf("harness: worker %s did not stop", p.id)
		}
	}
	w.world.close()
}

func (w *simWorld) violate(out *simOutcome, class, format string, args ...any) {
	out.violations = append(out.violations, simViolation{class: class, detail: fmt.Sprintf(format, args...)})
}

type simDecision struct {
	status         v1.Status
	reason         string
	key, digest    string
	origin         v1.Origin
	subject, image string
}

func (d simDecision) String() string {
	s := string(d.status)
	if d.reason != "" {
		s += "/" + d.reason
	}
	if d.origin != "" {
		s += " origin=" + string(d.origin)
	}
	if d.digest != "" {
		s += " digest=" + d.digest[:19]
	}
	return s
}

func decisionOf(subject string, r v1.Result) simDecision {
	return simDecision{status: r.Data.Status, reason: r.Data.Reason, key: r.Data.Key, digest: r.Data.Digest,
		origin: r.Data.Origin, subject: subject, image: r.Data.Image}
}

// same compares what a client acts on: status, reason, key, digest, origin.
func (d simDecision) same(o simDecision) bool {
	return d.status == o.status && d.reason == o.reason && d.key == o.key && d.digest == o.digest && d.origin == o.origin
}

// saidOf is what the workers said of request id, to chase a request left
// without a result: its events, then their log lines that name it (the
// first simSaidMax in all). Called with w.mu held.
func (w *simWorld) saidOf(id string) []string {
	var said []string
	for _, e := range w.events {
		if e.id == id && len(said) < simSaidMax {
			said = append(said, fmt.Sprintf("%.3fs %s %s %q", e.at.Seconds(), e.worker, e.phase, e.msg))
		}
	}
	if len(said) == 0 {
		said = []string{"no event"}
	}
	w.logs.mu.Lock()
	defer w.logs.mu.Unlock()
	for _, l := range w.logs.lines {
		if strings.Contains(l, `"`+id+`"`) && len(said) < simSaidMax {
			said = append(said, "log: "+l)
		}
	}
	return said
}

const simSaidMax = 40

// judge checks the invariants on what the schedule left behind.
func (w *simWorld) judge(out *simOutcome) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.node
	n.mu.Lock()
	defer n.mu.Unlock()

	storedBy := map[string][]simStored{}
	for _, r := range w.finalStored {
		storedBy[r.id] = append(storedBy[r.id], r)
	}
	pubBy := map[string][]simPublish{}
	for _, p := range w.published {
		pubBy[p.id] = append(pubBy[p.id], p)
	}
	digestContent := map[string]string{}
	for _, s := range w.subs {
		if im, err := s.want(); err == nil {
			digestContent[im.digest] = s.label
		}
	}

	for _, s := range w.subs {
		if !s.accepted {
			continue
		}
		st := storedBy[s.id]
		if len(st) == 0 {
			w.violate(out, "stuck", "request %s (%s %s, published at %.3fs) has no result %s after healing; its events: %s",
				s.id, s.label, w.keyName(s.key), s.start.Seconds(), simResultsTimeout, strings.Join(w.saidOf(s.id), "; "))
			continue
		}
		if len(st) > 1 {
			var ds []string
			for _, r := range st {
				ds = append(ds, decisionOf(r.subject, r.r).String())
			}
			w.violate(out, "two-stored-results", "request %s has %d results in %s: %s", s.id, len(st), v1.ResultsStream, strings.Join(ds, "; "))
		}
		if n := len(pubBy[s.id]); n > 1 {
			// One publish per decision: core subscribers of the results
			// see each publish, the stream's dedupe notwithstanding.
			out.republished++
			var at []string
			for _, p := range pubBy[s.id] {
				at = append(at, fmt.Sprintf("%.3fs by %s", p.at.Seconds(), strings.TrimPrefix(p.r.Source, "/buildq/worker/")))
			}
			w.violate(out, "repeated-publish", "the result of %s reached core subscribers %d times: %s", s.id, n, strings.Join(at, ", "))
		}
		// Every answer the request was given, stored or only published.
		type answer struct {
			d   simDecision
			who string
		}
		var answers []answer
		for _, r := range st {
			answers = append(answers, answer{decisionOf(r.subject, r.r), "stored, by " + strings.TrimPrefix(r.r.Source, "/buildq/worker/")})
		}
		for _, p := range pubBy[s.id] {
			answers = append(answers, answer{decisionOf(p.subject, p.r), fmt.Sprintf("published at %.3fs by %s", p.at.Seconds(), strings.TrimPrefix(p.r.Source, "/buildq/worker/"))})
		}
		var distinct []answer
		for _, a := range answers {
			if !slices.ContainsFunc(distinct, func(b answer) bool { return b.d.same(a.d) }) {
				distinct = append(distinct, a)
			}
		}
		if len(distinct) > 1 {
			var ds []string
			for _, a := range distinct {
				ds = append(ds, fmt.Sprintf("%s (%s)", a.d, a.who))
			}
			class := "two-answers"
			if !slices.ContainsFunc(distinct[1:], func(a answer) bool {
				d0 := distinct[0].d
				return a.d.status != d0.status || a.d.reason != d0.reason || a.d.key != d0.key || a.d.digest != d0.digest
			}) {
				class = "two-origins" // the same outcome, told as another origin
			}
			w.violate(out, class, "request %s (%s %s) was given %d different results: %s", s.id, s.label, w.keyName(s.key), len(distinct), strings.Join(ds, " | "))
		}
		for _, a := range distinct {
			w.checkAnswer(out, s, a.d, a.who, digestContent)
		}
	}
	for id, st := range storedBy {
		if s := w.subByID[id]; s == nil {
			w.violate(out, "unknown-result", "a result for request id %q that was never submitted: %s", id, decisionOf(st[0].subject, st[0].r))
		}
	}
	for _, d := range n.twoJobs {
		w.violate(out, "two-jobs", "%s", d)
	}
	w.judgeRecords(out)
	if !raceDetector {
		// Fair order in calm stretches is a rule of timing: under the race
		// detector every step runs several times slower and a stretch is
		// not calm for the CPU; make sim judges it (see raceDetector).
		w.judgeOrder(out)
	}
	w.judgeLedger(out)
	w.judgeAnsweredBuilds(out)
	w.judgePublishers(out)
	w.judgeCancelReplies(out)
	w.judgeHandledAfterAnswer(out)
	w.judgeHandTags(out)
	for _, j := range n.order {
		if j.created > w.quiet && w.quiet > 0 {
			w.violate(out, "job-after-quiet", "job %s of %s created at %.3fs by %s, after every request was answered and acked (%.3fs)",
				j.uid, w.keyName(j.key), j.created.Seconds(), j.creator, w.quiet.Seconds())
		}
	}
	out.results = map[string]int{}
	for _, r := range w.finalStored {
		k := string(r.r.Data.Status)
		if r.r.Data.Reason != "" && r.r.Data.Status != v1.StatusCanceled {
			k += "/" + r.r.Data.Reason
		}
		out.results[k]++
	}
	// Cache hits intake answered: from the cache, never taken from a
	// tenant's queue (no queued event).
	taken := map[string]bool{}
	for _, e := range w.events {
		if e.phase == v1.PhaseQueued {
			taken[e.id] = true
		}
		if strings.HasPrefix(e.msg, "held at intake") {
			out.held++
		}
	}
	for _, r := range w.finalStored {
		if r.r.Data.Origin == v1.OriginCache && !taken[r.id] {
			out.atIntake++
		}
	}
	// Results published before their decision was recorded, and
	// publishes that lost to a different result stored first.
	firstPub := w.firstPublished()
	for id, t := range firstPub {
		if d, ok := w.decidedAt[id]; ok && d > t {
			out.publishedFirst++
		}
	}
	storedStatus := map[string]v1.Status{}
	for _, r := range w.finalStored {
		storedStatus[r.id] = r.r.Data.Status
	}
	for _, p := range w.ingest {
		if st, ok := storedStatus[p.id]; ok && st != p.status {
			out.lostPublishes++
		}
	}
	out.queuedHits = int(testutil.ToFloat64(w.metrics.hits.WithLabelValues("queue")))
	out.heldHits = int(testutil.ToFloat64(w.metrics.hits.WithLabelValues("held")))
	out.direct = int(testutil.ToFloat64(w.metrics.direct))
	out.parked = int(testutil.ToFloat64(w.metrics.parks))
	out.requeued = int(testutil.ToFloat64(w.metrics.requeues))
	out.report = w.report(out)
}

// checkAnswer judges one answer against the request's own inputs and what
// the world did.
func (w *simWorld) checkAnswer(out *simOutcome, s *simSub, d simDecision, who string, digestContent map[string]string) {
	n := w.node
	if d.key != s.key {
		w.violate(out, "wrong-key", "request %s: result for key %s, its own is %s (%s)", s.id, d.key, s.key, who)
	}
	if want := v1.ResultSubject(s.req.Tenant, s.req.Name); d.subject != want {
		w.violate(out, "wrong-subject", "request %s: result on %s, want %s (%s)", s.id, d.subject, want, who)
	}
	switch {
	case d.status == v1.StatusSucceeded:
		im, _ := s.want()
		byHand := w.answeredByHand(s, d)
		if d.digest != im.digest && !byHand {
			other := digestContent[d.digest]
			if other == "" {
				other = "no known content"
			}
			w.violate(out, "wrong-image", "request %s (%s): succeeded with digest %s, the image of %s; its own inputs make %s (%s)",
				s.id, s.label, d.digest, other, im.digest, who)
		}
		repo, _ := naming.Policy{Registry: w.world.reg.host}.Repository(s.req)
		if !strings.HasPrefix(d.image, repo+":") {
			w.violate(out, "wrong-destination", "request %s: image %s is not in its repository %s (%s)", s.id, d.image, repo, who)
		} else if got, ok := w.registry[d.image]; ok && got != d.digest && !byHand && !w.lateHandTag(d.image) {
			// (An image found by hand may be replaced later by a copy of
			// the key's build, for a request answered from the index.)
			w.violate(out, "image-not-pushed", "request %s: %s is %s in the registry, the result says %s (%s)", s.id, d.image, got, d.digest, who)
		}
	case d.status == v1.StatusFailed && (d.reason == v1.ReasonBuildFailed || d.reason == v1.ReasonPushFailed):
		// The failure must be news to this request: a build of its key
		// failed, and that outcome was not yet known (published to
		// anyone) when the request was published. A request that comes
		// after the Job failed but before the outcome was recorded joins
		// that build legitimately.
		var at []string
		ok := false
		for _, f := range n.failures {
			if slices.Contains(s.keys(), f.key) {
				known := w.knownAt(s.answeredBy(f.key), f.at, v1.ReasonBuildFailed, v1.ReasonPushFailed)
				at = append(at, fmt.Sprintf("%.3fs (first answered %s)", f.at.Seconds(), simSeconds(known)))
				ok = ok || s.start < known
			}
		}
		if !ok {
			when := "never"
			if len(at) > 0 {
				when = "only at " + strings.Join(at, ", ")
			}
			w.violate(out, "stale-failure", "request %s (%s, published at %.3fs): failed/%s, but builds of %s failed %s (%s)",
				s.id, w.keyName(s.key), s.start.Seconds(), d.reason, w.keyName(s.key), when, who)
		}
	case d.status == v1.StatusFailed && d.reason == v1.ReasonJobDeleted:
		ok := false
		var at []string
		for _, del := range n.deletes {
			if slices.Contains(s.keys(), del.key) {
				known := w.knownAt(s.answeredBy(del.key), del.at, v1.ReasonJobDeleted)
				at = append(at, fmt.Sprintf("%.3fs by %s (first answered %s)", del.at.Seconds(), del.cause, simSeconds(known)))
				ok = ok || s.start < known
			}
		}
		if !ok {
			w.violate(out, "unexplained-job-deleted", "request %s (%s, published at %.3fs): failed/JobDeleted, but no job of its key was deleted from outside after that (deletions: %s) (%s)",
				s.id, w.keyName(s.key), s.start.Seconds(), strings.Join(at, ", "), who)
		}
	case d.status == v1.StatusFailed && d.reason == v1.ReasonInfrastructureError:
		if w.apiFaults == 0 {
			w.violate(out, "infrastructure-error", "request %s: failed/InfrastructureError without injected API errors (%s)", s.id, who)
		} else {
			out.infra++
		}
	case d.status == v1.StatusCanceled:
		// Canceled only by a cancel of its own tenant that names it: its
		// request id, or its key (every request of that tenant waiting
		// on the key), answered after the request was published.
		ok := false
		for _, c := range w.cancels {
			names := c.target == s.id || (c.target == s.key && c.key == s.key)
			ok = ok || (names && c.tenant == s.req.Tenant && c.canceled && c.done > s.start)
		}
		if !ok {
			w.violate(out, "unexplained-cancel", "request %s (%s/%s %s, published at %.3fs): canceled, but no cancel by tenant %s of its id or key was answered after it was published (%s)",
				s.id, s.req.Tenant, s.req.Name, w.keyName(s.key), s.start.Seconds(), s.req.Tenant, who)
		}
	default:
		w.violate(out, "unexpected-result", "request %s: %s (%s)", s.id, d, who)
	}
}

// knownAt is when an outcome that happened at "at" (a Job failed, a Job
// was deleted) first reached anyone: the first result publish for the key
// with one of the reasons at or after it. Until then a request may join
// the build that outcome ends.
func (w *simWorld) knownAt(key string, at time.Duration, reasons ...string) time.Duration {
	// An image index's failure is its failing platform's: its result
	// tells of that key's outcome too — when that key's platform is the
	// one it names as failed ("platform P: …"), not another of its
	// platforms.
	answers := map[string]string{key: ""}
	for _, s := range w.subs {
		for _, p := range s.platforms {
			if p.key == key {
				answers[s.key] = p.platform
			}
		}
	}
	for _, p := range w.published {
		platform, ok := answers[p.r.Data.Key]
		if !ok || p.at < at || p.r.Data.Status != v1.StatusFailed || !slices.Contains(reasons, p.r.Data.Reason) {
			continue
		}
		if platform == "" || strings.HasPrefix(p.r.Data.Message, "platform "+platform+":") ||
			strings.HasPrefix(p.r.Data.Message, "platform "+platform+" failed") {
			return p.at
		}
	}
	return simNever
}

const simNever = time.Duration(1 << 62)

func simSeconds(d time.Duration) string {
	if d == simNever {
		return "never"
	}
	return fmt.Sprintf("%.3fs", d.Seconds())
}

func (w *simWorld) report(out *simOutcome) string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d: %d violation(s)\n", w.seed, len(out.violations))
	fmt.Fprintf(&b, "replay: BUILDQ_SIM_SEED=%d BUILDQ_SIM_REPEAT=5 go test ./worker/ -run '^TestFaultSimulation$' -count=1 -v\n", w.seed)
	b.WriteString("  (the schedule repeats exactly; thread timing does not, so a violation may show in some runs only)\n")
	b.WriteString(w.sc.describe())
	b.WriteString("violations:\n")
	for _, v := range out.violations {
		fmt.Fprintf(&b, "  [%s] %s\n", v.class, v.detail)
	}
	if len(w.notes) > 0 {
		b.WriteString("notes:\n")
		for _, n := range w.notes {
			fmt.Fprintf(&b, "  %s\n", n)
		}
	}
	var keys []string
	for k, n := range w.keyNames {
		keys = append(keys, fmt.Sprintf("%s=%s", n, k[:12]))
	}
	slices.Sort(keys)
	fmt.Fprintf(&b, "keys: %s\n", strings.Join(keys, " "))
	b.WriteString("trace (s since the schedule began):\n")
	w.trace.mu.Lock()
	for _, l := range w.trace.lines {
		fmt.Fprintf(&b, "  %s\n", l)
	}
	if w.trace.dropped > 0 {
		fmt.Fprintf(&b, "  … %d more lines\n", w.trace.dropped)
	}
	w.trace.mu.Unlock()
	if os.Getenv("BUILDQ_SIM_LOGS") != "" {
		b.WriteString("worker logs:\n")
		w.logs.mu.Lock()
		for _, l := range w.logs.lines {
			fmt.Fprintf(&b, "  %s\n", l)
		}
		w.logs.mu.Unlock()
	}
	return b.String()
}
