package worker

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// Intake's look, carried to the handler (docs/design.md §2d). Intake
// reads a request's build record to answer cache hits; when it finds no
// record, the request is a build, and its handler — most often this
// worker's own dispatcher, a millisecond later — would read the record
// again and then send the preflight HEAD of its first tag (§2 step 4), in
// sequence, before its claim. Instead:
//
//   - the absence intake saw stands for lookAheadFresh from the read's
//     start, like any read of the first look (lookahead.go): the queue's
//     handler and the handler's first look take it instead of reading
//     again. A claim on it is a create, which fails if a record appeared
//     meanwhile, and the walk then reads afresh; this worker forgets the
//     absence as soon as it claims the key itself.
//   - when the request is about to be taken straight from intake by this
//     worker (its dispatcher waits idle and the request may be: fairq's
//     direct.go), intake sends the preflight HEAD at once — beside its
//     read of the record when it knows of no record of the key
//     (headBesideRead), after it otherwise — and the
//     handler's first look waits for that HEAD instead of sending its
//     own — if it was sent within lookAheadFresh of the walk, and
//     answered without error (an error sends a HEAD of the handler's
//     own). What it found is told to nobody before the handler has shown
//     the tenant holds the content, as before. No other request has one
//     sent ahead, so a backlog of queued requests, or a tenant over its
//     limits, costs no HEAD each that nothing could use.

// intakeLooks is what intake saw of records and tags, by key and by tag.
type intakeLooks struct {
	mu       sync.Mutex
	absent   map[string]time.Time       // key → when the read that found no record started
	building map[string]recordLook      // key → the read that found it building
	pre      map[string]*preflightAhead // tenant and tag → the HEAD sent ahead
}

// preflightAhead is a preflight HEAD intake sent; done closes when read
// is set.
type preflightAhead struct {
	sent time.Time
	done chan struct{}
	read preflightRead
}

// preflightAheadTimeout bounds a HEAD sent ahead (with its Harbor
// project's creation), as the handler's own request-scoped one is bounded
// by the registry client's retries.
const preflightAheadTimeout = 30 * time.Second

// maxIntakeLooks bounds each map; past it, the map starts again (what
// it held answers nothing once it is stale).
const maxIntakeLooks = 4096

// sawAbsent remembers that a read of key's record, started at at, found
// none.
func (l *intakeLooks) sawAbsent(key string, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.absent == nil || len(l.absent) >= maxIntakeLooks {
		l.absent = map[string]time.Time{}
	}
	if cur, ok := l.absent[key]; !ok || at.After(cur) {
		l.absent[key] = at
	}
}

// absentSince is when a read that found no record of key started, if
// that read still stands (within lookAheadFresh of now).
func (l *intakeLooks) absentSince(key string) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	at, ok := l.absent[key]
	if !ok || (time.Since(at) >= lookAheadFresh && !mutant.On("stale-absence")) {
		return time.Time{}, false
	}
	return at, true
}

// forget drops what was seen of key: this worker wrote its record, or
// the record changed (intakehold.go).
func (l *intakeLooks) forget(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.absent, key)
	delete(l.building, key)
}

// recordLook is what a read of a record found (intakehold.go): "absent"
// or "building", when the read started, and of a building record its
// revision, its claimer's tenant and how long the run may sit unchanged
// before it counts as lapsed.
type recordLook struct {
	state  string
	at     time.Time
	rev    uint64
	tenant string
	lapse  time.Duration
}

// sawBuilding remembers that a read of key's record, started at at, found
// rec building at revision rev.
func (l *intakeLooks) sawBuilding(key string, rec *v1.BuildRecord, rev uint64, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.building == nil || len(l.building) >= maxIntakeLooks {
		l.building = map[string]recordLook{}
	}
	l.building[key] = recordLook{state: "building", at: at, rev: rev, tenant: rec.Tenant, lapse: rec.LapseAfter()}
}

