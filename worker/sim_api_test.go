package worker

// The fault simulation's Kubernetes API server: one object tracker shared by
// a fake clientset per worker (and the simulated node), with resource
// versions, a retained event log and watches that resume from a resource
// version as a real API server's do. A watch break therefore loses nothing
// (the reflector resumes from its last version), and a 410 Gone makes the
// reflector relist: what a worker misses is its own fault, not the fake's.
//
// Every mutation goes through simAPI under one mutex, so the simulation's
// record of Jobs (creations, deletions and their causes) is a total order.

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
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
	simJobsGVR = batchv1.SchemeGroupVersion.WithResource("jobs")
	simPodsGVR = corev1.SchemeGroupVersion.WithResource("pods")
)

// simAPIEvent is one change to an object, as a watch delivers it.
type simAPIEvent struct {
	rv  uint64
	gvr schema.GroupVersionResource
	typ watch.EventType
	obj runtime.Object
}

// simAPI is the shared fake API server.
type simAPI struct {
	mu      sync.Mutex
	tracker k8stesting.ObjectTracker
	rv      uint64
	log     []simAPIEvent
	watches map[*simWatch]struct{}
	uids    int
	// onChange observes every change (under mu; it must not block).
	onChange func(ev simAPIEvent, cause string)
	// gc runs delayed work (foreground deletion); nil after close.
	after  func(d time.Duration, f func())
	closed bool
}

func newSimAPI() *simAPI {
	return &simAPI{
		tracker: k8stesting.NewObjectTracker(scheme.Scheme, scheme.Codecs.UniversalDecoder()),
		watches: map[*simWatch]struct{}{},
		after:   func(d time.Duration, f func()) { time.AfterFunc(d, f) },
	}
}

func (a *simAPI) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
	for w := range a.watches {
		w.brk(false)
	}
}

// record stores a change (obj already carries its new resource version)
// and fans it out. Called with mu held.
func (a *simAPI) record(gvr schema.GroupVersionResource, typ watch.EventType, obj runtime.Object, cause string) {
	ev := simAPIEvent{rv: a.rv, gvr: gvr, typ: typ, obj: obj.DeepCopyObject()}
	a.log = append(a.log, ev)
	for w := range a.watches {
		w.offer(ev)
	}
	if a.onChange != nil {
		a.onChange(ev, cause)
	}
}

func (a *simAPI) nextRV(obj runtime.Object) {
	a.rv++
	m, _ := meta.Accessor(obj)
	m.SetResourceVersion(strconv.FormatUint(a.rv, 10))
}

