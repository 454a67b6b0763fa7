package worker

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	batchv1 "k8s.io/api/batch/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// TestCancelDeletesOnlyItsRunsJob: a cancel ends its run and then deletes
// that run's Job. Its delete can reach the API server late — after a new
// request of the key claimed a new run and replaced the old Job with its
// own under the same name. The cancel's delete carries the old Job's UID,
// so it removes nothing of the new run. (Issue 24: a mutant that deleted
// the key's Job by name survived 200 schedules of the simulation; the race
// needs a delete held up at the wrong moment, which this test stages.)
func TestCancelDeletesOnlyItsRunsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// The API server honours a delete's UID precondition (the fake
	// tracker does not), and the first delete of a Job — the cancel's —
	// is held, on its way to the API server, until released. (A reactor
	// cannot hold it: the fake clientset holds its lock while reactors
	// run.)
	e.kube.PrependReactor("delete", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		d := a.(k8stesting.DeleteAction)
		obj, err := e.kube.Tracker().Get(batchv1.SchemeGroupVersion.WithResource("jobs"), a.GetNamespace(), d.GetName())
		if err != nil {
			return true, nil, err
		}
		if pre := d.GetDeleteOptions().Preconditions; pre != nil && pre.UID != nil && *pre.UID != obj.(*batchv1.Job).UID {
			return true, nil, apierrors.NewConflict(batchv1.Resource("jobs"), d.GetName(), errPreconditionUID)
		}
		return false, nil, nil
	})
	var (
		once    sync.Once
		release = make(chan struct{})
		reached = make(chan struct{})
	)
	slow := slowCreates{Interface: e.kube, holdDelete: func(string) {
		first := false
		once.Do(func() { first = true })
		if first {
			close(reached)
			<-release
		}
	}}
	e.startWorkerHooked("w1", nil, slow, nil)
	results := e.collect()
	ctx := context.Background()

	a := request("cancel-race")
	if _, err := e.pub.Publish(ctx, a); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(a, kanikoID)
	old := e.waitJob(kaniko.JobName(key))

	// The cancel ends a's run; its delete of the Job is held.
	canceled := make(chan *nats.Msg, 1)
	go func() {
		m, err := tenantAPIRequest(e.nc, "acme", v1.APICancelSubject("acme"), a.RequestID, 30*time.Second)
		if err != nil {
			t.Errorf("cancel: %v", err)
		}
		canceled <- m
	}()
	select {
	case <-reached:
	case <-time.After(10 * time.Second):
		t.Fatal("the cancel never deleted the Job")
	}
	// A new request of the key: a new run, whose Job replaces the old one
	// (its own delete, by the old Job's UID, goes through).
	b := request("cancel-race")
	if _, err := e.pub.Publish(ctx, b); err != nil {
		t.Fatal(err)
	}
	var fresh *batchv1.Job
	eventually(t, 10*time.Second, "the new run's Job", func() bool {
		j, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, kaniko.JobName(key), metav1.GetOptions{})
		if err != nil || j.UID == old.UID {
			return false
		}
		fresh = j
		return true
	})
	close(release)
	m := <-canceled
	if m == nil {
		t.FailNow()
	}
	var rep v1.CancelReply
	if err := json.Unmarshal(m.Data, &rep); err != nil || !rep.Canceled {
		t.Fatalf("cancel: %s (%v)", m.Data, err)
	}
	// The cancel answered after its delete returned.
	if _, err := e.kube.BatchV1().Jobs(testNamespace).Get(ctx, fresh.Name, metav1.GetOptions{}); err != nil {
		t.Fatalf("the new run's Job is gone after the cancel's late delete: %v", err)
	}
	e.kubelet(fresh, 0, digestOf("cancel-race"))
	got := byID(results.waitFor(t, 2, 10*time.Second))
	if r := got[b.RequestID]; len(r) != 1 || r[0].Data.Status != v1.StatusSucceeded {
		t.Fatalf("the new request: %s", mustJSON(t, r))
	}
	if r := got[a.RequestID]; len(r) != 1 || r[0].Data.Status != v1.StatusCanceled {
		t.Fatalf("the canceled request: %s", mustJSON(t, r))
	}
}

var errPreconditionUID = preconditionError("the UID in the precondition does not match the Job's")

type preconditionError string

func (e preconditionError) Error() string { return string(e) }
