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
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
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
