package tenantapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/buildlog"
	"github.com/buildq/buildq/worker/internal/ledger"
	"github.com/buildq/buildq/worker/internal/mutant"
)

// The logs service (buildq.api.logs.<tenant>): a page of the log of the
// build that answers one of the tenant's requests, from the stream while
// it is kept there, from the archive afterwards. A tenant reads a build's
// log only through one of its own requests (by request id), or by build
// key when its own request claimed the build or waits on it — the same
// answer whether another tenant's build of the key exists or not.

// logsConcurrency bounds the logs requests a worker holds at once, apart
// from the status and cancel requests; logsPolls bounds those of them
// that wait for new lines (up to v1.MaxLogsWait): past it a request is
// answered at once, so the bound on waiting never holds up the others.
const (
	logsConcurrency = 1024
	logsPolls       = 256
)

// logsPollsPerTenant bounds the logs requests of one tenant that wait
// for new lines at once on a worker: past it a request is answered at
// once (the client asks again), so one tenant's followers cannot hold
// every other tenant's back.
const logsPollsPerTenant = 16

// logsIdle: a log with no end stored whose request is answered (its run
// ended by a worker that died before ending the log) is over once no
// line came for this long.
const logsIdle = 30 * time.Second

// logCursor is where a reader stands in a run's log: after stream
// sequence seq, or (archive) after off bytes. Both carry off.
type logCursor struct {
	run     string
	seq     uint64
	off     int64
	archive bool
}

func (c logCursor) String() string {
	if c.archive {
		return c.run + ":a:" + strconv.FormatInt(c.off, 10)
	}
	return c.run + ":" + strconv.FormatUint(c.seq, 10) + ":" + strconv.FormatInt(c.off, 10)
}

func parseCursor(s string) (logCursor, error) {
	if s == "" {
		return logCursor{}, nil
	}
	f := strings.Split(s, ":")
	if len(f) != 3 || f[0] == "" {
		return logCursor{}, fmt.Errorf("cursor %q is not one this service gave", s)
	}
	c := logCursor{run: f[0]}
	var err error
	if f[1] == "a" {
		c.archive = true
	} else if c.seq, err = strconv.ParseUint(f[1], 10, 64); err != nil {
		return logCursor{}, fmt.Errorf("cursor %q is not one this service gave", s)
	}
	if c.off, err = strconv.ParseInt(f[2], 10, 64); err != nil || c.off < 0 {
		return logCursor{}, fmt.Errorf("cursor %q is not one this service gave", s)
	}
	return c, nil
}

// archiveCache keeps the last archive read, decompressed: a reader pages
// through one archive, and each page would otherwise read and inflate it
// whole again.
type archiveCache struct {
	mu   sync.Mutex
	ref  v1.LogRef
	data []byte
}

// maxCachedArchive bounds the archive kept.
const maxCachedArchive = 64 << 20

func (c *archiveCache) read(ctx context.Context, a buildlog.Archive, ref *v1.LogRef) ([]byte, error) {
	c.mu.Lock()
	if c.data != nil && c.ref == *ref {
		data := c.data
		c.mu.Unlock()
		return data, nil
	}
	c.mu.Unlock()
	data, err := buildlog.ReadArchive(ctx, a, ref)
	if err != nil {
		return nil, err
	}
	if len(data) <= maxCachedArchive {
		c.mu.Lock()
		c.ref, c.data = *ref, data
		c.mu.Unlock()
	}
	return data, nil
}

// pollCounts counts each tenant's requests of one kind in progress, up
// to perTenant each and max in all (zero: logsPollsPerTenant and
// logsPolls, the logs requests waiting for lines).
type pollCounts struct {
	mu             sync.Mutex
	n              map[string]int
	total          int
	perTenant, max int
}

func (p *pollCounts) take(tenant string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[string]int{}
	}
	perTenant, most := p.perTenant, p.max
	if perTenant == 0 {
		perTenant, most = logsPollsPerTenant, logsPolls
	}
	if p.n[tenant] >= perTenant || p.total >= most {
		return false
	}
	p.n[tenant]++
	p.total++
	return true
}

func (p *pollCounts) give(tenant string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.total--
	if p.n[tenant]--; p.n[tenant] <= 0 {
		delete(p.n, tenant)
	}
}

// logTarget is the run whose log answers a logs request.
type logTarget struct {
	key, run string
	note     string
	ref      *v1.LogRef
	// answered: the request has its result (state, reason); a log that
	// never got its end is over when idle.
	answered      bool
	state, reason string
	// final: run is over (its record is final, or the result names it):
	// a log it has not stored by now it never will.
	final bool
}

