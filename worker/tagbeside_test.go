package worker

// A build whose Pod checks its first tag itself (fetch-context --absent)
// is claimed and started without waiting for the worker's own preflight
// HEAD of that tag, which goes once the Job is created (build.go,
// checksTagBeside; own.go): P1 in docs/benchmarks.md.
// What the HEAD finds still answers the request, and nothing is pushed
// over it; a build whose Pod checks nothing waits for the HEAD as before.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

// The Job of a fresh key's build exists while its tag's HEAD is still
// unanswered; the HEAD then finds the tag free and the build answers.
func TestAFreshBuildStartsBesideItsTagCheck(t *testing.T) {
	t.Parallel()
	e, tr, results := fetchWorld(t)
	release := tr.holdHeads()
	defer release()
	req := request("beside-free")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	// The HEAD goes out once the Job is created; it is still held,
	// unanswered.
	eventually(t, 10*time.Second, "the tag's HEAD sent", func() bool { return tr.held.Load() > 0 })
	if got, want := absentArg(job), destination(job); got != want {
		t.Fatalf("a Job started beside its tag check must check the tag in its Pod: --absent %q, want %q", got, want)
	}
	release()
	answeredByItsBuild(t, e, results, job, req, "beside-free")
}

// slowCreateWorld is fetchWorld with the tag check's window given and
// inCreate run inside the fake API server's create of req's Job (its lock
// held: nothing else asks it anything meanwhile).
func slowCreateWorld(t *testing.T, req *v1.Request, window time.Duration, inCreate func()) (*env, *testRegistry, *resultCollector) {
	e := setup(t)
	tr := newTestRegistry(t)
	e.kube.PrependReactor("create", "jobs", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.CreateAction).GetObject().(*batchv1.Job).Name == jobOf(req) {
			inCreate()
		}
		return false, nil, nil
	})
	e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
		withRegistry(tr)(c)
		c.TagCheckBeside = window
	}, nil, withPresigner)
	results := e.collect()
	return e, tr, results
}

// answeredByItsBuild completes job with the image of content and checks
// that req's one result is that build's.
func answeredByItsBuild(t *testing.T, e *env, results *resultCollector, job *batchv1.Job, req *v1.Request, content string) {
	t.Helper()
	e.kubelet(job, 0, digestOf(content))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Digest != digestOf(content) {
		t.Fatalf("result %s, want the build's image", mustJSON(t, r.Data))
	}
}

// The HEAD of a build whose Pod checks its tag goes out once the Job's
// create has returned, not beside it: on a small machine the registry's
// answer (its password check) and the worker's side of it would take
// their share of the cores from the create every request waits for (P1
// in docs/benchmarks.md). The create is held here: no HEAD comes while it
// is; once it returns, the HEAD comes and the build answers.
func TestATagCheckBesideGoesOutOnceTheJobIsCreated(t *testing.T) {
	t.Parallel()
	req := request("head-after-create")
	entered, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	// The create is held for a second: the HEAD's window (from the
	// build's start) is made wide enough that it is still sent after.
	e, tr, results := slowCreateWorld(t, req, time.Minute, func() {
		once.Do(func() {
			close(entered)
			<-proceed
		})
	})
	release := tr.holdHeads()
	defer release()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		close(proceed)
		t.Fatal("the build's Job was never created")
	}
	// The create is held (and with it the fake API server's lock: nothing
	// here asks it anything until it goes on).
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if tr.held.Load() > 0 {
			close(proceed)
			t.Fatal("the tag's HEAD went out while the build's Job was still being created")
		}
	}
	close(proceed)
	eventually(t, 10*time.Second, "the tag's HEAD sent once the Job is created", func() bool { return tr.held.Load() > 0 })
	release()
	answeredByItsBuild(t, e, results, e.waitJob(jobOf(req)), req, "head-after-create")
}

