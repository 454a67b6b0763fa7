package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	v1 "github.com/buildq/buildq/api/v1"
)

// The oracle's judgments of the order of service (priorities and shares in
// calm stretches) and of the request ledger against the results.

// simOrderSlack is how long after its publication a request must have
// been waiting before the order of takes is judged: intake, the queue's
// view (refreshed every 250–500 ms) and the wake-up announcements.
const simOrderSlack = 1500 * time.Millisecond

// simTakeLag is how long before its "queued" event a take may have been
// decided: the event goes out once the handler has opened the request's
// ledger entry, a KV round trip or more that a loaded machine stretches
// (the slots freed meanwhile change the shares the dispatcher saw).
const simTakeLag = time.Second

// calm reports whether nothing in the schedule could have held up the
// dispatch between from and to: no worker killed, stopped, paused,
// partitioned or lagging, no NATS outage, no injected API errors, and a
// machine that kept up (simStalls).
func (w *simWorld) calm(from, to time.Duration) bool {
	if w.stalls.overlaps(from, to, 2*time.Second) {
		return false
	}
	for _, f := range w.sc.faults {
		dur := f.dur
		switch {
		case f.kind == "cancel" && f.resubmit == 2:
			dur = 2500 * time.Millisecond // one worker's deletes held up (drive)
		case f.kind == "cancel", f.kind == "dup-publish", f.kind == "job-delete", f.kind == "pod-delete":
			continue
		}
		if f.at <= to && f.at+dur+2*time.Second >= from {
			return false
		}
	}
	return true
}

// judgeOrder checks the order in which requests are taken (the first
// "queued" event of each, on the worker that took it), in calm stretches
// of the schedule only:
//   - priorities: a tenant's request of a lower priority is not taken
//     while one of a higher priority, published well before, waits;
//   - shares: a worker does not take a request of one tenant while another
//     tenant without a concurrency limit had a request waiting well before
//     and fewer requests running per weight on that worker — by more than
//     one request of the first (a fetch takes a few at once).
//
// Called with w.mu held.
func (w *simWorld) judgeOrder(out *simOutcome) {
	type take struct {
		at     time.Duration
		worker string
	}
	first := map[string]take{}
	var takes []simEvent
	// Each time a request held a slot on a worker: from a take ("queued")
	// to its end or park. A request may hold one more than once (parked,
	// then requeued when the build it joined failed; handed back and
	// taken again): every one counts in its tenant's running work, as in
	// the dispatcher's.
	type holding struct {
		id, tenant, worker string
		from, to           time.Duration // to 0: to the end
	}
	var holdings []holding
	holdingNow := map[string]int{} // request id → its open holding's index
	// Held at intake, a request waited on its key's build, not in the
	// queue: it is judged from when it left the hold for the queue (never,
	// when it was answered where it was held).
	held := map[string]bool{}
	released := map[string]time.Duration{}
	for _, e := range w.events {
		if strings.HasPrefix(e.msg, "held at intake") {
			held[e.id] = true
		}
		if strings.HasPrefix(e.msg, "left intake's hold") {
			if _, ok := released[e.id]; !ok {
				released[e.id] = e.at
			}
		}
		switch e.phase {
		case v1.PhaseQueued:
			if _, ok := first[e.id]; !ok {
				first[e.id] = take{e.at, e.worker}
				takes = append(takes, e)
			}
			if i, ok := holdingNow[e.id]; ok {
				if holdings[i].worker == e.worker {
					continue // a redelivery to its holder: the same holding
				}
				holdings[i].to = e.at // taken by another: its former holder let it go
			}
			if s := w.subByID[e.id]; s != nil {
				holdingNow[e.id] = len(holdings)
				holdings = append(holdings, holding{id: e.id, tenant: s.req.Tenant, worker: e.worker, from: e.at})
			}
		case v1.PhaseWaiting, v1.PhaseFinished:
			// A parked request frees its slot; one that joins a build
			// actively (a redelivery of the run's own request) keeps it.
			// Only its holder's: a former holder's late event does not
			// end another worker's holding.
			parked := strings.Contains(e.msg, "answered when it ends")
			if i, ok := holdingNow[e.id]; ok && holdings[i].worker == e.worker && (e.phase == v1.PhaseFinished || parked) {
				holdings[i].to = e.at
				delete(holdingNow, e.id)
			}
		}
	}
	rank := v1.PriorityRank
	fair := w.fair()
	// running counts tenant's requests holding a slot on worker between
	// from and to: throughout (some false), or at some moment (some true).
	running := func(tenant, worker string, from, to time.Duration, some bool) (n int) {
		for _, h := range holdings {
			if h.tenant != tenant || h.worker != worker {
				continue
			}
			if some && h.from < to && (h.to == 0 || h.to > from) || !some && h.from < from && (h.to == 0 || h.to > to) {
				n++
			}
		}
		return n
	}
	for _, tk := range takes {
		s := w.subByID[tk.id]
		if s == nil {
			continue
		}
		for _, o := range w.subs {
			if o == s || !o.accepted || o.start+simOrderSlack > tk.at {
				continue
			}
			if rel, ok := released[o.id]; held[o.id] && (!ok || rel+simOrderSlack > tk.at) {
				continue
			}
			if ot, ok := first[o.id]; !ok || ot.at <= tk.at+200*time.Millisecond {
				// Taken already (or in the same fetch, whose requests
				// start a moment apart), or never seen taken (an event
				// lost): not judged.
				continue
			}
			if !w.calm(o.start, tk.at) {
				continue
			}
			if o.req.Tenant == s.req.Tenant {
				if rank(o.req.Priority) < rank(s.req.Priority) {
					w.violate(out, "priority-order", "%s took %s of %s (priority %q) at %.3fs while %s (priority %q, published at %.3fs) waited",
						tk.worker, s.id, s.req.Tenant, s.req.Priority, tk.at.Seconds(), o.id, o.req.Priority, o.start.Seconds())
				}
				continue
			}
			t, u := o.req.Tenant, s.req.Tenant
			if fair.Concurrency[t] > 0 {
				// Whether t may take a slot depends on its slots, some of
				// them kept for requests handed back or retried, which
				// the events do not show: not judged.
				continue
			}
			// The take was decided up to simTakeLag before its event:
			// the waiting tenant's share is the most it had, the
			// taker's the least, over that stretch (the take itself
			// not counted).
			shareT := float64(running(t, tk.worker, tk.at-simTakeLag, tk.at, true)) / float64(fair.Weight(t))
			shareU := float64(running(u, tk.worker, tk.at-simTakeLag, tk.at, false)) / float64(fair.Weight(u))
			if shareU >= shareT+1 {
				w.violate(out, "share-order", "%s took %s of %s at %.3fs (%s running %.1f per weight there) while %s of %s (%.1f per weight), published at %.3fs, waited",
					tk.worker, s.id, u, tk.at.Seconds(), u, shareU, o.id, t, shareT, o.start.Seconds())
			}
		}
	}
}

