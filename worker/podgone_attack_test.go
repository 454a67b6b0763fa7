package worker

// Attacks on podGone (kubebackend.go, kubereconcile.go): a run whose Job
// succeeded but whose Pod was gone before the worker read the digest it
// pushed ends TagTaken, recording nothing. Each test plays a hostile
// tenant who pushes over the run's tag, a worker stopped or frozen at the
// worst moment, or a Pod that reaches the cache just after the grace (a
// NATS write of the end lost, or landed with its reply lost, is
// endwrite_test.go's) — and checks that every request is
// answered once, that no build record of the key ever names an image
// buildq did not build (the hand-pushed one), and that no Job stands.

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// recordHistory watches every value the builds bucket holds for key from
// now on (and the current one).
type recordHistory struct {
	mu   sync.Mutex
	recs []v1.BuildRecord
}

func watchRecords(t *testing.T, e *env, key string) *recordHistory {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	var kv jetstream.KeyValue
	eventually(t, 10*time.Second, "the builds bucket", func() bool {
		var err error
		kv, err = e.js.KeyValue(ctx, v1.BuildsBucket)
		return err == nil
	})
	w, err := kv.Watch(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	h := &recordHistory{}
	go func() {
		defer func() { _ = w.Stop() }()
		for {
			select {
			case ent, ok := <-w.Updates():
				if !ok {
					return
				}
				if ent == nil || ent.Operation() != jetstream.KeyValuePut {
					continue
				}
				var r v1.BuildRecord
				if json.Unmarshal(ent.Value(), &r) == nil {
					h.mu.Lock()
					h.recs = append(h.recs, r)
					h.mu.Unlock()
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	return h
}

// publishWatched publishes req with every version of its key's record
// watched from before, and waits for its Job.
func publishWatched(t *testing.T, e *env, req *v1.Request) (key string, hist *recordHistory, job *batchv1.Job) {
	t.Helper()
	key = v1.BuildKey(req, kanikoID)
	hist = watchRecords(t, e, key)
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	return key, hist, e.waitJob(jobOf(req))
}

// never fails t if any record of the history names digest.
func (h *recordHistory) never(t *testing.T, digest, what string) {
	t.Helper()
	time.Sleep(200 * time.Millisecond) // the watch's last updates
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if r.Digest == digest {
			t.Errorf("a build record of %s named %s (%s): %+v", r.Key, digest, what, r)
		}
	}
}

func (h *recordHistory) sawTagTaken(run string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if r.Run == run && r.State == v1.StateFailed && r.Reason == v1.ReasonTagTaken {
			return true
		}
	}
	return false
}

// latePod creates job's Pod, succeeded with digest in the kaniko
// container's termination message, as a Pod that reaches the cache late.
func latePod(t *testing.T, e *env, job *batchv1.Job, digest string) {
	t.Helper()
	pod := jobPod(job, job.Name+"-late", true)
	pod.Status.ContainerStatuses = []corev1.ContainerStatus{{
		Name:  kaniko.ContainerName,
		State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Message: digest, FinishedAt: metav1.Now()}},
	}}
	if _, err := e.kube.CoreV1().Pods(testNamespace).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// answeredWithTagOrBuild checks r: succeeded, with the image at the tag
// (origin cache) or with one of built (a build of buildq's).
func answeredWithTagOrBuild(t *testing.T, r v1.Result, hand string, built ...string) {
	t.Helper()
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("request %s: %s, want success", r.ID, mustJSON(t, r.Data))
	}
	if r.Data.Digest == hand && r.Data.Origin == v1.OriginCache {
		return
	}
	for _, b := range built {
		if r.Data.Digest == b {
			return
		}
	}
	t.Fatalf("request %s: %s, want the image at its tag (%s, origin cache) or a build of buildq's %v", r.ID, mustJSON(t, r.Data), hand, built)
}

// Attack (2)+(1): the owner is frozen between its Job's podless end (its
// podGone outcome in hand) and the write of that end, its lease lapsing,
// while a tenant pushes over the tag; a second worker's reconciler ends
// the run. A request of another repository parked on the run builds; the
// frozen owner, thawed, finds the run ended and looks again. Nobody is
// answered twice, no record names the hand-pushed image, the first Job
// goes.
func TestPodGoneAttackOwnerFrozenBeforeItsEndIsStored(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	release := make(chan struct{})
	var paused atomic.Bool
	e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, podlessWorker(300*time.Millisecond, func(w *Worker) {
		w.faults = &faultHooks{beforeFinalize: func(string) {
			if paused.CompareAndSwap(false, true) {
				<-release
			}
		}}
	}))
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	results := e.collect()
	ctx := context.Background()
	req := request("pod-gone-attack-frozen")
	key, hist, job := publishWatched(t, e, req)
	run := job.Annotations[kaniko.AnnotationRun]
	other := request("pod-gone-attack-frozen")
	other.Name, other.RequestID = "api", "pod-gone-attack-frozen-other"
	if _, err := e.pub.Publish(ctx, other); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the other request parked on the run", func() bool { return e.isParked(key, other.RequestID) })
	built, hand := e.losePod(tr, job)
	eventually(t, 10*time.Second, "the owner frozen before storing its end", paused.Load)
	e.startWorkerFull("w2", fetchKaniko(), withRegistry(tr), nil, podlessWorker(300*time.Millisecond))
	eventually(t, 20*time.Second, "the run ended by the reconciler as having built nothing", func() bool { return hist.sawTagTaken(run) })
	// The parked request looks again and builds.
	again := e.jobInPlaceOf(job, "a new Job of the key")
	rebuilt := tr.push(t, destination(again))
	e.kubelet(again, 0, rebuilt)
	close(release)
	answeredWithTagOrBuild(t, oneResult(t, results, other.RequestID), "", rebuilt)
	answeredWithTagOrBuild(t, oneResult(t, results, req.RequestID), hand, rebuilt)
	hist.never(t, hand, "pushed by hand over the run's tag")
	hist.never(t, built, "pushed by the podless run, whose digest was never read")
	eventually(t, 20*time.Second, "the key's record final", func() bool { r := e.claim(key); return r != nil && r.Final() })
	eventually(t, 20*time.Second, "no Job of the key left", e.jobGone(job.Name))
	time.Sleep(time.Second)
	for _, id := range []string{req.RequestID, other.RequestID} {
		if n := len(resultFor(results, id)); n != 1 {
			t.Errorf("%s: %d results", id, n)
		}
	}
}