// A Job's create that takes longer than TagCheckBeside (a slow API
// server, a stale Job of the key waited out) leaves no time in which the
// HEAD's answer could stop the build: it is not sent at all, and the
// Pod's own check guards the tag.
func TestNoTagCheckGoesOutPastItsWindow(t *testing.T) {
	t.Parallel()
	req := request("head-past-window")
	e, tr, results := slowCreateWorld(t, req, 300*time.Millisecond, func() { time.Sleep(600 * time.Millisecond) })
	release := tr.holdHeads()
	defer release()
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	time.Sleep(500 * time.Millisecond)
	if n := tr.held.Load(); n > 0 {
		t.Fatalf("%d HEADs of the tag went out after the build's window for them had passed", n)
	}
	release()
	answeredByItsBuild(t, e, results, job, req, "head-past-window")
}

// The HEAD sent once the build's Job is created finds an image at the tag: the
// build is stopped before it could push, its Job deleted, its run ended
// refused (TagTaken, answering nobody), and the request — and one of the
// same tenant that joined the run meanwhile — is answered once with the
// image found, origin cache. The tag keeps it.
func TestATagFoundBesideTheBuildsStartAnswersWithTheImageFound(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	// The HEAD is held while a joiner parks, which may take a while on a
	// loaded machine: its answer must still count (no build here pushes).
	e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
		withRegistry(tr)(c)
		c.TagCheckBeside = time.Minute
	}, nil, withPresigner)
	results := e.collect()
	release := tr.holdHeads()
	defer release()
	req := request("beside-found")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	tag := absentArg(job)
	joiner := request("beside-found")
	joiner.RequestID = "beside-found-joiner"
	if _, err := e.pub.Publish(context.Background(), joiner); err != nil {
		t.Fatal(err)
	}
	key := v1.BuildKey(req, kanikoID)
	eventually(t, 10*time.Second, "the second request parked on the run", func() bool { return e.isParked(key, joiner.RequestID) })
	// Pushed by hand while the HEAD is on its way: the registry answers
	// it after the push (the push's own requests are never held, so the
	// HEAD must be held before it starts).
	eventually(t, 10*time.Second, "the HEAD beside the build's start held", func() bool { return tr.held.Load() > 0 })
	hand := tr.push(t, tag)
	release()
	for _, id := range []string{req.RequestID, joiner.RequestID} {
		r := oneResult(t, results, id)
		if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != hand {
			t.Errorf("%s: %s, want the image found at its tag (%s), origin cache", id, mustJSON(t, r.Data), hand)
		}
	}
	eventually(t, 10*time.Second, "the stopped build's Job deleted", e.jobGone(job.Name))
	if rec := e.claim(key); rec == nil || rec.State != v1.StateFailed || rec.Reason != v1.ReasonTagTaken || rec.Job != job.Name {
		t.Errorf("the key's record %+v, want the stopped run's end (TagTaken, its Job %s), never a build of the image found", rec, job.Name)
	}
	time.Sleep(300 * time.Millisecond)
	for _, id := range []string{req.RequestID, joiner.RequestID} {
		if n := len(byID(results.snapshot())[id]); n != 1 {
			t.Errorf("%s answered %d times", id, n)
		}
	}
	if d, err := tr.client.Head(context.Background(), tag); err != nil || d != hand {
		t.Errorf("the tag holds %s (%v), want the image pushed there by hand (%s)", d, err, hand)
	}
}

