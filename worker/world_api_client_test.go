package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	k8stesting "k8s.io/client-go/testing"
)

// The test world's API server as its clients see it: watches, the
// client, and the faults it injects.

// brk breaks the watch; called with the API mutex held.
func (w *apiWatch) brk(gone bool) {
	w.mu.Lock()
	w.broken, w.gone = true, gone
	w.mu.Unlock()
	delete(w.api.watches, w)
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *apiWatch) run() {
	defer close(w.out)
	defer func() {
		w.api.mu.Lock()
		delete(w.api.watches, w)
		w.api.mu.Unlock()
	}()
	for {
		w.mu.Lock()
		if w.broken {
			gone := w.gone
			w.mu.Unlock()
			if gone {
				st := apierrors.NewResourceExpired("too old resource version (simulated 410 Gone)").Status()
				select {
				case w.out <- watch.Event{Type: watch.Error, Object: &st}:
				case <-w.stop:
				}
			}
			return
		}
		var ev *watch.Event
		if len(w.queue) > 0 {
			ev = &w.queue[0]
			w.queue = w.queue[1:]
		}
		w.mu.Unlock()
		if ev == nil {
			select {
			case <-w.wake:
			case <-w.stop:
				return
			}
			continue
		}
		select {
		case w.out <- *ev:
		case <-w.wake:
			// Re-queue at the front and look at the break flag first.
			w.mu.Lock()
			w.queue = append([]watch.Event{*ev}, w.queue...)
			w.mu.Unlock()
		case <-w.stop:
			return
		}
	}
}

func (w *apiWatch) Stop()                          { w.once.Do(func() { close(w.stop) }) }
func (w *apiWatch) ResultChan() <-chan watch.Event { return w.out }

// apiFault makes a Job create or delete fail: the code, and for a
// create whether the Job was stored before the error (a timeout after the
// commit).
type apiFault struct {
	until     time.Time
	p         float64
	committed bool
	// lag: every call is held up to this long, and fails with p = 0;
	// deleteLag: a delete at least this long (a slow delete path).
	lag, deleteLag time.Duration
}

// apiClient is one party's clientset on the shared API server: a client-go
// fake clientset whose every call goes to the server (reactors a test
// prepends run first), named in the server's record as the cause of what
// it does.
type apiClient struct {
	*fake.Clientset
	api  *apiServer
	name string
	dead atomic.Bool

	mu    sync.Mutex
	fault *apiFault
	rnd   func() float64
	// onFault reports an injected error (for the trace).
	onFault func(verb, name string, err error)
}

// newClient makes a client of the server; rnd draws the injected faults
// (nil: the client is never given any).
func (a *apiServer) newClient(name string, rnd func() float64) *apiClient {
	c := &apiClient{Clientset: &fake.Clientset{}, api: a, name: name, rnd: rnd}
	c.AddReactor("*", "*", c.react)
	c.AddWatchReactor("*", func(act k8stesting.Action) (bool, watch.Interface, error) {
		if c.dead.Load() {
			return true, nil, errors.New("dial tcp: connection refused (worker killed)")
		}
		w, err := a.watch(c, act.(k8stesting.WatchAction))
		return true, w, err
	})
	return c
}

func (c *apiClient) setFault(f *apiFault) {
	c.mu.Lock()
	c.fault = f
	c.mu.Unlock()
}

// injected decides whether this call fails, and how.
func (c *apiClient) injected(verb string) (committed bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f := c.fault
	if f == nil || time.Now().After(f.until) || f.p == 0 || c.rnd() >= f.p {
		return false, nil
	}
	gr := jobsGVR.GroupResource()
	switch x := c.rnd(); {
	case x < 0.4:
		err = apierrors.NewInternalError(errors.New("etcdserver: leader changed (injected)"))
	case x < 0.7:
		err = apierrors.NewTooManyRequests("injected throttling", 1)
	case x < 0.85:
		err = apierrors.NewConflict(gr, "", errors.New("injected conflict"))
	default:
		if verb == "create" && f.committed {
			return true, apierrors.NewServerTimeout(gr, "create", 1)
		}
		err = apierrors.NewInternalError(errors.New("injected"))
	}
	return false, err
}

