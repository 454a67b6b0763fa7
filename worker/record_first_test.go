package worker

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/worker/internal/ledger"
)

// A worker set to record first (Config.RecordFirst, `--record-first`: the
// first rollout of an upgrade from workers that record every decision
// first) records a finished build's decision before its result goes out.
func TestAWorkerSetToRecordFirstRecordsBeforeItPublishes(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var results *resultCollector
	req := request("record-first")
	req.RequestID = "record-first"
	var at resultAtRecord
	e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.RecordFirst = true }, nil,
		func(w *Worker) { at.hook(w, req.Tenant, req.RequestID, &results) })
	results = e.collect()
	got := e.buildOnce(t, tr, results, req)
	if <-at.seen {
		t.Fatal("the result went out before its decision was recorded")
	}
	if got.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s, want succeeded", mustJSON(t, got))
	}
}

// A worker set to record first still answers a cancel by what the stream
// stored: during the second rollout of an upgrade, a worker without the
// setting may have published a build's result first, and the cancel
// must not say "canceled" of that request.
func TestACancelOnAWorkerSetToRecordFirstConfirmsWhatTheStreamStored(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	req := request("record-first-cancel")
	req.RequestID = "record-first-cancel"
	var wk *Worker
	e.startWorkerHooked("w1", func(c *Config) { withRegistry(tr)(c); c.RecordFirst = true }, nil, func(w *Worker) { wk = w })
	results := e.collect()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	e.waitJob(kaniko.JobName(key))
	// The build's result, stored first, as a worker that publishes first
	// stores it before anything else is written.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stored := v1.ResultData{RequestID: req.RequestID, Tenant: req.Tenant, Name: req.Name, Key: key,
		Status: v1.StatusSucceeded, Origin: v1.OriginBuild, Digest: "sha256:" + key}
	if ack, err := wk.publish(ctx, ledger.Decision{Tenant: req.Tenant, Name: req.Name, Data: stored}); err != nil || ack.Duplicate {
		t.Fatalf("the result published first: %+v, %v", ack, err)
	}
	rep := cancelRequest(t, e.nc, v1.CancelSubject(req.Tenant, req.Name), req.RequestID)
	if rep.Canceled {
		t.Fatalf("the cancel said canceled (%+v), and the request's stored result is succeeded", rep)
	}
	// The collector's core subscription sees the publish a moment after
	// the stream stored it.
	eventually(t, 5*time.Second, "the stored result seen", func() bool { return len(results.pubsOf(req.Tenant, req.RequestID)) > 0 })
	pubs := results.pubsOf(req.Tenant, req.RequestID)
	if len(pubs) != 1 || pubs[0].Status != v1.StatusSucceeded {
		t.Fatalf("results %+v, want the succeeded stored first, once", pubs)
	}
	eventually(t, 5*time.Second, "the entry holding the stored result", func() bool {
		kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
		if err != nil {
			return false
		}
		ent, err := kv.Get(context.Background(), RequestIndexKey(req.Tenant, req.RequestID))
		var re v1.RequestEntry
		return err == nil && json.Unmarshal(ent.Value(), &re) == nil && re.Result != nil &&
			re.Result.Status == v1.StatusSucceeded && re.Result.Digest == stored.Digest
	})
}