// readLedger reads every accepted request's ledger entry after the world
// settled (id → entry; absent: none).
func (w *simWorld) readLedger(ctx context.Context) (map[string]*v1.RequestEntry, error) {
	kv, err := w.js.KeyValue(ctx, v1.RequestsBucket)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	subs := slices.Clone(w.subs)
	w.mu.Unlock()
	out := map[string]*v1.RequestEntry{}
	for _, s := range subs {
		if !s.accepted {
			continue
		}
		e, err := kv.Get(ctx, RequestIndexKey(s.req.Tenant, s.id))
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var le v1.RequestEntry
		if err := json.Unmarshal(e.Value(), &le); err != nil {
			return nil, err
		}
		out[s.id] = &le
	}
	return out, nil
}

// judgeLedger checks that the ledger holds, for every request with a
// stored result, that same decision: the status service answers from it,
// and a redelivery publishes it again rather than a new one (a decision
// published without being recorded first is a decision a redelivery may
// contradict, which the stream's duplicate window would then hide).
// Called with w.mu held.
func (w *simWorld) judgeLedger(out *simOutcome) {
	for _, r := range w.finalStored {
		s := w.subByID[r.id]
		if s == nil {
			continue
		}
		le := w.ledger[r.id]
		stored := decisionOf(r.subject, r.r)
		switch {
		case le == nil:
			w.violate(out, "ledger-disagrees", "request %s has a stored result (%s) and no ledger entry", r.id, stored)
		case le.Result == nil:
			w.violate(out, "ledger-disagrees", "request %s has a stored result (%s) and its ledger entry holds no decision (state %q)", r.id, stored, le.State)
		default:
			rec := decisionOf(r.subject, v1.Result{Data: *le.Result})
			if !rec.same(stored) {
				w.violate(out, "ledger-disagrees", "request %s: stored result %s, its ledger's decision %s", r.id, stored, rec)
			}
		}
	}
}

