package worker

// The fault simulation's oracle for the build records and the Jobs: what a
// result alone cannot show (every run of a key builds the same image, so a
// result from the wrong run looks right). Issue 24: mutants that overwrote
// a newer run, applied another run's Job outcome, built a key twice or ran
// a tenant past its concurrency limit all passed the result checks.

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
	"github.com/buildq/buildq/internal/registry"
)

// simRecordRev is one revision of a build record (rev: the bucket's
// revision; at: when the server stored it).
type simRecordRev struct {
	at      time.Duration
	key     string
	rev     uint64
	deleted bool
	rec     v1.BuildRecord
}

// simRecordsStream copies every write to buildq-builds (a mirror of the
// bucket's stream, kept whole): the bucket keeps one revision per key, and
// a watcher stalls across a NATS restart, but a mirror resumes where it
// stopped, from the server's own store. A mirror keeps each write's
// sequence (its revision) and the time the server stored it, so a write
// is placed exactly among the Jobs' creations — a source would stamp it
// with the moment it copied it, later (the concurrency limit is judged on
// take-overs and Job creations a few milliseconds apart).
const simRecordsStream = "SIM_RECORDS"

// watchRecords starts copying the build records' writes.
func (w *simWorld) watchRecords(ctx context.Context) error {
	if !simPoll(30*time.Second, func() bool {
		c, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := w.js.KeyValue(c, v1.BuildsBucket)
		return err == nil
	}) {
		return errors.New("the workers did not create " + v1.BuildsBucket)
	}
	c, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := w.js.CreateStream(c, jetstream.StreamConfig{
		Name: simRecordsStream, Storage: jetstream.FileStorage,
		Mirror: &jetstream.StreamSource{Name: "KV_" + v1.BuildsBucket},
	})
	return err
}

// recordsCopied reports whether the copy holds the bucket's last write:
// the mirror's last sequence is the bucket stream's (a mirror catching up
// after a NATS restart can report no lag before it has).
func (w *simWorld) recordsCopied(ctx context.Context) bool {
	c, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	src, err := w.js.Stream(c, "KV_"+v1.BuildsBucket)
	if err != nil {
		return false
	}
	si, err := src.Info(c)
	if err != nil {
		return false
	}
	if si.State.LastSeq == 0 {
		return true
	}
	dst, err := w.js.Stream(c, simRecordsStream)
	if err != nil {
		return false
	}
	di, err := dst.Info(c)
	return err == nil && di.State.LastSeq >= si.State.LastSeq
}

// readRecords reads the copied writes, in order.
func (w *simWorld) readRecords(ctx context.Context) ([]simRecordRev, error) {
	var out []simRecordRev
	err := w.streamMsgs(ctx, simRecordsStream, func(m *jetstream.RawStreamMsg) error {
		rv := simRecordRev{at: m.Time.Sub(w.trace.t0), key: strings.TrimPrefix(m.Subject, "$KV."+v1.BuildsBucket+"."), rev: m.Sequence}
		if op := m.Header.Get("KV-Operation"); op != "" {
			rv.deleted = true
		} else if err := json.Unmarshal(m.Data, &rv.rec); err != nil {
			return nil //nolint:nilerr // a record that does not decode is no revision the oracle judges
		}
		out = append(out, rv)
		return nil
	})
	return out, err
}