// parseLogsRequest reads a JSON LogsRequest, or a bare target.
func parseLogsRequest(data []byte) (v1.LogsRequest, error) {
	data = bytes.TrimSpace(data)
	var r v1.LogsRequest
	if len(data) > 0 && data[0] == '{' {
		if err := json.Unmarshal(data, &r); err != nil {
			return r, fmt.Errorf("the logs request is not valid JSON: %w", err)
		}
	} else {
		r.Target = string(data)
	}
	r.Target = strings.TrimSpace(r.Target)
	if r.Target == "" || len(r.Target) > v1.MaxRequestIDLen {
		return r, fmt.Errorf("send a build key (64 hex digits) or a request id")
	}
	if r.MaxBytes <= 0 || r.MaxBytes > v1.MaxLogsPage {
		r.MaxBytes = v1.MaxLogsPage
	}
	r.WaitMs = min(max(r.WaitMs, 0), v1.MaxLogsWait.Milliseconds())
	return r, nil
}

// logs answers one logs request of tenant.
func (w *Service) logs(ctx context.Context, tenant string, data []byte) v1.LogsReply {
	if w.cfg.Logs == nil {
		return v1.LogsReply{Error: "build logs are not enabled on this deployment"}
	}
	req, err := parseLogsRequest(data)
	if err != nil {
		return v1.LogsReply{Error: err.Error()}
	}
	cur, err := parseCursor(req.Cursor)
	if err != nil {
		return v1.LogsReply{Error: err.Error()}
	}
	deadline := time.Now().Add(time.Duration(req.WaitMs) * time.Millisecond)
	if req.WaitMs > 0 {
		if !w.polls.take(tenant) {
			deadline = time.Now() // this tenant waits on enough already
		} else {
			defer w.polls.give(tenant)
		}
	}
	for {
		t, errMsg := w.logTarget(ctx, tenant, req.Target)
		if errMsg != "" {
			return v1.LogsReply{Error: errMsg}
		}
		rep := v1.LogsReply{Key: t.key, Run: t.run, Note: t.note, Cursor: cur.String()}
		if t.run == "" {
			// Not started yet (queued, its source being prepared).
			if !w.wait(ctx, "", deadline) {
				return rep
			}
			continue
		}
		if cur.run != t.run {
			if cur.run != "" {
				// The build was started again (another run of the key):
				// its log starts anew.
				rep.Data = v1.AppendLogLine(nil, v1.LogLine{Time: w.cfg.Now().UTC(), Stream: v1.LogStreamBuildq, Attempt: 1,
					Text: []byte(fmt.Sprintf("the build was started again as run %s; its log follows", t.run))})
			}
			cur = logCursor{run: t.run}
		}
		page, err := w.page(ctx, t, &cur, req)
		if err != nil {
			return v1.LogsReply{Key: t.key, Run: t.run, Error: err.Error()}
		}
		rep.Data = append(rep.Data, page.data...)
		rep.Cursor, rep.Done, rep.State, rep.Reason, rep.Archive = cur.String(), page.done, page.state, page.reason, t.ref
		rep.Error = page.none
		if len(rep.Data) > 0 || rep.Done || !w.wait(ctx, v1.LogsSubject(t.key, t.run), deadline) {
			return rep
		}
	}
}

// wait waits for a chunk on subject (any change when empty: a short
// poll) until deadline; false when the deadline passed.
func (w *Service) wait(ctx context.Context, subject string, deadline time.Time) bool {
	d := time.Until(deadline)
	if d <= 0 {
		return false
	}
	if subject == "" {
		d = min(d, time.Second)
		select {
		case <-time.After(d):
			return true
		case <-ctx.Done():
			return false
		}
	}
	ch := make(chan *nats.Msg, 1)
	sub, err := w.cfg.NC.ChanSubscribe(subject, ch)
	if err != nil {
		return false
	}
	defer func() { _ = sub.Unsubscribe() }()
	// A chunk stored before the subscription is read by the caller's
	// next page: wait a short while only, then look again.
	d = min(d, 2*time.Second)
	select {
	case <-ch:
	case <-time.After(d):
	case <-ctx.Done():
		return false
	}
	return true
}

type logPage struct {
	data          []byte
	done          bool
	state, reason string
	// none, with done: the run is over with no chunk in the stream and
	// no archive, so it stored no log (or none is kept any more): the
	// reply is done at once, with the run's outcome, and its Error says
	// why there is nothing to show. Error and Done together mean exactly
	// that; buildq logs prints the error as a notice and, with -f, exits
	// with the build's outcome.
	none string
}

