package publisher

// Attacks on Follow's replay through the stored-results service: answers
// a tenant's Follow must not trust — pages that never end, results of
// another tenant or of another name. The service is a stand-in answering
// whatever the test says, on an embedded server.

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/testnats"
)

// hostileService answers tenant's stored-results requests with answer's
// reply to each request (counted).
func hostileService(t *testing.T, tenant string, answer func(req v1.ResultsRequest) v1.ResultsReply) (*Client, *atomic.Int64) {
	t.Helper()
	srv := testnats.Start(t, testnats.Config{})
	nc := srv.Connect(t)
	var asked atomic.Int64
	if _, err := nc.Subscribe(v1.APIResultsSubject(tenant), func(m *nats.Msg) {
		asked.Add(1)
		var req v1.ResultsRequest
		_ = json.Unmarshal(m.Data, &req)
		b, _ := json.Marshal(answer(req))
		_ = m.Respond(b)
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	c, err := New(srv.Connect(t))
	if err != nil {
		t.Fatal(err)
	}
	return c, &asked
}

func storedEvent(t *testing.T, seq uint64, tenant, name, id string) v1.StoredResult {
	t.Helper()
	b, err := json.Marshal(v1.NewResult("/test", v1.ResultData{RequestID: id, Tenant: tenant, Name: name, Status: v1.StatusSucceeded}, time.Now()))
	if err != nil {
		t.Fatal(err)
	}
	return v1.StoredResult{Seq: seq, Time: time.Now(), Event: b}
}

// Broke before the fix: a stored-results answer that says there is more
// but does not move on (Next not after the AfterSeq asked; a service bug,
// or one that answers on the tenant's subject without being the workers)
// had Follow ask again at once, forever — no backoff, no patience: the
// Follow hung in its gap, hammering the service. Now the gap ends,
// reported lost, after the one answer.
func TestFollowAttackStoredResultsThatNeverMoveOn(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		mark Gap
		next func(req v1.ResultsRequest) uint64
	}{
		{"next is the sequence asked", Gap{AfterSeq: 5}, func(r v1.ResultsRequest) uint64 { return r.AfterSeq }},
		{"next goes back", Gap{AfterSeq: 5}, func(r v1.ResultsRequest) uint64 { return r.AfterSeq / 2 }},
		{"since a time, next 0", Gap{Since: time.Now().Add(-time.Hour)}, func(v1.ResultsRequest) uint64 { return 0 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cl, asked := hostileService(t, "mallory", func(req v1.ResultsRequest) v1.ResultsReply {
				return v1.ResultsReply{More: true, Next: c.next(req)}
			})
			w := &follower{f: Filter{Tenant: "mallory"}, fn: func(v1.Result) error { return nil }, seen: newSeenSet(16)}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			g, err := cl.fillGap(ctx, w, v1.ResultSubject("mallory", "*"), c.mark, time.Second)
			if err != nil {
				t.Fatalf("the gap ended with %v after %d requests: the replay did not stop on its own", err, asked.Load())
			}
			if !errors.Is(g.Err, ErrResultsLost) {
				t.Errorf("gap %+v: want ErrResultsLost", g)
			}
			if n := asked.Load(); n > 3 {
				t.Errorf("%d requests for one gap", n)
			}
		})
	}
}

// Broke before the fix: a replayed result whose event names another
// tenant (or, for a Follow of one name, another name) was handed to the
// caller's function — live results are filtered by their subject, but a
// replayed one came only with what the service said. Now a Follow of a
// tenant (and name) delivers only results that are of that tenant (and
// name), whatever the service sends, as the live subscription does.
func TestFollowAttackReplayNeverDeliversAnotherTenantsResult(t *testing.T) {
	t.Parallel()
	cl, _ := hostileService(t, "mallory", func(v1.ResultsRequest) v1.ResultsReply {
		return v1.ResultsReply{Next: 9, Results: []v1.StoredResult{
			storedEvent(t, 6, "acme", "web", "acme-secret"),
			storedEvent(t, 7, "mallory", "api", "other-name"),
			{Seq: 8, Event: json.RawMessage(`{"data":{"requestId":"no-tenant"}}`)},
			storedEvent(t, 9, "mallory", "web", "mine"),
		}}
	})
	for _, f := range []Filter{{Tenant: "mallory", Name: "web"}, {Tenant: "mallory"}} {
		var got []string
		w := &follower{f: f, fn: func(r v1.Result) error { got = append(got, r.Data.Tenant+"/"+r.Data.Name+"/"+r.ID); return nil },
			seen: newSeenSet(16)}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		g, err := cl.fillGap(ctx, w, v1.ResultSubject("mallory", "*"), Gap{AfterSeq: 5}, time.Second)
		cancel()
		if err != nil || g.Err != nil {
			t.Fatalf("filter %+v: %v %+v", f, err, g)
		}
		want := map[string]bool{"mallory/web/mine": true, "mallory/api/other-name": f.Name == ""}
		for _, id := range got {
			if !want[id] {
				t.Errorf("filter %+v: delivered %s", f, id)
			}
		}
		if len(got) == 0 || got[len(got)-1] != "mallory/web/mine" {
			t.Errorf("filter %+v: delivered %v, want mallory's own", f, got)
		}
		if w.last != 9 {
			t.Errorf("filter %+v: last sequence %d, want 9", f, w.last)
		}
	}
}