// A build whose Pod checks no tag (kaniko reads its context itself) is
// started only once its tag's HEAD has answered: a Job of a worker killed
// before the answer would push over whatever the HEAD was to find.
func TestABuildWhosePodChecksNoTagWaitsForItsHEAD(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorkerFull("w1", testKaniko, withRegistry(tr), nil, nil)
	results := e.collect()
	release := tr.holdHeads()
	defer release()
	req := request("in-sequence")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the tag's HEAD sent", func() bool { return tr.held.Load() > 0 })
	time.Sleep(500 * time.Millisecond)
	if j, err := e.kube.BatchV1().Jobs(testNamespace).Get(context.Background(), jobOf(req), metav1.GetOptions{}); err == nil {
		t.Fatalf("job %s created before its tag's HEAD answered (its Pod checks no tag: --absent %q)", j.Name, absentArg(j))
	}
	release()
	job := e.waitJob(jobOf(req))
	e.kubelet(job, 0, digestOf("in-sequence"))
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
		t.Fatalf("result %s", mustJSON(t, r.Data))
	}
}

// A fresh key's request taken straight from intake by a worker whose
// build Pods check their tag is claimed before anything reads the key's
// record (build.go, claimFirst): the claim is a create, which fails if
// there is a record. A worker whose Pods check nothing reads first, at
// intake, as ever. A claim first needs intake's entry create to be
// younger than lookAheadFresh at the claim; on a loaded machine it may
// not be, and the walk then reads first, as it must: up to five fresh
// keys are tried for one claimed first.
func TestAFreshKeyIsClaimedBeforeItsRecordIsRead(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		kc        kaniko.Config
		wantFirst string
	}{
		{"pods check their tag", fetchKaniko(), "claim"},
		{"pods check nothing", testKaniko, "read"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			var (
				mu  sync.Mutex
				key string
				ops []string
			)
			note := func(k, op string) {
				mu.Lock()
				if k == key {
					ops = append(ops, op)
				}
				mu.Unlock()
			}
			w, _ := e.startWorkerFull("w1", c.kc, withRegistry(tr), nil, func(w *Worker) {
				if c.kc.FetchImage != "" {
					withPresigner(w)
				}
				w.runs.UseBucket(&hookedKV{KeyValue: w.runs.Bucket(),
					onGet:    func(_ context.Context, k string) error { note(k, "read"); return nil },
					onCreate: func(k string, _ []byte) error { note(k, "claim"); return nil }})
			})
			results := e.collect()
			var seen [][]string
			for i := range 5 {
				req := request(fmt.Sprintf("claimed-first-%d", i))
				mu.Lock()
				key, ops = v1.BuildKey(req, kanikoID), nil
				mu.Unlock()
				waitIdle(t, w)
				if _, err := e.pub.Publish(context.Background(), req); err != nil {
					t.Fatal(err)
				}
				job := e.waitJob(jobOf(req))
				mu.Lock()
				got := slices.Clone(ops)
				mu.Unlock()
				e.kubelet(job, 0, digestOf(req.RequestID))
				if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild {
					t.Fatalf("result %s", mustJSON(t, r.Data))
				}
				seen = append(seen, got)
				if len(got) > 0 && got[0] == c.wantFirst {
					return
				}
				if c.wantFirst == "read" {
					break
				}
			}
			t.Errorf("the key's record was touched %v before each Job, want %q first", seen, c.wantFirst)
		})
	}
}

// The HEAD sent once a build's Job is created answers only after
// TagCheckBeside: what it found may be the build's own push, so the
// build goes on and answers (the Pod's own check guards the tag).
func TestATagCheckAnsweredLateStopsNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	tr := newTestRegistry(t)
	e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
		withRegistry(tr)(c)
		c.TagCheckBeside = 200 * time.Millisecond
	}, nil, withPresigner)
	results := e.collect()
	release := tr.holdHeads()
	defer release()
	req := request("beside-late")
	if _, err := e.pub.Publish(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	job := e.waitJob(jobOf(req))
	eventually(t, 10*time.Second, "the tag's HEAD sent", func() bool { return tr.held.Load() > 0 })
	// As if the build had pushed before the HEAD was answered.
	pushed := tr.push(t, absentArg(job))
	time.Sleep(400 * time.Millisecond)
	release()
	time.Sleep(200 * time.Millisecond)
	e.kubelet(job, 0, pushed)
	if r := oneResult(t, results, req.RequestID); r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginBuild || r.Data.Digest != pushed {
		t.Fatalf("result %s, want the build's own image, origin build", mustJSON(t, r.Data))
	}
}