// page reads the log of t after cur, advancing it.
func (w *Service) page(ctx context.Context, t logTarget, cur *logCursor, req v1.LogsRequest) (logPage, error) {
	if !cur.archive {
		p, gone, err := w.streamPage(ctx, t, cur, req)
		if err != nil || !gone {
			return p, err
		}
		// The stream no longer holds the rest: the archive does.
		if !t.ref.Archived() {
			if t.ref != nil && t.ref.Error != "" {
				return logPage{}, fmt.Errorf("the log of run %s is no longer in the stream, and was not archived: %s", t.run, t.ref.Error)
			}
			if t.answered || t.ref != nil {
				return logPage{}, fmt.Errorf("the log of run %s of build %s is no longer kept", t.run, t.key)
			}
			return logPage{}, fmt.Errorf("the log of run %s of build %s is not in the stream (yet)", t.run, t.key)
		}
		cur.archive = true
	}
	return w.archivePage(ctx, t, cur, req)
}

// streamPage reads chunks after cur from the stream; gone reports that
// the stream no longer holds the chunk after cur.
func (w *Service) streamPage(ctx context.Context, t logTarget, cur *logCursor, req v1.LogsRequest) (p logPage, gone bool, err error) {
	if t.ref.Archived() && cur.seq == 0 {
		// Ended and archived: served from the archive.
		return logPage{}, true, nil
	}
	for len(p.data) < req.MaxBytes {
		c, err := w.cfg.Logs.Next(ctx, t.key, t.run, cur.seq)
		if err != nil {
			return logPage{}, false, err
		}
		if c == nil {
			if cur.seq == 0 && t.ref != nil {
				return logPage{}, true, nil // the whole log aged out
			}
			if cur.seq == 0 && t.final {
				// Over, and not a chunk stored nor archived: there is
				// nothing to wait for.
				p.done, p.state, p.reason = true, t.state, t.reason
				p.none = fmt.Sprintf("the build stored no log (built before build logs were kept, or with --build-logs=false), or it is no longer kept: run %s of build %s", t.run, short(t.key))
				return p, false, nil
			}
			if t.answered && cur.seq > 0 {
				// A log whose end was never stored: over once idle.
				last, err := w.cfg.Logs.Next(ctx, t.key, t.run, cur.seq-1)
				if err == nil && last != nil && last.Seq == cur.seq && time.Since(last.Time) > logsIdle {
					p.done, p.state, p.reason = true, t.state, t.reason
				}
			}
			return p, false, nil
		}
		if c.Bytes-int64(len(c.Data)) != cur.off {
			// Chunks between are gone (aged out or dropped by the
			// stream's limits).
			return p, true, nil
		}
		p.data = appendSince(p.data, c.Data, req.Since)
		cur.seq, cur.off = c.Seq, c.Bytes
		if c.Ended {
			p.done, p.state, p.reason = true, c.State, c.Reason
			return p, false, nil
		}
	}
	return p, false, nil
}

// archivePage reads the archive after cur.off.
func (w *Service) archivePage(ctx context.Context, t logTarget, cur *logCursor, req v1.LogsRequest) (logPage, error) {
	if !t.ref.Archived() {
		return logPage{}, fmt.Errorf("the cursor names the archive of the log of run %s, which has none", t.run)
	}
	if w.cfg.Archive == nil {
		return logPage{}, fmt.Errorf("the log of run %s is archived, but this worker cannot read the archive", t.run)
	}
	data, err := w.archives.read(ctx, w.cfg.Archive, t.ref)
	if err != nil {
		return logPage{}, err
	}
	if cur.off > int64(len(data)) {
		return logPage{}, fmt.Errorf("cursor past the end of the log of run %s", t.run)
	}
	rest := data[cur.off:]
	if len(rest) > req.MaxBytes {
		// Whole lines only.
		cut := bytes.LastIndexByte(rest[:req.MaxBytes], '\n')
		if cut < 0 {
			cut = bytes.IndexByte(rest, '\n')
		}
		rest = rest[:cut+1]
	}
	cur.off += int64(len(rest))
	p := logPage{data: appendSince(nil, rest, req.Since)}
	if cur.off == int64(len(data)) {
		p.done, p.state, p.reason = true, t.state, t.reason
		if last := lastLine(data); last != nil {
			// The end line says how the run ended.
			if s, r, ok := endOf(last); ok {
				p.state, p.reason = s, r
			}
		}
	}
	return p, nil
}

// appendSince appends the lines of data printed at or after since.
func appendSince(dst, data []byte, since time.Time) []byte {
	if since.IsZero() {
		return append(dst, data...)
	}
	for len(data) > 0 {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i+1], data[i+1:]
		} else {
			data = nil
		}
		if l, err := v1.ParseLogLine(line); err == nil && !l.Time.Before(since) {
			dst = append(dst, line...)
		}
	}
	return dst
}

func lastLine(data []byte) []byte {
	data = bytes.TrimSuffix(data, []byte("\n"))
	if i := bytes.LastIndexByte(data, '\n'); i >= 0 {
		return data[i+1:]
	}
	return data
}