// Attack (3)+(1): the Pod reaches the cache just after the owner's grace
// (it ended the run TagTaken), with the digest the build really pushed,
// while a tenant has pushed over the tag; a second worker's reconciler
// sees the Pod's event. Nothing names the hand-pushed image; the claimer
// is answered once; the Job goes.
func TestPodGoneAttackPodArrivesJustAfterTheGrace(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	for _, id := range []string{"w1", "w2"} {
		e.startWorkerFull(id, fetchKaniko(), withRegistry(tr), nil, podlessWorker(300*time.Millisecond))
	}
	results := e.collect()
	req := request("pod-gone-attack-late-pod")
	key, hist, job := publishWatched(t, e, req)
	run := job.Annotations[kaniko.AnnotationRun]
	built, hand := e.losePod(tr, job)
	eventually(t, 20*time.Second, "the run ended as having built nothing", func() bool { return hist.sawTagTaken(run) })
	latePod(t, e, job, built)
	r := oneResult(t, results, req.RequestID)
	answeredWithTagOrBuild(t, r, hand)
	eventually(t, 20*time.Second, "the Job gone", e.jobGone(job.Name))
	time.Sleep(time.Second)
	hist.never(t, hand, "pushed by hand over the run's tag")
	if rec := e.claim(key); rec == nil || !rec.Final() {
		t.Fatalf("the key's record %+v, want final", rec)
	}
	if n := len(resultFor(results, req.RequestID)); n != 1 {
		t.Errorf("%d results", n)
	}
}

// Attack (2): the owner waits out a long grace for its Job's Pod and is
// stopped meanwhile, while a second worker, whose grace is short, ends
// the orphaned run from its reconciler; a tenant has pushed over the tag.
// The claimer's redelivery is answered once with the image at its tag,
// nothing names it in the index, the Job goes.
func TestPodGoneAttackOwnerStopsWhileTheReconcilerEndsTheRun(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	w1, _ := e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, podlessWorker(5*time.Second))
	results := e.collect()
	req := request("pod-gone-attack-owner-stops")
	key, hist, job := publishWatched(t, e, req)
	built := tr.push(t, destination(job))
	hand := tr.push(t, destination(job))
	e.startWorkerFull("w2", fetchKaniko(), withRegistry(tr), nil, podlessWorker(200*time.Millisecond))
	if err := e.world.node.endWithoutPod(job); err != nil {
		t.Fatal(err)
	}
	// w2's reconciler's grace is over; the claim is w1's, alive.
	time.Sleep(time.Second)
	w1.stop(t)
	r := oneResult(t, results, req.RequestID)
	answeredWithTagOrBuild(t, r, hand)
	eventually(t, 30*time.Second, "the Job gone", e.jobGone(job.Name))
	hist.never(t, hand, "pushed by hand over the run's tag")
	hist.never(t, built, "pushed by the podless run")
	eventually(t, 20*time.Second, "the key's record final", func() bool { r := e.claim(key); return r != nil && r.Final() })
	time.Sleep(time.Second)
	if n := len(resultFor(results, req.RequestID)); n != 1 {
		t.Errorf("%d results", n)
	}
}