// create stores a new object: the API server gives it a UID and a
// creation time. Called with mu held.
func (a *simAPI) createLocked(gvr schema.GroupVersionResource, obj runtime.Object, ns, cause string) (runtime.Object, error) {
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
func (a *simAPI) updateLocked(gvr schema.GroupVersionResource, obj runtime.Object, cause string) error {
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
func (a *simAPI) removeLocked(gvr schema.GroupVersionResource, ns, name, cause string) error {
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

// podsOfLocked lists the Pods a Job owns (by its controller-uid label).
func (a *simAPI) podsOfLocked(ns string, job *batchv1.Job) []*corev1.Pod {
	l, err := a.tracker.List(simPodsGVR, corev1.SchemeGroupVersion.WithKind("Pod"), ns)
	if err != nil {
		return nil
	}
	var out []*corev1.Pod
	for i := range l.(*corev1.PodList).Items {
		p := &l.(*corev1.PodList).Items[i]
		if p.Labels[batchv1.ControllerUidLabel] == string(job.UID) {
			out = append(out, p)
		}
	}
	return out
}

func (a *simAPI) getJobLocked(ns, name string) (*batchv1.Job, bool) {
	o, err := a.tracker.Get(simJobsGVR, ns, name)
	if err != nil {
		return nil, false
	}
	return o.(*batchv1.Job), true
}

// deleteJobLocked deletes a Job as the API server and the garbage
// collector would: preconditions are checked; foreground deletion marks
// the Job terminating, deletes its Pods and then the Job a moment later;
// otherwise the Job goes now and its Pods right after.
func (a *simAPI) deleteJobLocked(ns, name string, opts metav1.DeleteOptions, cause string) error {
	job, ok := a.getJobLocked(ns, name)
	if !ok {
		return apierrors.NewNotFound(simJobsGVR.GroupResource(), name)
	}
	if p := opts.Preconditions; p != nil {
		if p.UID != nil && *p.UID != job.UID {
			return apierrors.NewConflict(simJobsGVR.GroupResource(), name,
				fmt.Errorf("precondition failed: UID in precondition: %v, UID in object meta: %v", *p.UID, job.UID))
		}
		if p.ResourceVersion != nil && *p.ResourceVersion != job.ResourceVersion {
			return apierrors.NewConflict(simJobsGVR.GroupResource(), name,
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
		if err := a.updateLocked(simJobsGVR, job, cause); err != nil {
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
				_ = a.removeLocked(simPodsGVR, ns, p.Name, "gc")
			}
			_ = a.removeLocked(simJobsGVR, ns, name, cause)
		})
		return nil
	}
	pods := a.podsOfLocked(ns, job)
	if err := a.removeLocked(simJobsGVR, ns, name, cause); err != nil {
		return err
	}
	for _, p := range pods {
		_ = a.removeLocked(simPodsGVR, ns, p.Name, "gc")
	}
	return nil
}

// simKindOf is the kind of the objects of a resource the simulation serves.
func simKindOf(gvr schema.GroupVersionResource) schema.GroupVersionKind {
	switch gvr {
	case simJobsGVR:
		return batchv1.SchemeGroupVersion.WithKind("Job")
	case simPodsGVR:
		return corev1.SchemeGroupVersion.WithKind("Pod")
	}
	return schema.GroupVersionKind{Group: gvr.Group, Version: gvr.Version, Kind: "Unknown"}
}

// list returns a list with the current resource version, filtered by label.
func (a *simAPI) listLocked(act k8stesting.ListAction) (runtime.Object, error) {
	gvr := act.GetResource()
	obj, err := a.tracker.List(gvr, simKindOf(gvr), act.GetNamespace())
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
func (a *simAPI) watch(c *simClient, act k8stesting.WatchAction) (watch.Interface, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, errors.New("api server stopped")
	}
	r := act.GetWatchRestrictions()
	w := &simWatch{
		api: a, client: c, gvr: act.GetResource(), ns: act.GetNamespace(), sel: r.Labels,
		out: make(chan watch.Event), wake: make(chan struct{}, 1), stop: make(chan struct{}),
	}
	switch rv := r.ResourceVersion; rv {
	case "":
		obj, err := a.tracker.List(w.gvr, simKindOf(w.gvr), w.ns)
		if err == nil {
			items, _ := meta.ExtractList(obj)
			for _, it := range items {
				w.offer(simAPIEvent{gvr: w.gvr, typ: watch.Added, obj: it})
			}
		}
	case "0":
	default:
		from, err := strconv.ParseUint(rv, 10, 64)
		if err != nil {
			return nil, apierrors.NewBadRequest("bad resource version " + rv)
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
func (a *simAPI) breakWatches(c *simClient, gone bool) int {
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

// simWatch is a watch with an unbounded queue: the fan-out under the API
// mutex never blocks.
type simWatch struct {
	api    *simAPI
	client *simClient
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

func (w *simWatch) offer(ev simAPIEvent) {
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
func (w *simWatch) brk(gone bool) {
	w.mu.Lock()
	w.broken, w.gone = true, gone
	w.mu.Unlock()
	delete(w.api.watches, w)
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *simWatch) run() {
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

func (w *simWatch) Stop()                          { w.once.Do(func() { close(w.stop) }) }
func (w *simWatch) ResultChan() <-chan watch.Event { return w.out }

// simAPIFault makes a Job create or delete fail: the code, and for a
// create whether the Job was stored before the error (a timeout after the
// commit).
type simAPIFault struct {
	until     time.Time
	p         float64
	committed bool
	// lag: every call is held up to this long, and fails with p = 0;
	// deleteLag: a delete at least this long (a slow delete path).
	lag, deleteLag time.Duration
}

// simClient is one party's clientset on the shared API server.
type simClient struct {
	api  *simAPI
	name string
	cs   *fake.Clientset
	dead atomic.Bool

	mu    sync.Mutex
	fault *simAPIFault
	rnd   func() float64
	// onFault reports an injected error (for the trace).
	onFault func(verb, name string, err error)
}

func (a *simAPI) newClient(name string, rnd func() float64) *simClient {
	c := &simClient{api: a, name: name, cs: &fake.Clientset{}, rnd: rnd}
	c.cs.AddReactor("*", "*", c.react)
	c.cs.AddWatchReactor("*", func(act k8stesting.Action) (bool, watch.Interface, error) {
		if c.dead.Load() {
			return true, nil, errors.New("dial tcp: connection refused (worker killed)")
		}
		w, err := a.watch(c, act.(k8stesting.WatchAction))
		return true, w, err
	})
	return c
}

func (c *simClient) setFault(f *simAPIFault) {
	c.mu.Lock()
	c.fault = f
	c.mu.Unlock()
}

// injected decides whether this call fails, and how.
func (c *simClient) injected(verb string) (committed bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f := c.fault
	if f == nil || time.Now().After(f.until) || f.p == 0 || c.rnd() >= f.p {
		return false, nil
	}
	gr := simJobsGVR.GroupResource()
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
func (c *simClient) delay(verb string) {
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

func (c *simClient) react(act k8stesting.Action) (bool, runtime.Object, error) {
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
	if gvr == simJobsGVR && (verb == "create" || verb == "delete") {
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
		if gvr == simJobsGVR {
			return true, nil, a.deleteJobLocked(act.GetNamespace(), d.GetName(), d.GetDeleteOptions(), c.name)
		}
		return true, nil, a.removeLocked(gvr, act.GetNamespace(), d.GetName(), c.name)
	default:
		return true, nil, apierrors.NewMethodNotSupported(gvr.GroupResource(), verb)
	}
}

// do runs f under the API mutex (the node and the test's own mutations).
func (a *simAPI) do(f func() error) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return errors.New("api server stopped")
	}
	return f()
}