// judgeAnsweredBuilds checks that no run is started for a request already
// answered: a handler that stalled while its redelivered copy was answered
// elsewhere starts nothing (the ledger check before claiming, joining or
// taking over). A run's first revision names its holder; the holder's
// request must not have had its result published a while before.
// Called with w.mu held.
func (w *simWorld) judgeAnsweredBuilds(out *simOutcome) {
	idOf := map[string]string{} // ledger key → request id
	for _, s := range w.subs {
		idOf[RequestIndexKey(s.req.Tenant, s.id)] = s.id
	}
	firstPub := w.firstPublished()
	seen := map[string]bool{}
	for _, rv := range w.records {
		if rv.deleted || rv.rec.Run == "" || seen[rv.rec.Run] {
			continue
		}
		seen[rv.rec.Run] = true
		id, ok := idOf[rv.rec.Holder]
		if !ok {
			continue
		}
		if t, ok := firstPub[id]; ok && t+200*time.Millisecond < rv.at {
			w.violate(out, "build-for-answered-request", "%s: run %s started at %.3fs for request %s, whose result had been published at %.3fs",
				w.keyName(rv.key), rv.rec.Run, rv.at.Seconds(), id, t.Seconds())
		}
	}
}

// simIngest is one publish of a result into BUILDQ_RESULTS, stored or not
// (seen on the ingest subject: every attempt).
type simIngest struct {
	id, worker string
	at         time.Duration
	status     v1.Status
}

// watchIngest records every publish of a result into the stream.
func (w *simWorld) watchIngest() error {
	_, err := w.obs.Subscribe(v1.ResultsIngestPrefix+".>", func(m *nats.Msg) {
		var r v1.Result
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		w.mu.Lock()
		w.ingest = append(w.ingest, simIngest{id: r.Data.RequestID, worker: strings.TrimPrefix(r.Source, "/buildq/worker/"), at: w.now(), status: r.Data.Status})
		w.mu.Unlock()
	})
	if err != nil {
		return err
	}
	return w.obs.Flush()
}

// judgePublishers checks "one publisher per decision": the party whose
// compare-and-swap recorded a decision publishes it, and another worker
// publishes it only when that party is gone (it died between recording
// and publishing: not in a calm stretch). The stream's duplicate window
// keeps subscribers from seeing a second publish, so this is the rule that
// keeps the work (and the messages) to one. Called with w.mu held.
//
// A cancel is the exception: it publishes the "canceled" of each request
// it marked, to learn whether that, or a finished build's result
// published before its record, was stored first; either publish may then
// be a second one, while the cancel is in flight.
func (w *simWorld) judgePublishers(out *simOutcome) {
	first := map[string]simIngest{}
	for _, p := range w.ingest {
		f, ok := first[p.id]
		if !ok {
			first[p.id] = p
			continue
		}
		if p.worker != f.worker && w.calm(f.at-time.Second, p.at) && !w.canceling(p.id, p.at) {
			w.violate(out, "second-publisher", "the result of %s was published by %s at %.3fs and again by %s at %.3fs, with nothing in the way of the first",
				p.id, f.worker, f.at.Seconds(), p.worker, p.at.Seconds())
			first[p.id] = simIngest{id: p.id, worker: p.worker, at: p.at} // one report per publisher
		}
	}
}

// firstPublished is when each request's result first reached core
// subscribers (request id → since the schedule began). Called with w.mu
// held.
func (w *simWorld) firstPublished() map[string]time.Duration {
	first := map[string]time.Duration{}
	for _, p := range w.published {
		if t, ok := first[p.id]; !ok || p.at < t {
			first[p.id] = p.at
		}
	}
	return first
}