// delay holds a call for the injected lag, if any: the request reaches
// the API server late, whatever happened meanwhile.
func (c *apiClient) delay(verb string) {
	c.mu.Lock()
	f := c.fault
	d := time.Duration(0)
	if f != nil && f.lag > 0 && time.Now().Before(f.until) {
		d = time.Duration(c.rnd() * float64(f.lag))
		if verb == "delete" {
			d += f.deleteLag
		}
	}
	c.mu.Unlock()
	if d > 0 {
		time.Sleep(d)
	}
}

func (c *apiClient) react(act k8stesting.Action) (bool, runtime.Object, error) {
	if c.dead.Load() {
		return true, nil, errors.New("dial tcp: connection refused (worker killed)")
	}
	c.delay(act.GetVerb())
	a := c.api
	gvr := act.GetResource()
	verb := act.GetVerb()
	if act.GetSubresource() == "log" {
		return true, &corev1.Pod{}, nil
	}
	if gvr == jobsGVR && (verb == "create" || verb == "delete") {
		if committed, err := c.injected(verb); err != nil {
			if committed {
				a.mu.Lock()
				_, cerr := a.createLocked(gvr, act.(k8stesting.CreateAction).GetObject(), act.GetNamespace(), c.name)
				a.mu.Unlock()
				if cerr != nil {
					err = cerr
				}
			}
			if c.onFault != nil {
				name := ""
				if d, ok := act.(k8stesting.DeleteAction); ok {
					name = d.GetName()
				} else if cr, ok := act.(k8stesting.CreateAction); ok {
					if m, e := meta.Accessor(cr.GetObject()); e == nil {
						name = m.GetName()
					}
				}
				c.onFault(verb, name, err)
			}
			return true, nil, err
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return true, nil, errors.New("api server stopped")
	}
	switch verb {
	case "get":
		o, err := a.tracker.Get(gvr, act.GetNamespace(), act.(k8stesting.GetAction).GetName())
		return true, o, err
	case "list":
		o, err := a.listLocked(act.(k8stesting.ListAction))
		return true, o, err
	case "create":
		o, err := a.createLocked(gvr, act.(k8stesting.CreateAction).GetObject(), act.GetNamespace(), c.name)
		return true, o, err
	case "update":
		obj := act.(k8stesting.UpdateAction).GetObject()
		if err := a.updateLocked(gvr, obj, c.name); err != nil {
			return true, nil, err
		}
		return true, obj, nil
	case "delete":
		d := act.(k8stesting.DeleteAction)
		if gvr == jobsGVR {
			return true, nil, a.deleteJobLocked(act.GetNamespace(), d.GetName(), d.GetDeleteOptions(), c.name)
		}
		return true, nil, a.removeLocked(gvr, act.GetNamespace(), d.GetName(), c.name)
	default:
		return true, nil, apierrors.NewMethodNotSupported(gvr.GroupResource(), verb)
	}
}

// Tracker is the server's object store, as a fake clientset's Tracker is:
// what a test writes through it is seen by every watch.
func (c *apiClient) Tracker() k8stesting.ObjectTracker { return apiTracker{api: c.api, cause: c.name} }

// apiTracker writes to the server under its mutex, bypassing the clients'
// reactors (as a fake clientset's tracker does), with the server's
// resource versions, UIDs and watch events.
type apiTracker struct {
	api   *apiServer
	cause string
}

var errTrackerUnsupported = errors.New("not supported by the test world's API server")

func (tr apiTracker) Add(obj runtime.Object) error {
	m, err := meta.Accessor(obj)
	if err != nil {
		return err
	}
	gvks, _, err := scheme.Scheme.ObjectKinds(obj)
	if err != nil {
		return err
	}
	gvr, _ := meta.UnsafeGuessKindToResource(gvks[0])
	if _, err := tr.Get(gvr, m.GetNamespace(), m.GetName()); err == nil {
		return tr.Update(gvr, obj, m.GetNamespace())
	}
	return tr.Create(gvr, obj, m.GetNamespace())
}

func (tr apiTracker) Get(gvr schema.GroupVersionResource, ns, name string, _ ...metav1.GetOptions) (runtime.Object, error) {
	var o runtime.Object
	err := tr.api.do(func() error {
		var err error
		o, err = tr.api.tracker.Get(gvr, ns, name)
		return err
	})
	return o, err
}

func (tr apiTracker) Create(gvr schema.GroupVersionResource, obj runtime.Object, ns string, _ ...metav1.CreateOptions) error {
	return tr.api.do(func() error {
		_, err := tr.api.createLocked(gvr, obj, ns, tr.cause)
		return err
	})
}

func (tr apiTracker) Update(gvr schema.GroupVersionResource, obj runtime.Object, _ string, _ ...metav1.UpdateOptions) error {
	return tr.api.do(func() error { return tr.api.updateLocked(gvr, obj, tr.cause) })
}

func (tr apiTracker) Patch(schema.GroupVersionResource, runtime.Object, string, ...metav1.PatchOptions) error {
	return errTrackerUnsupported
}

func (tr apiTracker) Apply(schema.GroupVersionResource, runtime.Object, string, ...metav1.PatchOptions) error {
	return errTrackerUnsupported
}

func (tr apiTracker) List(gvr schema.GroupVersionResource, gvk schema.GroupVersionKind, ns string, _ ...metav1.ListOptions) (runtime.Object, error) {
	var o runtime.Object
	err := tr.api.do(func() error {
		var err error
		o, err = tr.api.tracker.List(gvr, gvk, ns)
		return err
	})
	return o, err
}

// Delete removes the object now, as a fake clientset's tracker does (no
// preconditions, no foreground deletion, no garbage collection).
func (tr apiTracker) Delete(gvr schema.GroupVersionResource, ns, name string, _ ...metav1.DeleteOptions) error {
	return tr.api.do(func() error { return tr.api.removeLocked(gvr, ns, name, tr.cause) })
}

func (tr apiTracker) Watch(schema.GroupVersionResource, string, ...metav1.ListOptions) (watch.Interface, error) {
	return nil, errTrackerUnsupported
}

// do runs f under the API mutex (the node and the test's own mutations).
func (a *apiServer) do(f func() error) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return errors.New("api server stopped")
	}
	return f()
}

