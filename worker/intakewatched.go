package worker

import (
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
	"github.com/buildq/buildq/worker/internal/runs"
)

// Intake's looks from the records' watch (docs/design.md §2d, item 4).
// The room's watch of every build record (intakehold.go) shows each
// record's changes as they are written; the room keeps the record of
// each update for a while, and intake's look at a key takes it instead
// of reading the record (answer.go's verifiedHit). A kept record stands
// only while the watch that showed it runs and the connection it came
// on has not broken since.

// seenRev is a record revision the watch showed, and when. val is the
// record at rev, kept for intake's looks (watchedRecord): a put the watch
// showed since it last (re)started, while the room keeps fewer than
// maxWatchedRecords; nil otherwise.
type seenRev struct {
	rev uint64
	at  time.Time
	val []byte
}

const (
	// seenKeep is how long a record revision the watch showed is kept
	// after it showed it.
	seenKeep = 5 * time.Minute
	// maxWatchedRecords bounds the records kept for intake's looks.
	maxWatchedRecords = 32768
)

// watchStarted forgets the records kept for intake's looks: a watch
// (re)started shows only what changes from now on, and what changed
// before it — while no watch ran — was not seen. The revisions stay: a
// look older than one of them is still behind the record. r.mu held.
func (r *intakeRoom) watchStarted() {
	r.reconnects, _ = r.w.connState()
	if mutant.On("watched-records-kept-across-watches") {
		return
	}
	r.forgetRecords()
}

// connTrusted reports whether records may be kept and served now: the
// connection is up. When it reconnected since it was last asked, the
// watch resumes where it was and shows what changed meanwhile late, so
// what it showed before may be behind by the outage: those records are
// forgotten, and looks read until the watch shows more. r.mu held.
func (r *intakeRoom) connTrusted() bool {
	n, up := r.w.connState()
	if n != r.reconnects && !mutant.On("watched-records-kept-across-reconnects") {
		r.reconnects = n
		r.forgetRecords()
	}
	return up
}

// forgetRecords drops every record kept for intake's looks; the
// revisions stay. r.mu held.
func (r *intakeRoom) forgetRecords() {
	for k, sr := range r.seen {
		if sr.val != nil {
			r.keep(k, sr, seenRev{rev: sr.rev, at: sr.at})
		}
	}
}

// keep replaces key's entry in seen, which was cur, with sr (a zero sr:
// removed), counting the records kept. r.mu held.
func (r *intakeRoom) keep(key string, cur, sr seenRev) {
	if cur.val != nil {
		r.kept--
	}
	if sr.val != nil {
		r.kept++
	}
	if sr.rev == 0 {
		delete(r.seen, key)
		return
	}
	r.seen[key] = sr
}

// watchedRecord is key's record as the records' watch last showed it,
// with its revision, when the watch runs and kept it (seenRev): intake's
// look at a key whose record changed in the last minutes costs no read.
// It is as fresh as the watch, which a replica's read is not always:
// a record building here may have ended a moment ago, and a hold on it
// is let go when the update comes (or at once, when it came between the
// look and the hold: hold's revision check); a record succeeded here is
// answered only when the registry shows its image, as for a read.
func (r *intakeRoom) watchedRecord(key string) (*v1.BuildRecord, uint64, bool) {
	if r == nil {
		return nil, 0, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.connTrusted() {
		return nil, 0, false
	}
	sr, ok := r.seen[key]
	if !r.open || !ok || sr.val == nil {
		return nil, 0, false
	}
	return runs.Decode(key, sr.val), sr.rev, true
}

// connState is how many times the worker's connection reconnected, and
// whether it is up.
func (w *Worker) connState() (reconnects uint64, up bool) {
	if w.nc == nil {
		return 0, true
	}
	return w.nc.Stats().Reconnects, w.nc.IsConnected()
}