// judgeRecords checks the build records' history and the Jobs against
// the runs they belong to. Called with w.mu and the node's lock held.
func (w *simWorld) judgeRecords(out *simOutcome) {
	n := w.node
	type keyState struct {
		run        string
		superseded map[string]bool
		succeeded  string // a run seen succeeded
		indexed    string // the image its record indexes (Repository@Digest)
	}
	// notThere reports whether ref, an image a succeeded record indexes,
	// is missing from the registry at the end (known: the registry
	// answered). Nothing in the simulation deletes an image, so one
	// missing was never pushed where its record says.
	notThere := func(ref string) (missing, known bool) {
		err, ok := w.indexed[ref]
		switch {
		case !ok:
			return false, false
		case err == nil:
			return false, true
		case registry.IsNotFound(err):
			return true, true
		}
		return false, false
	}
	keys := map[string]*keyState{}
	for _, rv := range w.records {
		if rv.deleted {
			continue
		}
		ks := keys[rv.key]
		if ks == nil {
			ks = &keyState{superseded: map[string]bool{}}
			keys[rv.key] = ks
		}
		r := rv.rec
		switch {
		case r.Run == "" || r.Run == ks.run:
		case ks.superseded[r.Run]:
			w.violate(out, "older-run-overwrite", "%s: revision %d at %.3fs is run %s (%s), which run %s had replaced: a run's record was overwritten by an older run",
				w.keyName(rv.key), rv.rev, rv.at.Seconds(), r.Run, r.State, ks.run)
		default:
			if ks.run != "" {
				ks.superseded[ks.run] = true
			}
			if ks.succeeded != "" && r.State == v1.StateBuilding {
				// Nothing deletes an image here: a build after a success is
				// never needed. Say whether the index pointed at the image
				// (then the worker ignored it) or elsewhere (then the
				// worker rebuilt because its own record was wrong, which
				// index-misplaced reports too).
				why := "its image is still in the registry"
				if missing, known := notThere(ks.indexed); missing {
					why = "its record indexes " + ks.indexed + ", where no image was ever pushed"
				} else if !known {
					why = "no image is ever deleted here"
				}
				w.violate(out, "redundant-build", "%s: run %s started at %.3fs (revision %d) although run %s had succeeded and %s",
					w.keyName(rv.key), r.Run, rv.at.Seconds(), rv.rev, ks.succeeded, why)
			}
			ks.run = r.Run
		}
		if r.State == v1.StateSucceeded {
			ref := r.Repository + "@" + r.Digest
			if ks.succeeded != r.Run || ks.indexed != ref {
				// A request answered from the index is sent to this
				// reference, and a worker asks the registry for it before
				// answering from it: it must be where the run pushed.
				if missing, _ := notThere(ref); missing {
					w.violate(out, "index-misplaced", "%s: run %s succeeded (revision %d at %.3fs) and its record indexes %s, which is not in the registry; the run pushed to %v",
						w.keyName(rv.key), r.Run, rv.rev, rv.at.Seconds(), ref, r.Pushed)
				}
			}
			ks.succeeded, ks.indexed = r.Run, ref
		}
		if r.Final() && r.JobUID != "" {
			j := n.jobs[r.JobUID]
			switch {
			case j == nil:
				w.violate(out, "outcome-of-unknown-job", "%s: run %s ended %s (revision %d) with the outcome of Job %s, which the node never ran",
					w.keyName(rv.key), r.Run, r.State, rv.rev, r.JobUID)
			case j.run != r.Run:
				w.violate(out, "outcome-of-another-run", "%s: run %s ended %s (revision %d) with the outcome of Job %s, a Job of run %s",
					w.keyName(rv.key), r.Run, r.State, rv.rev, r.JobUID, j.run)
			case j.key != rv.key:
				w.violate(out, "outcome-of-another-key", "%s: run %s ended with the outcome of Job %s of %s",
					w.keyName(rv.key), r.Run, r.JobUID, w.keyName(j.key))
			}
		}
	}
	// A worker deletes a Job only once its run ended (the owner after
	// storing the outcome, a cancel after ending the run) or when it is
	// another run's (stale): never the live Job of a run still building.
	// A write is placed when the server stored it, a deletion when the
	// node made it: a deletion counts only when the run still built a
	// while after it, which leaves room between the two clocks' readings.
	const lag = 500 * time.Millisecond
	for _, j := range n.order {
		if j.deleted == 0 || j.run == "" || len(j.deleteCause) == 0 || j.deleteCause[0] != 'w' {
			continue
		}
		var last *simRecordRev
		for i := range w.records {
			rv := &w.records[i]
			if rv.key == j.key && rv.at <= j.deleted+lag {
				last = rv
			}
		}
		if last != nil && !last.deleted && last.rec.Run == j.run && last.rec.State == v1.StateBuilding && last.at < j.deleted &&
			!w.restartedBetween(last.at, j.deleted) {
			w.violate(out, "live-job-deleted", "%s: %s deleted Job %s of run %s at %.3fs while that run was still building (revision %d, seen at %.3fs; %d revisions seen, the last at %.3fs)",
				w.keyName(j.key), j.deleteCause, j.uid, j.run, j.deleted.Seconds(), last.rev, last.at.Seconds(), len(w.records), w.records[len(w.records)-1].at.Seconds())
		}
	}
	// The run's owner deletes its Job as soon as the result is out: in
	// a calm stretch, within a second of the run's end (the janitor, which
	// comes back to a Job left behind, takes leases).
	ended := map[string]time.Duration{} // run → when its record first showed it final
	for _, rv := range w.records {
		if !rv.deleted && rv.rec.Final() && rv.rec.Run != "" {
			if _, ok := ended[rv.rec.Run]; !ok {
				ended[rv.rec.Run] = rv.at
			}
		}
	}
	for _, j := range n.order {
		tf, ok := ended[j.run]
		if !ok || j.run == "" || (j.deleted != 0 && j.deleted <= tf+time.Second) || !w.calm(tf-time.Second, tf+3*time.Second) {
			continue
		}
		when := "never"
		if j.deleted != 0 {
			when = fmt.Sprintf("at %.3fs by %s", j.deleted.Seconds(), j.deleteCause)
		}
		w.violate(out, "late-job-cleanup", "%s: Job %s of run %s, which ended at %.3fs with nothing in the way, was deleted %s",
			w.keyName(j.key), j.uid, j.run, tf.Seconds(), when)
	}
	w.judgeLimits(out)
}