// A watch resumes from a resource version the log still holds, and is
// answered 410 Gone from one compacted away (the reflector relists), as
// a real API server after etcd's compaction.
func TestWorldAPIWatchResumesOrAnswersGone(t *testing.T) {
	t.Parallel()
	a := newAPIServer()
	a.keep = 2
	defer a.close()
	c := a.newClient("test", nil)
	for i := range 5 {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("p%d", i), Namespace: testNamespace}}
		if _, err := c.CoreV1().Pods(testNamespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Five events, the log compacted to the last two at the fourth.
	first := func(rv string) watch.Event {
		t.Helper()
		w, err := c.CoreV1().Pods(testNamespace).Watch(context.Background(), metav1.ListOptions{ResourceVersion: rv})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Stop()
		select {
		case ev := <-w.ResultChan():
			return ev
		case <-time.After(5 * time.Second):
			t.Fatalf("no event from resource version %s", rv)
			return watch.Event{}
		}
	}
	if ev := first("4"); ev.Type != watch.Added || ev.Object.(*corev1.Pod).Name != "p4" {
		t.Errorf("a watch from 4: %s %+v, want p4 added", ev.Type, ev.Object)
	}
	ev := first("1")
	if st, ok := ev.Object.(*metav1.Status); ev.Type != watch.Error || !ok || !apierrors.IsResourceExpired(apierrors.FromObject(st)) {
		t.Errorf("a watch from 1, compacted away: %s %+v, want 410 Gone", ev.Type, ev.Object)
	}
}

// PrependReactor is the fake's, under the lock its Invokes holds: tests
// add reactors while the worker's informers list (the fake's own
// PrependReactor takes no lock).
func (c *apiClient) PrependReactor(verb, resource string, reaction k8stesting.ReactionFunc) {
	c.Clientset.Lock()
	defer c.Clientset.Unlock()
	c.Clientset.PrependReactor(verb, resource, reaction)
}
