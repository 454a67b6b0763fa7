package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// A cancel by id whose "canceled" could not be confirmed stored (the
// handler of the same worker holds the request for more than
// deliverBusyWait while it records the result it published first) is
// counted as canceled with a note that the result event says how it
// ended — on every path of the reply. When another request still waited
// on the build, the "build goes on" reply dropped the note, and said
// canceled of a request whose stored result was "succeeded". (Found by an
// attack on the publish-first rule.)
func TestACancelNotConfirmedSaysSoWhenTheBuildGoesOnForOthers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	var results *resultCollector
	owner, other, key := ownerAndParked("attack-note", "attack-owner", "attack-other")
	lkA := RequestIndexKey(owner.Tenant, owner.RequestID)
	lkB := RequestIndexKey(other.Tenant, other.RequestID)
	blocked, release := make(chan struct{}), make(chan struct{})
	var once atomic.Bool
	e.startWorkerHooked("w1", withRegistry(tr), nil, func(w *Worker) {
		w.ledger.UseBucket(&hookedKV{KeyValue: w.ledger.Bucket(), onUpdate: func(k string, value []byte) error {
			switch {
			case k == lkA && bytes.Contains(value, []byte(`"published":true`)) && once.CompareAndSwap(false, true):
				close(blocked) // the owner's handler records the result it published first
				<-release
			case k == lkB && bytes.Contains(value, []byte(`"result":`)):
				<-release // the other request's answer: it still waits on the build
			}
			return nil
		}})
	})
	results = e.collect()
	if _, err := e.pub.Publish(context.Background(), owner); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(kaniko.JobName(key))
	if _, err := e.pub.Publish(context.Background(), other); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the other request parked", func() bool { return e.isParked(key, other.RequestID) })
	e.kubelet(job, 0, tr.push(t, destination(job)))
	<-blocked
	got := results.waitFor(t, 1, 10*time.Second)[0]
	if got.Data.RequestID != owner.RequestID || got.Data.Status != v1.StatusSucceeded {
		t.Fatalf("first stored result %s, want the owner's succeeded", mustJSON(t, got))
	}
	replied := make(chan v1.CancelReply, 1)
	go func() { replied <- cancelRequest(t, e.nc, v1.CancelSubject("acme", "web"), owner.RequestID) }()
	// The cancel waits deliverBusyWait (2 s) for the handler, then gives up.
	var rep v1.CancelReply
	select {
	case rep = <-replied:
	case <-time.After(5 * time.Second):
	}
	close(release)
	if rep == (v1.CancelReply{}) {
		rep = <-replied
	}
	t.Logf("cancel reply: %+v", rep)
	eventually(t, 10*time.Second, "the owner's entry decided", func() bool {
		kv, err := e.js.KeyValue(context.Background(), v1.RequestsBucket)
		if err != nil {
			return false
		}
		ent, err := kv.Get(context.Background(), lkA)
		var re v1.RequestEntry
		return err == nil && json.Unmarshal(ent.Value(), &re) == nil && re.Result != nil && re.Published
	})
	var stored []v1.Result
	for _, r := range results.snapshot() {
		if r.Data.RequestID == owner.RequestID {
			stored = append(stored, r)
		}
	}
	if rep.Canceled && !strings.Contains(rep.Message, "its result event says how it ended") &&
		len(stored) > 0 && stored[0].Data.Status != v1.StatusCanceled {
		t.Fatalf("the cancel of %s replied canceled=true (%q) without the note, and its stored result is %s",
			owner.RequestID, rep.Message, stored[0].Data.Status)
	}
}