// restartedBetween reports whether nats-server was down at some time
// between from and to. The copy of the records resumes after a restart
// from where it stopped, but a revision written just before the restart
// and replaced soon after it is gone from the bucket (one revision per
// key) before the copy gets to it: what the copy lacks then proves
// nothing.
func (w *simWorld) restartedBetween(from, to time.Duration) bool {
	for _, f := range w.sc.faults {
		if f.kind == "nats-restart" && f.at <= to && f.at+f.dur+time.Second >= from {
			return true
		}
	}
	return false
}

// judgeLimits checks the tenants' concurrency limits: whenever a Job is
// created, and whenever a run's Job changes holder, the Jobs running then
// that a tenant's requests run — the request holding the run
// (v1.BuildRecord.Holder), which is not always of the tenant whose request claimed
// it (a take-over by another tenant's request runs the claimer's Job) —
// are at most its limit: each holds one of the tenant's slots.
//
// A Job counts for its run's holder from the write that made it the
// holder on, not before, and for the previous holder until then: a
// taker's request runs the Job on its own slot, which it may have taken
// only a moment before, and the previous holder's request, when it comes
// back to the run, parks and frees its slot (a request waiting on another's
// build holds none). Seed 217 counted a take-over 160ms after the Job's
// creation from the creation on, while the slot it took was still another
// of the tenant's running Jobs'; seed 263 counted a Job taken over by
// another tenant's request against its claimer's tenant after the
// claimer's request had parked and its slot ran a new Job. A Job created
// before any write of its run the copy holds (the copy lost the claim to a
// NATS restart) counts for the run's first holder it holds. Called with
// w.mu and the node's lock held.
func (w *simWorld) judgeLimits(out *simOutcome) {
	n := w.node
	fair := w.fair()
	if len(fair.Concurrency) == 0 {
		return
	}
	tenantOf := map[string]string{} // ledger key → tenant
	idOf := map[string]string{}     // ledger key → request id
	for _, s := range w.subs {
		k := RequestIndexKey(s.req.Tenant, s.id)
		tenantOf[k], idOf[k] = s.req.Tenant, s.id
	}
	// holding: from when a Job counts for a tenant's request.
	type holding struct {
		from           time.Duration
		tenant, holder string
	}
	holdingOf := func(r *v1.BuildRecord) (holding, bool) {
		if t, ok := tenantOf[r.Holder]; ok {
			return holding{tenant: t, holder: idOf[r.Holder]}, true
		}
		if r.Holder == "" && r.Tenant != "" {
			return holding{tenant: r.Tenant, holder: r.RequestID}, true
		}
		return holding{}, false
	}
	// holdings lists who held j's run while j existed, in order: from its
	// creation the holder written last before it (the run's first when
	// none was), then each change.
	holdings := func(j *simJob) []holding {
		var revs []holding // in write order
		shown := 0         // how many were written by j's creation
		for _, rv := range w.records {
			if rv.deleted || rv.key != j.key || rv.rec.Run != j.run {
				continue
			}
			if h, ok := holdingOf(&rv.rec); ok {
				h.from = rv.at
				revs = append(revs, h)
				if rv.at <= j.created {
					shown = len(revs)
				}
			}
		}
		start, rest := holding{tenant: j.tenant}, revs
		switch {
		case shown > 0:
			start, rest = revs[shown-1], revs[shown:]
		case len(revs) > 0:
			start, rest = revs[0], revs[1:]
		}
		start.from = j.created
		hs := []holding{start}
		for _, h := range rest {
			if p := hs[len(hs)-1]; p.tenant != h.tenant || p.holder != h.holder {
				hs = append(hs, h)
			}
		}
		return hs
	}
	held := map[*simJob][]holding{}
	for _, j := range n.order {
		held[j] = holdings(j)
	}
	runningAt := func(j *simJob, t time.Duration) bool {
		return j.created <= t && (j.finished == 0 || j.finished > t) && (j.deleted == 0 || j.deleted > t)
	}
	holderAt := func(j *simJob, t time.Duration) holding {
		hs := held[j]
		h := hs[0]
		for _, x := range hs[1:] {
			if x.from > t {
				break
			}
			h = x
		}
		return h
	}
	for _, j := range n.order {
		for _, h := range held[j] {
			limit := fair.Concurrency[h.tenant]
			if limit == 0 || !runningAt(j, h.from) {
				continue
			}
			var running []string
			for _, o := range n.order {
				if !runningAt(o, h.from) {
					continue
				}
				oh := holderAt(o, h.from)
				if oh.tenant != h.tenant {
					continue
				}
				running = append(running, fmt.Sprintf("%s %s (created %.3fs by %s, held by %s since %.3fs)",
					w.keyName(o.key), o.uid, o.created.Seconds(), o.creator, oh.holder, oh.from.Seconds()))
			}
			if len(running) > limit {
				what := "created"
				if h.from != j.created {
					what = "taken over by " + h.holder
				}
				w.violate(out, "concurrency-limit", "tenant %s's requests run %d Jobs at %.3fs (%s %s %s), its limit is %d: %v",
					h.tenant, len(running), h.from.Seconds(), w.keyName(j.key), j.uid, what, limit, running)
			}
		}
	}
}

