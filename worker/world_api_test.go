package worker

// The test world's Kubernetes API server: one object tracker shared by a
// fake clientset per party (a worker, the test itself; the node works on
// the server directly), with UIDs, resource versions, delete
// preconditions, foreground deletion and the garbage collector's removal
// of a Job's Pods, a retained event log and watches that resume from a
// resource version as a real API server's do. A watch break therefore
// loses nothing (the reflector resumes from its last version), and a 410
// Gone makes the reflector relist: what a worker misses is its own fault,
// not the fake's.
//
// Each client can be made to fail (apiFault: errors, lag) and to die; with
// no fault set it is a plain API server, which is how the harness and the
// scale benchmark use it.
//
// Every mutation goes through apiServer under one mutex, so the record of
// Jobs (creations, deletions and their causes) is a total order.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	k8stesting "k8s.io/client-go/testing"
)

var (
	jobsGVR = batchv1.SchemeGroupVersion.WithResource("jobs")
	podsGVR = corev1.SchemeGroupVersion.WithResource("pods")
)

// apiEvent is one change to an object, as a watch delivers it.
type apiEvent struct {
	rv  uint64
	gvr schema.GroupVersionResource
	typ watch.EventType
	obj runtime.Object
}

// apiServer is the shared fake API server.
type apiServer struct {
	mu      sync.Mutex
	tracker k8stesting.ObjectTracker
	rv      uint64
	log     []apiEvent
	// keep bounds the event log (0: every event is kept): beyond it the
	// oldest events are compacted away, and a watch from before them is
	// answered 410 Gone, as etcd's compaction makes a real server do.
	keep      int
	compacted uint64 // the newest resource version compacted away
	watches   map[*apiWatch]struct{}
	uids      int
	// onChange observes every change (under mu; it must not block).
	onChange func(ev apiEvent, cause string)
	// gc runs delayed work (foreground deletion); nil after close.
	after  func(d time.Duration, f func())
	closed bool
}

func newAPIServer() *apiServer {
	return &apiServer{
		tracker: k8stesting.NewObjectTracker(scheme.Scheme, scheme.Codecs.UniversalDecoder()),
		watches: map[*apiWatch]struct{}{},
		after:   func(d time.Duration, f func()) { time.AfterFunc(d, f) },
	}
}

func (a *apiServer) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
	for w := range a.watches {
		w.brk(false)
	}
}

// record stores a change (obj already carries its new resource version)
// and fans it out. Called with mu held.
func (a *apiServer) record(gvr schema.GroupVersionResource, typ watch.EventType, obj runtime.Object, cause string) {
	ev := apiEvent{rv: a.rv, gvr: gvr, typ: typ, obj: obj.DeepCopyObject()}
	a.log = append(a.log, ev)
	if a.keep > 0 && len(a.log) >= 2*a.keep {
		drop := len(a.log) - a.keep
		a.compacted = a.log[drop-1].rv
		a.log = append([]apiEvent(nil), a.log[drop:]...)
	}
	for w := range a.watches {
		w.offer(ev)
	}
	if a.onChange != nil {
		a.onChange(ev, cause)
	}
}

func (a *apiServer) nextRV(obj runtime.Object) {
	a.rv++
	m, _ := meta.Accessor(obj)
	m.SetResourceVersion(strconv.FormatUint(a.rv, 10))
}

// create stores a new object: the API server gives it a UID and a
// creation time. Called with mu held.
func (a *apiServer) createLocked(gvr schema.GroupVersionResource, obj runtime.Object, ns, cause string) (runtime.Object, error) {
	obj = obj.DeepCopyObject()
	m, err := meta.Accessor(obj)
	if err != nil {
		return nil, err
	}
	if m.GetNamespace() == "" {
		m.SetNamespace(ns)
	}
	if _, err := a.tracker.Get(gvr, m.GetNamespace(), m.GetName()); err == nil {
		return nil, apierrors.NewAlreadyExists(gvr.GroupResource(), m.GetName())
	}
	a.uids++
	m.SetUID(types.UID(fmt.Sprintf("uid-%d", a.uids)))
	m.SetCreationTimestamp(metav1.Now())
	a.nextRV(obj)
	if err := a.tracker.Create(gvr, obj, m.GetNamespace()); err != nil {
		a.rv--
		return nil, err
	}
	a.record(gvr, watch.Added, obj, cause)
	return obj.DeepCopyObject(), nil
}