// seen is what the last read of key's record that still stands (within
// lookAheadFresh of now) found; state "" when none stands or it found
// anything but "absent" or "building".
func (l *intakeLooks) seen(key string) recordLook {
	l.mu.Lock()
	defer l.mu.Unlock()
	if at, ok := l.absent[key]; ok && time.Since(at) < lookAheadFresh {
		return recordLook{state: "absent", at: at}
	}
	if b, ok := l.building[key]; ok && time.Since(b.at) < lookAheadFresh {
		return b
	}
	return recordLook{}
}

func preflightKey(tenant, tag string) string { return tenant + " " + tag }

// headBesideRead reports whether intake sends req's preflight HEAD before
// it reads key's record, for a request about to be taken straight from
// intake: its tenant was shown to hold the content, and nothing this
// worker knows says the key has a record — no verified hit, and no
// record the records' watch showed (intakewatched.go). Such a key is
// most often a new build, whose walk waits on the HEAD; a hit among
// them costs one HEAD that nothing uses. Keys this worker knows built
// or building cost none, so a stream of hits sends no HEAD each.
func (w *builder) headBesideRead(req *v1.Request, key string) bool {
	if mutant.On("no-preflight-ahead") || mutant.On("preflight-after-read") || !w.shownHeld(req) {
		return false
	}
	if mutant.On("preflight-beside-every-read") {
		return true
	}
	if _, ok := w.hits.fresh(key, time.Now()); ok {
		return false
	}
	_, _, watched := w.room.watchedRecord(key)
	return !watched
}

// sendPreflight sends req's preflight HEAD now, in its own goroutine,
// unless one sent ahead for the same tenant and tag still stands.
func (w *builder) sendPreflight(ctx context.Context, req *v1.Request, key, repo string, dests []string) {
	pk := preflightKey(req.Tenant, dests[0])
	w.looks.mu.Lock()
	if p, ok := w.looks.pre[pk]; ok && time.Since(p.sent) < lookAheadFresh {
		w.looks.mu.Unlock()
		return
	}
	if w.looks.pre == nil || len(w.looks.pre) >= maxIntakeLooks {
		w.looks.pre = map[string]*preflightAhead{}
	}
	p := &preflightAhead{sent: time.Now(), done: make(chan struct{})}
	w.looks.pre[pk] = p
	w.looks.mu.Unlock()
	go func() {
		defer close(p.done)
		defer func() {
			if r := recover(); r != nil {
				// The handler sends its own HEAD (and meets the panic
				// there, if it is the registry client's).
				p.read = preflightRead{err: fmt.Errorf("preflight sent ahead panicked: %v", r)}
			}
		}()
		// Not intake's lookup deadline: the HEAD outlives the admission
		// and gets what the handler's own would (ctx is the worker's,
		// ended when it stops): a slow registry costs the handler that
		// waits on it no more than its own HEAD would.
		ctx, cancel := context.WithTimeout(ctx, preflightAheadTimeout)
		defer cancel()
		found, err := w.preflight(ctx, req, key, repo, dests)
		p.read = preflightRead{found: found, err: err}
	}()
}

// forgetPreflight drops the HEADs sent ahead for tag, whoever sent them:
// an image was found there since (a build Pod refused to build over it,
// v1.ReasonTagTaken), so an earlier HEAD's "absent" no longer stands,
// however recent.
func (l *intakeLooks) forgetPreflight(tag string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for k := range l.pre {
		if _, t, _ := strings.Cut(k, " "); t == tag {
			delete(l.pre, k)
		}
	}
}

// preflightSent is the preflight HEAD intake sent for req's first tag, if
// it was sent within lookAheadFresh; ok false when there is none.
func (w *builder) preflightSent(req *v1.Request, dests []string) (*preflightAhead, bool) {
	w.looks.mu.Lock()
	defer w.looks.mu.Unlock()
	p, ok := w.looks.pre[preflightKey(req.Tenant, dests[0])]
	if !ok || time.Since(p.sent) >= lookAheadFresh {
		return nil, false
	}
	return p, true
}

// wait is p's read once it is in, or ok false when ctx ended first or the
// HEAD failed (the caller then sends its own).
func (p *preflightAhead) wait(ctx context.Context) (preflightRead, bool) {
	select {
	case <-p.done:
		return p.read, p.read.err == nil
	case <-ctx.Done():
		return preflightRead{}, false
	}
}
