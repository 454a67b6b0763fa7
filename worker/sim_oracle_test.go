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
	"strings"
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
	if _, err := w.js.CreateStream(c, jetstream.StreamConfig{
		Name: simRecordsStream, Storage: jetstream.FileStorage,
		Mirror: &jetstream.StreamSource{Name: "KV_" + v1.BuildsBucket},
	}); err != nil {
		return err
	}
	_, err := w.js.CreateStream(c, jetstream.StreamConfig{
		Name: simLedgerStream, Storage: jetstream.FileStorage,
		Mirror: &jetstream.StreamSource{Name: "KV_" + v1.RequestsBucket},
	})
	return err
}

// simLedgerStream copies every write of the request ledger, with the
// server's time of each (decidedAt).
const simLedgerStream = "SIM_LEDGER"

// readDecided reads when each request's decision was first stored in
// its ledger entry (request id → time since the schedule began).
func (w *simWorld) readDecided(ctx context.Context) (map[string]time.Duration, error) {
	idOf := map[string]string{}
	w.mu.Lock()
	for _, s := range w.subs {
		idOf["$KV."+v1.RequestsBucket+"."+RequestIndexKey(s.req.Tenant, s.id)] = s.id
	}
	w.mu.Unlock()
	out := map[string]time.Duration{}
	err := w.streamMsgs(ctx, simLedgerStream, func(m *jetstream.RawStreamMsg) error {
		id, ok := idOf[m.Subject]
		if _, seen := out[id]; !ok || seen || m.Header.Get("KV-Operation") != "" {
			return nil
		}
		var e v1.RequestEntry
		if json.Unmarshal(m.Data, &e) == nil && e.Result != nil {
			out[id] = m.Time.Sub(w.trace.t0)
		}
		return nil
	})
	return out, err
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
	// comes back to a Job left behind, takes leases). A second is a rule
	// of timing, judged by make sim, not under the race detector.
	ended := map[string]time.Duration{} // run → when its record first showed it final
	if raceDetector {
		w.judgeLimits(out)
		return
	}
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