// update replaces an existing object. Called with mu held.
func (a *apiServer) updateLocked(gvr schema.GroupVersionResource, obj runtime.Object, cause string) error {
	obj = obj.DeepCopyObject()
	m, _ := meta.Accessor(obj)
	a.nextRV(obj)
	if err := a.tracker.Update(gvr, obj, m.GetNamespace()); err != nil {
		return err
	}
	a.record(gvr, watch.Modified, obj, cause)
	return nil
}

// removeLocked deletes an object now. Called with mu held.
func (a *apiServer) removeLocked(gvr schema.GroupVersionResource, ns, name, cause string) error {
	cur, err := a.tracker.Get(gvr, ns, name)
	if err != nil {
		return err
	}
	if err := a.tracker.Delete(gvr, ns, name); err != nil {
		return err
	}
	a.nextRV(cur)
	a.record(gvr, watch.Deleted, cur, cause)
	return nil
}

// podsOfLocked lists the Pods a Job owns: by their controller-uid label,
// or, for a Pod a test made without one, by their job-name label.
func (a *apiServer) podsOfLocked(ns string, job *batchv1.Job) []*corev1.Pod {
	l, err := a.tracker.List(podsGVR, corev1.SchemeGroupVersion.WithKind("Pod"), ns)
	if err != nil {
		return nil
	}
	var out []*corev1.Pod
	for i := range l.(*corev1.PodList).Items {
		p := &l.(*corev1.PodList).Items[i]
		uid, labeled := p.Labels[batchv1.ControllerUidLabel]
		if uid == string(job.UID) || (!labeled && p.Labels[batchv1.JobNameLabel] == job.Name) {
			out = append(out, p)
		}
	}
	return out
}

func (a *apiServer) getJobLocked(ns, name string) (*batchv1.Job, bool) {
	o, err := a.tracker.Get(jobsGVR, ns, name)
	if err != nil {
		return nil, false
	}
	return o.(*batchv1.Job), true
}

// deleteJobLocked deletes a Job as the API server and the garbage
// collector would: preconditions are checked; foreground deletion marks
// the Job terminating, deletes its Pods and then the Job a moment later;
// otherwise the Job goes now and its Pods right after.
func (a *apiServer) deleteJobLocked(ns, name string, opts metav1.DeleteOptions, cause string) error {
	job, ok := a.getJobLocked(ns, name)
	if !ok {
		return apierrors.NewNotFound(jobsGVR.GroupResource(), name)
	}
	if p := opts.Preconditions; p != nil {
		if p.UID != nil && *p.UID != job.UID {
			return apierrors.NewConflict(jobsGVR.GroupResource(), name,
				fmt.Errorf("precondition failed: UID in precondition: %v, UID in object meta: %v", *p.UID, job.UID))
		}
		if p.ResourceVersion != nil && *p.ResourceVersion != job.ResourceVersion {
			return apierrors.NewConflict(jobsGVR.GroupResource(), name,
				fmt.Errorf("precondition failed: ResourceVersion in precondition: %v, ResourceVersion in object meta: %v", *p.ResourceVersion, job.ResourceVersion))
		}
	}
	if job.DeletionTimestamp != nil {
		return nil // already terminating
	}
	if opts.PropagationPolicy != nil && *opts.PropagationPolicy == metav1.DeletePropagationForeground {
		now := metav1.Now()
		job.DeletionTimestamp = &now
		job.Finalizers = append(job.Finalizers, metav1.FinalizerDeleteDependents)
		if err := a.updateLocked(jobsGVR, job, cause); err != nil {
			return err
		}
		uid := job.UID
		a.after(time.Duration(20+a.rv%180)*time.Millisecond, func() {
			a.mu.Lock()
			defer a.mu.Unlock()
			if a.closed {
				return
			}
			cur, ok := a.getJobLocked(ns, name)
			if !ok || cur.UID != uid {
				return
			}
			for _, p := range a.podsOfLocked(ns, cur) {
				_ = a.removeLocked(podsGVR, ns, p.Name, "gc")
			}
			_ = a.removeLocked(jobsGVR, ns, name, cause)
		})
		return nil
	}
	pods := a.podsOfLocked(ns, job)
	if err := a.removeLocked(jobsGVR, ns, name, cause); err != nil {
		return err
	}
	for _, p := range pods {
		_ = a.removeLocked(podsGVR, ns, p.Name, "gc")
	}
	return nil
}