// canceling reports whether a cancel that names request id (its id, or
// its key) was in flight at "at" (with 100 ms of slack each side).
func (w *simWorld) canceling(id string, at time.Duration) bool {
	s := w.subByID[id]
	if s == nil {
		return false
	}
	for _, c := range w.cancels {
		names := c.target == id || (c.target == s.key && c.key == s.key)
		if names && c.tenant == s.req.Tenant && c.sent-100*time.Millisecond <= at && (c.done == simNever || at <= c.done+100*time.Millisecond) {
			return true
		}
	}
	return false
}

// judgeCancelReplies checks that a cancel of a request by its id that
// said "canceled" was right: the request's stored result is "canceled".
// A finished build's result may be stored before its decision is
// recorded, so a cancel mark alone decides nothing; the cancel says
// "canceled" only of a "canceled" it saw stored (or says it could not
// confirm it). Called with w.mu held.
func (w *simWorld) judgeCancelReplies(out *simOutcome) {
	stored := map[string][]simStored{}
	for _, r := range w.finalStored {
		stored[r.id] = append(stored[r.id], r)
	}
	for _, c := range w.cancels {
		s := w.subByID[c.target]
		if s == nil || !c.canceled || c.done == simNever || strings.Contains(c.reply, tenantapiNotConfirmed) {
			continue
		}
		for _, r := range stored[c.target] {
			if r.r.Data.Status != v1.StatusCanceled {
				w.violate(out, "cancel-unhonored", "the cancel of request %s answered at %.3fs said canceled (%q), and its stored result is %s",
					c.target, c.done.Seconds(), c.reply, decisionOf(r.subject, r.r))
			}
		}
	}
}

// tenantapiNotConfirmed is what a cancel reply says of a "canceled" it
// recorded and could not confirm stored (tenantapi).
const tenantapiNotConfirmed = "its result event says how it ended"

// judgeHandledAfterAnswer checks that a request whose decision is recorded
// is not handled again: its redelivery publishes the recorded decision and
// starts nothing — no "taken" (queued) event of a new handling a while
// after its result was published and its decision recorded. When the handling began is the event's
// own time, not when the observer saw it: a handler that took the request
// before the answer and was then cut off NATS (a stall) publishes its
// event at the reconnect, after the answer, although it took the request
// long before (seed 504). What such a handler may do after the answer is
// the ledger's business (build.go: answered(); judgeAnsweredBuilds).
// Called with w.mu held.
func (w *simWorld) judgeHandledAfterAnswer(out *simOutcome) {
	firstPub := w.firstPublished()
	for id, t := range firstPub {
		// A finished build's result is published before its decision
		// is recorded: until it is, a redelivery (its handler cut off
		// NATS or killed between the two) is handled again, decides
		// the same from the run, and adopts the stored result.
		if d, ok := w.decidedAt[id]; ok && d > t {
			firstPub[id] = d
		}
	}
	for _, e := range w.events {
		if e.phase != v1.PhaseQueued {
			continue
		}
		t, ok := firstPub[e.id]
		if !ok || e.at <= t+500*time.Millisecond {
			continue
		}
		took := e.at
		if e.sent > 0 {
			took = e.sent
		}
		if took > t+500*time.Millisecond {
			w.violate(out, "handled-after-answer", "%s took request %s again at %.3fs (seen at %.3fs), whose result was published and decision recorded by %.3fs",
				e.worker, e.id, took.Seconds(), e.at.Seconds(), t.Seconds())
			continue
		}
		w.notes = append(w.notes, fmt.Sprintf("%s took request %s at %.3fs, before its result was published (%.3fs); the event was seen only at %.3fs (the worker was cut off NATS)",
			e.worker, e.id, took.Seconds(), t.Seconds(), e.at.Seconds()))
	}
}