// The run is ended from outside between the answer of the HEAD sent
// beside its start, which found the tag taken, and the handler's own end
// of it: the handler's compare-and-swap fails and the end stored first
// stands; the handler never writes its refusal over it.
//   - Ended as the reconciler ends a run whose Job went (JobDeleted):
//     that end answers the request, as own's end would.
//   - Ended as refused by its own Pod (TagTaken, the tag found taken as
//     the HEAD found it): the image found answers at once, origin cache,
//     in the request's first attempt, not through a retry.
func TestARunEndedFromOutsideBeforeItsTagWasFoundTakenKeepsThatEnd(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		reason string
	}{
		{"the reconciler's end", v1.ReasonJobDeleted},
		{"its Pod's refusal", v1.ReasonTagTaken},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			tr := newTestRegistry(t)
			req := request("beside-ended-outside")
			key := v1.BuildKey(req, kanikoID)
			var injected atomic.Bool
			e.startWorkerFull("w1", fetchKaniko(), func(c *Config) {
				withRegistry(tr)(c)
				c.TagCheckBeside = time.Minute
			}, nil, func(w *Worker) {
				withPresigner(w)
				bucket := w.runs.Bucket()
				w.runs.UseBucket(&hookedKV{KeyValue: bucket, onUpdate: func(k string, value []byte) error {
					var rec v1.BuildRecord
					refusal := k == key && json.Unmarshal(value, &rec) == nil && rec.Final() && rec.Reason == v1.ReasonTagTaken
					if !refusal || !injected.CompareAndSwap(false, true) {
						return nil
					}
					// The end from outside, stored first.
					ent, err := bucket.Get(context.Background(), key)
					if err != nil {
						return err
					}
					var cur v1.BuildRecord
					if err := json.Unmarshal(ent.Value(), &cur); err != nil {
						return err
					}
					end := finalRecord(&cur, Outcome{Job: cur.Job, JobUID: cur.JobUID, Reason: c.reason, Message: "ended from outside"}, time.Now())
					b, err := json.Marshal(end)
					if err != nil {
						return err
					}
					_, err = bucket.Update(context.Background(), key, b, ent.Revision())
					return err
				}})
			})
			results := e.collect()
			release := tr.holdHeads()
			defer release()
			if _, err := e.pub.Publish(context.Background(), req); err != nil {
				t.Fatal(err)
			}
			job := e.waitJob(jobOf(req))
			// The push's own requests are never held: a HEAD arriving
			// during it would find the tag free.
			eventually(t, 10*time.Second, "the HEAD beside the build's start held", func() bool { return tr.held.Load() > 0 })
			hand := tr.push(t, absentArg(job))
			release()
			r := oneResult(t, results, req.RequestID)
			if !injected.Load() {
				t.Fatal("the handler never ended its run refused: the tag was not found taken beside the build's start")
			}
			switch c.reason {
			case v1.ReasonJobDeleted:
				if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonJobDeleted {
					t.Errorf("result %s, want the end stored first (failed/JobDeleted)", mustJSON(t, r.Data))
				}
			default:
				if r.Data.Status != v1.StatusSucceeded || r.Data.Origin != v1.OriginCache || r.Data.Digest != hand || r.Data.Attempts != 1 {
					t.Errorf("result %s, want the image found at its tag (%s), origin cache, in the first attempt", mustJSON(t, r.Data), hand)
				}
			}
			if rec := e.claim(key); rec == nil || rec.Reason != c.reason || rec.Message != "ended from outside" {
				t.Errorf("the key's record %+v, want the end stored from outside first (%s), not overwritten", rec, c.reason)
			}
		})
	}
}