// Attack (3), on the reconciler alone: many succeeded Jobs whose Pods
// come around the grace's end (before, at, just after), their Pod events
// racing podGrace. Every outcome handed on is either the Pod's digest
// (success) or a run that built nothing with no digest — never a success
// without a digest, or with another Job's — every Job is handed on, and a
// Job whose Pod came well within the grace is handed on with its digest
// (the reconciler looks again when the grace is over). Run under -race:
// podless is the reconciler's alone.
//
// A Pod event does not bring a finished Job back to the reconciler
// (kube.Watcher.onPod signals only the runs' own watches): a Pod that
// comes after the grace is not handed on, which is harmless — the run's
// end (TagTaken) was handed already, or finishOrphan asked to look again
// later (a live claim), which rereads the cache — so this test does not
// ask for it.
func TestPodGoneAttackReconcilerPodRacesTheGrace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	client := fake.NewClientset()
	const n = 24
	grace := 600 * time.Millisecond
	type jp struct {
		job *batchv1.Job
		pod *corev1.Pod
		at  time.Duration // when its Pod comes; 0: never
	}
	var all []jp
	for i := range n {
		name := fmt.Sprintf("buildq-race-%02d", i)
		j, p := succeededJob(name, "key-"+name, "run-1", digestOf(name))
		if _, err := client.BatchV1().Jobs(testNamespace).Create(ctx, j, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var at time.Duration
		if i%3 != 2 {
			// Spread from 0.5 to 1.3 graces; every third Pod never comes.
			at = time.Duration(float64(grace) * (0.5 + 0.8*float64(i)/float64(n)))
		}
		all = append(all, jp{j, p, at})
	}
	k := reconcileBackend(t, client)
	k.digestGrace = grace
	var mu sync.Mutex
	handed := map[string][]Outcome{}
	start := time.Now()
	go k.Reconcile(ctx, func(_ context.Context, key string, out Outcome) time.Duration {
		mu.Lock()
		defer mu.Unlock()
		handed[key] = append(handed[key], out)
		return 0
	})
	var wg sync.WaitGroup
	for _, x := range all {
		if x.at == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Until(start.Add(x.at)))
			if _, err := client.CoreV1().Pods(testNamespace).Create(ctx, x.pod, metav1.CreateOptions{}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	eventually(t, 20*time.Second, "every Job handed on", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, x := range all {
			if len(handed[x.job.Annotations[kaniko.AnnotationKey]]) == 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * grace)
	mu.Lock()
	defer mu.Unlock()
	for _, x := range all {
		key := x.job.Annotations[kaniko.AnnotationKey]
		for _, o := range handed[key] {
			switch {
			case o.Succeeded && o.Digest == digestOf(x.job.Name):
			case !o.Succeeded && o.Reason == v1.ReasonTagTaken && o.Digest == "":
			default:
				t.Errorf("%s: handed %+v", key, o)
			}
			if o.Run != "run-1" {
				t.Errorf("%s: handed run %q", key, o.Run)
			}
		}
		o := handed[key]
		switch {
		case x.at == 0 && (len(o) != 1 || o[0].Reason != v1.ReasonTagTaken):
			t.Errorf("%s, whose Pod never came: %+v, want one end that built nothing", key, o)
		case x.at != 0 && x.at < grace*8/10 && (len(o) != 1 || !o[0].Succeeded):
			t.Errorf("%s, whose Pod came at %s, within the grace %s: %+v, want its digest", key, x.at, grace, o)
		}
	}
}

// Attack (1), across tenants: mallory claims a key whose Pod is then
// gone, and pushes an image of her own over her run's tag; acme's request
// of the same content, parked on her run, must not be answered with it
// (before podGone it was: the registry's digest at mallory's tag answered
// every request of the run and entered the index). Acme builds its own;
// mallory is answered with what her tag holds; no record names it.
func TestPodGoneAttackAnotherTenantsHandPushNeverAnswersAcme(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorkerFull("w1", fetchKaniko(), withRegistry(tr), nil, podlessWorker(300*time.Millisecond))
	results := e.collect()
	ctx := context.Background()
	evil := mallorys("pod-gone-attack-cross-tenant")
	key, hist, job := publishWatched(t, e, evil)
	victim := request("pod-gone-attack-cross-tenant")
	victim.RequestID = "pod-gone-attack-cross-tenant-acme"
	if v1.BuildKey(victim, kanikoID) != key {
		t.Fatal("the two tenants' requests do not share a key")
	}
	if _, err := e.pub.Publish(ctx, victim); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "acme's request parked on mallory's run", func() bool { return e.parkedAs(key, "acme", victim.RequestID) })
	built, hand := e.losePod(tr, job)
	again := e.jobInPlaceOf(job, "a Job of acme's request")
	rebuilt := tr.push(t, destination(again))
	e.kubelet(again, 0, rebuilt)
	var r v1.Result
	eventually(t, 20*time.Second, "acme's result", func() bool {
		got := resultFor(results, victim.RequestID)
		if len(got) > 0 {
			r = got[0]
		}
		return len(got) > 0
	})
	if r.Data.Status != v1.StatusSucceeded || r.Data.Digest != rebuilt {
		t.Fatalf("acme: %s, want its own build %s (mallory pushed %s over her tag)", mustJSON(t, r.Data), rebuilt, hand)
	}
	answeredWithTagOrBuild(t, oneResult(t, results, evil.RequestID), hand, rebuilt)
	hist.never(t, hand, "mallory's hand push")
	hist.never(t, built, "the podless run's push")
	if rec := e.claim(key); rec == nil || rec.Digest != rebuilt {
		t.Fatalf("the key's record %+v, want acme's build %s", rec, rebuilt)
	}
}