// TestSimOracleCountsAJobForItsHolderFromTheTakeOver: the concurrency-limit
// oracle counts a Job for the request holding its run from the write that
// made it the holder, not from the Job's creation (seeds 217 and 263 of
// the fault simulation were false alarms of an oracle that did), and it
// judges a take-over as it judges a creation.
func TestSimOracleCountsAJobForItsHolderFromTheTakeOver(t *testing.T) {
	at := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	tenants := map[string]string{"r09": "acme", "r26": "acme", "r17": "acme", "r16": "acme", "x01": "acme", "r22": "globex", "r10": "globex"}
	type write struct {
		at                 float64
		key, run           string
		owner, holder      string // holder: a request id
		state, claimTenant string
	}
	type job struct {
		key, uid, run     string
		created, finished float64
	}
	judge := func(jobs []job, writes []write) []simViolation {
		w := &simWorld{seed: 1, node: &simNode{jobs: map[string]*simJob{}}} // odd seed: acme's limit is 2
		for id, tenant := range tenants {
			w.subs = append(w.subs, &simSub{id: id, req: &v1.Request{Tenant: tenant, RequestID: id}})
		}
		for i, wr := range writes {
			w.records = append(w.records, simRecordRev{at: at(wr.at), key: wr.key, rev: uint64(i + 1), rec: v1.BuildRecord{
				Key: wr.key, State: wr.state, Run: wr.run, Owner: wr.owner, Tenant: wr.claimTenant,
				Holder: RequestIndexKey(tenants[wr.holder], wr.holder)}})
		}
		for _, j := range jobs {
			sj := &simJob{key: j.key, uid: j.uid, run: j.run, creator: "w1.0", created: at(j.created), finished: at(j.finished)}
			w.node.jobs[j.uid], w.node.order = sj, append(w.node.order, sj)
		}
		var out simOutcome
		w.judgeLimits(&out)
		return out.violations
	}
	b := func(at float64, key, run, owner, holder, claimTenant string) write {
		return write{at: at, key: key, run: run, owner: owner, holder: holder, state: v1.StateBuilding, claimTenant: claimTenant}
	}

	// Seed 217: acme runs K4 and K1 (its limit); globex's request r22
	// creates K3's Job and lets the run go (a transient error after the
	// create committed); acme's x01 takes the run over on the slot K4's
	// request frees when K4's Job finishes.
	seed217 := func(takeOver, k4Finished float64) []simViolation {
		return judge([]job{
			{"K4", "uid-12", "a", 4.0, k4Finished},
			{"K1", "uid-13", "b", 4.0, 0},
			{"K3", "uid-14", "c", 5.039, 0},
		}, []write{
			b(3.99, "K4", "a", "w1.0", "r09", "acme"),
			b(3.99, "K1", "b", "w1.0", "r26", "acme"),
			b(5.038, "K3", "c", "w1.0", "r22", "globex"),
			b(5.040, "K3", "c", "", "r22", "globex"),
			b(takeOver, "K3", "c", "w1.0", "x01", "globex"),
		})
	}
	if v := seed217(5.130, 5.127); len(v) != 0 {
		t.Errorf("seed 217 (K3 taken over by acme 3ms after K4 finished): %v; want no violation", v)
	}
	// The same take-over while K4 still runs is a third Job of acme's,
	// however long after K3's creation it comes.
	for _, takeOver := range []float64{5.100, 5.900} {
		v := seed217(takeOver, 6.0)
		if len(v) != 1 || v[0].class != "concurrency-limit" || !strings.Contains(v[0].detail, "taken over by x01") {
			t.Errorf("K3 taken over by acme at %.3fs while K4 runs: %v; want one concurrency-limit violation at the take-over", takeOver, v)
		}
	}

	// Seed 263: acme's r09 and r17 run K0 and K2; r17's worker stops and
	// lets K2's run go; globex's r10 takes it over, r17 parks and frees
	// its slot, and acme's r16 runs K3 on it.
	seed263 := func(k3Claimed float64) []simViolation {
		return judge([]job{
			{"K2", "uid-4", "e", 4.226, 0},
			{"K0", "uid-6", "d", 4.440, 0},
			{"K3", "uid-10", "f", k3Claimed + 0.001, 0},
		}, []write{
			b(4.050, "K2", "e", "w1.0", "r17", "acme"),
			b(4.053, "K0", "d", "w1.0", "r09", "acme"),
			b(5.263, "K2", "e", "", "r17", "acme"),
			b(5.263, "K0", "d", "", "r09", "acme"),
			b(5.271, "K2", "e", "w0.0", "r10", "acme"),
			b(5.273, "K0", "d", "w0.0", "r09", "acme"),
			b(k3Claimed, "K3", "f", "w0.0", "r16", "acme"),
		})
	}
	if v := seed263(5.274); len(v) != 0 {
		t.Errorf("seed 263 (K3 created after globex took K2 over): %v; want no violation", v)
	}
	if v := seed263(5.267); len(v) != 1 || v[0].class != "concurrency-limit" {
		t.Errorf("K3 created before globex took K2 over: %v; want one concurrency-limit violation", v)
	}
}