// simEvent is one progress event seen by the observer.
type simEvent struct {
	at time.Duration
	// sent is when the worker published it (its Time, its clock's skew
	// taken off; 0: unknown). An event published while the worker is cut
	// off NATS waits in its client's buffer, and is seen when the worker
	// reconnects: at can be seconds after the fact.
	sent   time.Duration
	id     string
	tenant string
	phase  v1.Phase
	worker string
	msg    string
}

// watchEvents records every progress event (core NATS, best effort: one
// lost in an outage leaves that request out of the checks below).
func (w *simWorld) watchEvents() error {
	_, err := w.obs.Subscribe(v1.EventsPrefix+".>", func(m *nats.Msg) {
		var e v1.Event
		if json.Unmarshal(m.Data, &e) != nil {
			return
		}
		var sent time.Duration
		var slot int
		if _, err := fmt.Sscanf(e.Worker, "w%d.", &slot); err == nil && slot >= 0 && slot < len(w.sc.skews) && !e.Time.IsZero() {
			sent = max(w.trace.since(e.Time.Add(-w.sc.skews[slot])), time.Nanosecond)
		}
		w.mu.Lock()
		w.events = append(w.events, simEvent{at: w.now(), sent: sent, id: e.RequestID, tenant: e.Tenant, phase: e.Phase, worker: e.Worker, msg: e.Message})
		w.mu.Unlock()
	})
	if err != nil {
		return err
	}
	return w.obs.Flush()
}

