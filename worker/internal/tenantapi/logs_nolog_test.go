package tenantapi

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// ended stores a run of key claimed by tenant's request id, ended in
// state, and the request's result, with no log at all: no chunk in the
// stream, no data.logs (built before logs were kept, or by a worker with
// --build-logs=false).
func (w *logsWorld) endedWithoutLog(t *testing.T, tenant, id, key, run string, state string, status v1.Status, reason string) {
	t.Helper()
	ctx := context.Background()
	if _, ok, err := w.runs.Claim(ctx, &v1.BuildRecord{Key: key, Run: run, Tenant: tenant, Name: "web", RequestID: id,
		State: state, Reason: reason, FinishedAt: time.Now().UTC()}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	le, _, err := w.ledger.Open(ctx, tenant, "web", id, key, 1, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.ledger.Record(ctx, le, ledger.Decision{Tenant: tenant, Name: "web",
		Data: v1.ResultData{RequestID: id, Key: key, Status: status, Reason: reason, Origin: v1.OriginBuild}}); err != nil {
		t.Fatal(err)
	}
}

func waitReq(target, cursor string) string {
	b, _ := json.Marshal(v1.LogsRequest{Target: target, Cursor: cursor, WaitMs: v1.MaxLogsWait.Milliseconds()})
	return string(b)
}

// A run that is over and stored no log (no chunk, no archive) has nothing
// to follow: the reply is done at once — with the run's outcome, and an
// error saying the build stored no log — so `buildq logs -f` ends (with
// the build's exit code) instead of following forever, and without -f it
// says why nothing is printed. Asked by request id and by build key, at
// the start and with the cursor of a page before.
func TestLogsOfARunThatStoredNoLogAreDone(t *testing.T) {
	t.Parallel()
	w := newLogsWorld(t)
	okKey, failKey := hexKey("pre-logs build"), hexKey("a build with --build-logs=false that failed")
	w.endedWithoutLog(t, "acme", "old", okKey, "r-old", v1.StateSucceeded, v1.StatusSucceeded, "")
	w.endedWithoutLog(t, "acme", "bad", failKey, "r-bad", v1.StateFailed, v1.StatusFailed, "BuildFailed")
	for _, c := range []struct {
		target, run, state, reason string
	}{
		{"old", "r-old", "succeeded", ""},
		{okKey, "r-old", "succeeded", ""},
		{"bad", "r-bad", "failed", "BuildFailed"},
		{failKey, "r-bad", "failed", "BuildFailed"},
	} {
		cursor := ""
		for page := range 2 {
			start := time.Now()
			rep := w.ask(t, "acme", waitReq(c.target, cursor))
			if !rep.Done || rep.State != c.state || rep.Reason != c.reason || rep.Run != c.run || len(rep.Data) > 0 {
				t.Errorf("%s, page %d: done %v, state %q, reason %q, run %q, %d bytes; want done, %q, %q, %q, none",
					c.target, page, rep.Done, rep.State, rep.Reason, rep.Run, len(rep.Data), c.state, c.reason, c.run)
			}
			if !strings.Contains(rep.Error, "stored no log") || !strings.Contains(rep.Error, "--build-logs=false") {
				t.Errorf("%s, page %d: error %q does not say the build stored no log", c.target, page, rep.Error)
			}
			if d := time.Since(start); d > v1.MaxLogsWait/2 {
				t.Errorf("%s, page %d: answered after %s: it waited for lines that never come", c.target, page, d)
			}
			if !rep.Done || rep.Cursor == "" {
				break
			}
			cursor = rep.Cursor
		}
	}
}

// The other side: a run still building that has stored no line yet is
// followed, not declared done.
func TestLogsOfARunNotOverYetAreNotDone(t *testing.T) {
	t.Parallel()
	w := newLogsWorld(t)
	key := hexKey("just claimed")
	ctx := context.Background()
	if _, ok, err := w.runs.Claim(ctx, &v1.BuildRecord{Key: key, Run: "r-new", Tenant: "acme", Name: "web", RequestID: "new",
		State: v1.StateBuilding, Owner: "w1", LeaseUntil: time.Now().Add(time.Hour)}); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if _, _, err := w.ledger.Open(ctx, "acme", "web", "new", key, 1, time.Now()); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{"new", key} {
		rep := w.ask(t, "acme", req(target, ""))
		if rep.Done || rep.Error != "" || rep.Run != "r-new" {
			t.Errorf("%s: %+v; want not done, no error, run r-new", target, rep)
		}
	}
}