// TestSimOracleSharesCountEveryHoldingAndTheTakesLag: the share-order
// judgment counts a request as often as it holds a slot (parked, then
// requeued and taken again), and judges a take on the shares of the
// stretch in which it may have been decided (simTakeLag before its
// event); a take made while the waiting tenant ran nothing over that
// whole stretch is still a violation.
func TestSimOracleSharesCountEveryHoldingAndTheTakesLag(t *testing.T) {
	sec := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	type ev struct {
		at    float64
		id    string
		phase v1.Phase
		msg   string
	}
	judge := func(events []ev) []simViolation {
		// Even seed: no concurrency limits, equal weights.
		w := &simWorld{seed: 2, sc: &simSchedule{}, subByID: map[string]*simSub{}}
		for _, s := range []struct {
			id, tenant string
			start      float64
		}{{"a1", "acme", 0.1}, {"a2", "acme", 0.2}, {"a3", "acme", 0.3}, {"g1", "globex", 0.1}, {"g2", "globex", 0.5}} {
			sub := &simSub{id: s.id, req: &v1.Request{Tenant: s.tenant, RequestID: s.id, Priority: v1.PriorityNormal}, start: sec(s.start), accepted: true}
			w.subs, w.subByID[s.id] = append(w.subs, sub), sub
		}
		for _, e := range events {
			w.events = append(w.events, simEvent{at: sec(e.at), id: e.id, tenant: w.subByID[e.id].req.Tenant, phase: e.phase, worker: "w0.0", msg: e.msg})
		}
		var out simOutcome
		w.judgeOrder(&out)
		return out.violations
	}
	taken := func(at float64, id string) ev { return ev{at, id, v1.PhaseQueued, "taken"} }
	parked := func(at float64, id string) ev {
		return ev{at, id, v1.PhaseWaiting, "joined a build: answered when it ends"}
	}
	done := func(at float64, id string) ev { return ev{at, id, v1.PhaseFinished, "succeeded"} }

	// a3, taken half a second (within simTakeLag) before a2's take
	// event, may have been taken in the same fetch or after a2's take
	// was decided: acme's share is what ran throughout (a1), even with
	// g1's.
	if v := judge([]ev{taken(1, "a1"), taken(1, "g1"), taken(4.5, "a3"), taken(5, "a2"), taken(8, "g2")}); len(v) != 0 {
		t.Errorf("a take decided, maybe, before a3's: %v", v)
	}
	// a1 runs from 1 s; globex's g1 is parked at 2 s and taken again at
	// 3 s. At 5 s acme's a2 is taken while g2 (published at 0.5 s)
	// waits until 8 s: one request each, no violation.
	if v := judge([]ev{taken(1, "a1"), taken(1, "g1"), parked(2, "g1"), taken(3, "g1"), taken(5, "a2"), taken(8, "g2")}); len(v) != 0 {
		t.Errorf("a take with the tenants' shares even (g1 running again since 3 s): %v", v)
	}
	// g1 never taken again: acme ran one more than globex when it took
	// a2 while g2 waited.
	if v := judge([]ev{taken(1, "a1"), taken(1, "g1"), parked(2, "g1"), taken(5, "a2"), taken(8, "g2")}); len(v) != 1 || v[0].class != "share-order" {
		t.Errorf("a take while the waiting tenant ran nothing: %v; want one share-order violation", v)
	}
	// g1 ended just before a2's take event, within simTakeLag: the take
	// may have been decided while it still ran.
	lagged := 5 - simTakeLag.Seconds()/2
	if v := judge([]ev{taken(1, "a1"), taken(1, "g1"), done(lagged, "g1"), taken(5, "a2"), taken(8, "g2")}); len(v) != 0 {
		t.Errorf("a take whose decision may have come before g1 ended at %.1fs: %v", lagged, v)
	}
	// g1 ended well before it: judged.
	early := 5 - 2*simTakeLag.Seconds()
	if v := judge([]ev{taken(1, "a1"), taken(1, "g1"), done(early, "g1"), taken(5, "a2"), taken(8, "g2")}); len(v) != 1 || v[0].class != "share-order" {
		t.Errorf("a take %.1fs after g1 ended: %v; want one share-order violation", 5-early, v)
	}
}