// kindOf is the kind of the objects of a resource the server serves (any
// of client-go's scheme).
func kindOf(gvr schema.GroupVersionResource) schema.GroupVersionKind {
	switch gvr {
	case jobsGVR:
		return batchv1.SchemeGroupVersion.WithKind("Job")
	case podsGVR:
		return corev1.SchemeGroupVersion.WithKind("Pod")
	}
	if k, ok := kinds.Load(gvr); ok {
		return k.(schema.GroupVersionKind)
	}
	for gvk := range scheme.Scheme.AllKnownTypes() {
		if gvk.Group != gvr.Group || gvk.Version != gvr.Version || strings.HasSuffix(gvk.Kind, "List") {
			continue
		}
		if plural, _ := meta.UnsafeGuessKindToResource(gvk); plural.Resource == gvr.Resource {
			kinds.Store(gvr, gvk)
			return gvk
		}
	}
	return schema.GroupVersionKind{Group: gvr.Group, Version: gvr.Version, Kind: "Unknown"}
}

var kinds sync.Map // GroupVersionResource → GroupVersionKind

// list returns a list with the current resource version, filtered by label.
func (a *apiServer) listLocked(act k8stesting.ListAction) (runtime.Object, error) {
	gvr := act.GetResource()
	obj, err := a.tracker.List(gvr, kindOf(gvr), act.GetNamespace())
	if err != nil {
		return nil, err
	}
	sel := act.GetListRestrictions().Labels
	if sel != nil && !sel.Empty() {
		items, _ := meta.ExtractList(obj)
		var keep []runtime.Object
		for _, it := range items {
			m, _ := meta.Accessor(it)
			if sel.Matches(labels.Set(m.GetLabels())) {
				keep = append(keep, it)
			}
		}
		_ = meta.SetList(obj, keep)
	}
	if lm, err := meta.ListAccessor(obj); err == nil {
		lm.SetResourceVersion(strconv.FormatUint(a.rv, 10))
	}
	return obj, nil
}

// watch opens a watch from a resource version: the events after it are
// replayed first. "" starts with the current objects, "0" with nothing.
func (a *apiServer) watch(c *apiClient, act k8stesting.WatchAction) (watch.Interface, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, errors.New("api server stopped")
	}
	r := act.GetWatchRestrictions()
	w := &apiWatch{
		api: a, client: c, gvr: act.GetResource(), ns: act.GetNamespace(), sel: r.Labels,
		out: make(chan watch.Event), wake: make(chan struct{}, 1), stop: make(chan struct{}),
	}
	switch rv := r.ResourceVersion; rv {
	case "":
		obj, err := a.tracker.List(w.gvr, kindOf(w.gvr), w.ns)
		if err == nil {
			items, _ := meta.ExtractList(obj)
			for _, it := range items {
				w.offer(apiEvent{gvr: w.gvr, typ: watch.Added, obj: it})
			}
		}
	case "0":
	default:
		from, err := strconv.ParseUint(rv, 10, 64)
		if err != nil {
			return nil, apierrors.NewBadRequest("bad resource version " + rv)
		}
		if from < a.compacted {
			// Events after from were compacted away: the watch ends at
			// once with 410 Gone, and the reflector relists.
			w.broken, w.gone = true, true
			go w.run()
			return w, nil
		}
		for _, ev := range a.log {
			if ev.rv > from {
				w.offer(ev)
			}
		}
	}
	a.watches[w] = struct{}{}
	go w.run()
	return w, nil
}

// breakWatches ends every watch of one client: closed, or with a 410 Gone.
func (a *apiServer) breakWatches(c *apiClient, gone bool) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for w := range a.watches {
		if w.client == c {
			w.brk(gone)
			n++
		}
	}
	return n
}

// apiWatch is a watch with an unbounded queue: the fan-out under the API
// mutex never blocks.
type apiWatch struct {
	api    *apiServer
	client *apiClient
	gvr    schema.GroupVersionResource
	ns     string
	sel    labels.Selector

	mu     sync.Mutex
	queue  []watch.Event
	broken bool
	gone   bool
	out    chan watch.Event
	wake   chan struct{}
	stop   chan struct{}
	once   sync.Once
}

func (w *apiWatch) offer(ev apiEvent) {
	if ev.gvr != w.gvr {
		return
	}
	m, err := meta.Accessor(ev.obj)
	if err != nil {
		return
	}
	if w.ns != "" && m.GetNamespace() != w.ns {
		return
	}
	if w.sel != nil && !w.sel.Matches(labels.Set(m.GetLabels())) {
		return
	}
	w.mu.Lock()
	w.queue = append(w.queue, watch.Event{Type: ev.typ, Object: ev.obj.DeepCopyObject()})
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

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