// simOrderSlack is how long after its publication a request must have
// been waiting before the order of takes is judged: intake, the queue's
// view (refreshed every 250–500 ms) and the wake-up announcements.
const simOrderSlack = 1500 * time.Millisecond

// calm reports whether nothing in the schedule could have held up the
// dispatch between from and to: no worker killed, stopped, paused,
// partitioned or lagging, no NATS outage, no injected API errors.
func (w *simWorld) calm(from, to time.Duration) bool {
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
	ended := map[string]time.Duration{} // the request stopped holding a slot
	for _, e := range w.events {
		switch e.phase {
		case v1.PhaseQueued:
			if _, ok := first[e.id]; !ok {
				first[e.id] = take{e.at, e.worker}
				takes = append(takes, e)
			}
		case v1.PhaseWaiting, v1.PhaseFinished:
			// A parked request frees its slot; one that joins a build
			// actively (a redelivery of the run's own request) keeps it.
			parked := strings.Contains(e.msg, "answered when it ends")
			if _, ok := ended[e.id]; !ok && (e.phase == v1.PhaseFinished || parked) {
				ended[e.id] = e.at
			}
		}
	}
	rank := func(p string) int {
		switch p {
		case v1.PriorityHigh:
			return 0
		case v1.PriorityLow:
			return 2
		}
		return 1
	}
	fair := w.fair()
	running := func(tenant, worker string, at time.Duration) (n int) {
		for id, t := range first {
			if t.at >= at || (worker != "" && t.worker != worker) || w.subByID[id] == nil || w.subByID[id].req.Tenant != tenant {
				continue
			}
			if end, ok := ended[id]; !ok || end > at {
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
			shareT := float64(running(t, tk.worker, tk.at)) / float64(fair.Weight(t))
			shareU := float64(running(u, tk.worker, tk.at)) / float64(fair.Weight(u))
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
	firstPub := map[string]time.Duration{}
	for _, p := range w.published {
		if t, ok := firstPub[p.id]; !ok || p.at < t {
			firstPub[p.id] = p.at
		}
	}
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
}

// watchIngest records every publish of a result into the stream.
func (w *simWorld) watchIngest() error {
	_, err := w.obs.Subscribe(v1.ResultsIngestPrefix+".>", func(m *nats.Msg) {
		var r v1.Result
		if json.Unmarshal(m.Data, &r) != nil {
			return
		}
		w.mu.Lock()
		w.ingest = append(w.ingest, simIngest{id: r.Data.RequestID, worker: strings.TrimPrefix(r.Source, "/buildq/worker/"), at: w.now()})
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
func (w *simWorld) judgePublishers(out *simOutcome) {
	first := map[string]simIngest{}
	for _, p := range w.ingest {
		f, ok := first[p.id]
		if !ok {
			first[p.id] = p
			continue
		}
		if p.worker != f.worker && w.calm(f.at-time.Second, p.at) {
			w.violate(out, "second-publisher", "the result of %s was published by %s at %.3fs and again by %s at %.3fs, with nothing in the way of the first",
				p.id, f.worker, f.at.Seconds(), p.worker, p.at.Seconds())
			first[p.id] = simIngest{id: p.id, worker: p.worker, at: p.at} // one report per publisher
		}
	}
}

// judgeHandledAfterAnswer checks that a request whose decision is recorded
// is not handled again: its redelivery publishes the recorded decision and
// starts nothing — no "taken" (queued) event of a new handling a while
// after its result was published. When the handling began is the event's
// own time, not when the observer saw it: a handler that took the request
// before the answer and was then cut off NATS (a stall) publishes its
// event at the reconnect, after the answer, although it took the request
// long before (seed 504). What such a handler may do after the answer is
// the ledger's business (build.go: answered(); judgeAnsweredBuilds).
// Called with w.mu held.
func (w *simWorld) judgeHandledAfterAnswer(out *simOutcome) {
	firstPub := map[string]time.Duration{}
	for _, p := range w.published {
		if t, ok := firstPub[p.id]; !ok || p.at < t {
			firstPub[p.id] = p.at
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
			w.violate(out, "handled-after-answer", "%s took request %s again at %.3fs (seen at %.3fs), whose result was published at %.3fs",
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