// endOf reads the state and reason of a log's end line ("build
// <state>[: <reason>]", buildq's own).
func endOf(line []byte) (state, reason string, ok bool) {
	l, err := v1.ParseLogLine(line)
	if err != nil || !l.Own() {
		return "", "", false
	}
	rest, ok := strings.CutPrefix(string(l.Text), "build ")
	if !ok {
		return "", "", false
	}
	state, reason, _ = strings.Cut(rest, ": ")
	return state, reason, true
}

// logTarget finds the run whose log answers target for tenant, or says
// why there is none.
func (w *Service) logTarget(ctx context.Context, tenant, target string) (logTarget, string) {
	le, err := w.cfg.Ledger.Get(ctx, tenant, target)
	if err != nil {
		return logTarget{}, err.Error()
	}
	if le != nil {
		e := le.E
		t := logTarget{key: e.Key}
		if r := e.Result; r != nil {
			t.answered, t.state, t.reason = true, string(r.Status), r.Reason
			if r.Logs != nil {
				t.run, t.ref, t.final = r.Logs.Run, r.Logs, true
			}
		}
		if e.Key == "" {
			if t.answered {
				return logTarget{}, fmt.Sprintf("request %s was answered without a build (%s %s): it has no build log", target, t.state, t.reason)
			}
			return t, "" // its source is being prepared
		}
		if t.run == "" {
			rec, _, err := w.cfg.Runs.Get(ctx, e.Key)
			if err != nil {
				return logTarget{}, err.Error()
			}
			// The key's current run answers the request only when the
			// tenant's own request claimed it, or this request waits on
			// it — registered as a waiter once it was shown to hold the
			// content (a request with the key of another tenant's build
			// sees nothing of it before that).
			mine := rec != nil && (rec.Tenant == tenant || mutant.On("logs-before-possession"))
			if rec != nil && !mine && !t.answered {
				if mine, err = w.waits(ctx, e.Key, func(le *ledger.Entry) bool {
					return le.E.Tenant == tenant && le.E.RequestID == e.RequestID
				}); err != nil {
					return logTarget{}, err.Error()
				}
			}
			switch {
			case mine:
				// Over when the request has its result and the run is
				// final (not a later run of the key, still going).
				t.run, t.final = rec.Run, t.answered && rec.Final()
				if rec.Logs != nil && rec.Logs.Run == rec.Run {
					t.ref = rec.Logs
				}
			case t.answered:
				return logTarget{}, fmt.Sprintf("no log is kept of the build that answered request %s (%s): it was built before logs were kept, or its log aged out", target, e.Key)
			}
		}
		switch e.Origin {
		case v1.OriginCache:
			t.note = fmt.Sprintf("request %s was answered from the cache: this is the log of build %s (run %s), which made the image", target, short(e.Key), t.run)
		case v1.OriginInflight:
			t.note = fmt.Sprintf("request %s joined build %s (run %s), started by another request: this is its log", target, short(e.Key), t.run)
		}
		return t, ""
	}
	if !v1.IsBuildKey(target) {
		return logTarget{}, fmt.Sprintf("no request %s of tenant %s is known (still queued, or older than the results' max age)", target, tenant)
	}
	none := fmt.Sprintf("no build of tenant %s is known for key %s", tenant, target)
	rec, _, err := w.cfg.Runs.Get(ctx, target)
	if err != nil {
		return logTarget{}, err.Error()
	}
	if rec == nil {
		return logTarget{}, none
	}
	if rec.Tenant != tenant && !mutant.On("logs-any-tenant") {
		// Another tenant's build: readable only while a request of this
		// tenant waits on it.
		mine, err := w.waits(ctx, target, func(le *ledger.Entry) bool { return le.E.Tenant == tenant })
		if err != nil {
			return logTarget{}, err.Error()
		}
		if !mine {
			return logTarget{}, none
		}
	}
	t := logTarget{key: target, run: rec.Run}
	if rec.Logs != nil && rec.Logs.Run == rec.Run {
		t.ref = rec.Logs
	}
	if rec.Final() {
		t.answered, t.final, t.state, t.reason = true, true, rec.State, rec.Reason
	}
	return t, ""
}

// waits reports whether a request that match accepts waits on key.
func (w *Service) waits(ctx context.Context, key string, match func(*ledger.Entry) bool) (bool, error) {
	ws, err := w.cfg.Ledger.Waiters(ctx, key)
	if err != nil {
		return false, err
	}
	for _, le := range ws {
		if match(le) {
			return true, nil
		}
	}
	return false, nil
}

func short(key string) string {
	if len(key) > 12 {
		return key[:12]
	}
	return key
}
