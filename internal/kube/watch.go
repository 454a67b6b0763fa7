// Package kube observes buildq's kaniko Jobs and their Pods through shared
// informers and turns what it sees into build outcomes. It never polls the
// API server: waiters subscribe to a Job name and re-read the informer
// caches whenever an event for that Job or one of its Pods arrives.
package kube

import (
	"context"
	"errors"
	"sync"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/buildq/buildq/internal/kaniko"
)

// NewInformerFactory returns a shared informer factory limited to buildq's
// objects in one namespace (label managed-by=buildq). The resync period is
// zero: reconciliation is driven by events and by relists after a broken
// watch, never by a timer.
func NewInformerFactory(client kubernetes.Interface, namespace string) informers.SharedInformerFactory {
	return informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = kaniko.ManagedBySelector }),
	)
}

// Watcher fans informer events out to the goroutines waiting on a Job.
type Watcher struct {
	jobs     cache.SharedIndexInformer
	pods     cache.SharedIndexInformer
	nodes    *Nodes
	mu       sync.Mutex
	subs     map[string]map[chan struct{}]struct{}
	finished func(job *batchv1.Job)
	// deleted remembers when Jobs left the cache, so a waiter that never
	// read a short-lived Job still learns that it is gone.
	deleted map[string]tombstone
}

type tombstone struct {
	uid types.UID
	at  time.Time
}

// tombstoneTTL bounds how long a deletion is remembered.
const tombstoneTTL = 10 * time.Minute

// NewWatcher registers event handlers on the factory's Job and Pod
// informers, and a Node informer on it (Nodes). onFinished, if not nil,
// is called (from the informer's goroutine) for every add or update of a
// finished Job, including those of the initial list and of every relist:
// the hook for level-triggered reconciliation. Start the factory and wait for HasSynced afterwards.
func NewWatcher(factory informers.SharedInformerFactory, onFinished func(job *batchv1.Job)) (*Watcher, error) {
	w := &Watcher{
		jobs:     factory.Batch().V1().Jobs().Informer(),
		pods:     factory.Core().V1().Pods().Informer(),
		nodes:    NewNodes(factory),
		subs:     map[string]map[chan struct{}]struct{}{},
		finished: onFinished,
		deleted:  map[string]tombstone{},
	}
	if _, err := w.jobs.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.onJob(obj) },
		UpdateFunc: func(_, obj any) { w.onJob(obj) },
		DeleteFunc: func(obj any) {
			w.tombstone(obj)
			w.onJob(obj)
		},
	}); err != nil {
		return nil, err
	}
	if _, err := w.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.onPod(obj) },
		UpdateFunc: func(_, obj any) { w.onPod(obj) },
		DeleteFunc: func(obj any) { w.onPod(obj) },
	}); err != nil {
		return nil, err
	}
	return w, nil
}

// OnFinished sets the hook called for every finished Job seen (see
// NewWatcher); it replaces any earlier hook.
func (w *Watcher) OnFinished(f func(job *batchv1.Job)) {
	w.mu.Lock()
	w.finished = f
	w.mu.Unlock()
}

// Nodes is the Node cache (nodes.go), registered on the same factory. It
// is not part of HasSynced or WaitForSync: a worker that may not list
// nodes still runs, without the check.
func (w *Watcher) Nodes() *Nodes { return w.nodes }

// HasSynced reports whether both caches hold a full list.
func (w *Watcher) HasSynced() bool { return w.jobs.HasSynced() && w.pods.HasSynced() }

// WaitForSync blocks until the caches are synced or ctx ends.
func (w *Watcher) WaitForSync(ctx context.Context) bool {
	return cache.WaitForCacheSync(ctx.Done(), w.jobs.HasSynced, w.pods.HasSynced)
}

func (w *Watcher) onJob(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	job, ok := obj.(*batchv1.Job)
	if !ok {
		return
	}
	w.notify(job.Name)
	w.mu.Lock()
	finished := w.finished
	w.mu.Unlock()
	if finished != nil && job.DeletionTimestamp == nil {
		if done, _ := Finished(job); done {
			finished(job)
		}
	}
}

func (w *Watcher) tombstone(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	job, ok := obj.(*batchv1.Job)
	if !ok {
		return
	}
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, t := range w.deleted {
		if now.Sub(t.at) > tombstoneTTL {
			delete(w.deleted, k)
		}
	}
	w.deleted[job.Namespace+"/"+job.Name+"/"+string(job.UID)] = tombstone{uid: job.UID, at: now}
}

// Deleted reports whether the informer saw this Job (by UID) deleted.
func (w *Watcher) Deleted(namespace, jobName string, uid types.UID) bool {
	if uid == "" {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	_, ok := w.deleted[namespace+"/"+jobName+"/"+string(uid)]
	return ok
}

func (w *Watcher) onPod(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	if name := jobNameOf(pod); name != "" {
		w.notify(name)
	}
}

func jobNameOf(pod *corev1.Pod) string {
	if n := pod.Labels[batchv1.JobNameLabel]; n != "" {
		return n
	}
	if n := pod.Labels["job-name"]; n != "" {
		return n
	}
	for _, ref := range pod.OwnerReferences {
		if ref.Kind == "Job" {
			return ref.Name
		}
	}
	return ""
}

func (w *Watcher) notify(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.subs[name] {
		select {
		case ch <- struct{}{}:
		default: // a signal is already pending; the waiter re-reads everything
		}
	}
}

// Subscribe returns a channel that receives a signal after any change to the
// Job or its Pods. Subscribe before reading state, so nothing is missed.
func (w *Watcher) Subscribe(jobName string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	if w.subs[jobName] == nil {
		w.subs[jobName] = map[chan struct{}]struct{}{}
	}
	w.subs[jobName][ch] = struct{}{}
	w.mu.Unlock()
	return ch, func() {
		w.mu.Lock()
		delete(w.subs[jobName], ch)
		if len(w.subs[jobName]) == 0 {
			delete(w.subs, jobName)
		}
		w.mu.Unlock()
	}
}

// Subscribers is the number of goroutines waiting on a Job.
func (w *Watcher) Subscribers(jobName string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.subs[jobName])
}

// Jobs lists the Jobs of the informer cache (buildq's, in its namespace).
// The objects are shared with the cache and must not be modified.
func (w *Watcher) Jobs() []*batchv1.Job {
	var out []*batchv1.Job
	for _, o := range w.jobs.GetIndexer().List() {
		out = append(out, o.(*batchv1.Job))
	}
	return out
}

// Get reads a Job and its Pods from the informer caches. The objects are
// shared with the cache and must not be modified.
func (w *Watcher) Get(namespace, jobName string) (*batchv1.Job, []*corev1.Pod, bool) {
	obj, ok, err := w.jobs.GetIndexer().GetByKey(namespace + "/" + jobName)
	if err != nil || !ok {
		return nil, nil, false
	}
	job := obj.(*batchv1.Job)
	sel := labels.SelectorFromSet(labels.Set{batchv1.JobNameLabel: jobName})
	var pods []*corev1.Pod
	for _, o := range w.pods.GetIndexer().List() {
		p := o.(*corev1.Pod)
		if p.Namespace != namespace {
			continue
		}
		if !sel.Matches(labels.Set(p.Labels)) && jobNameOf(p) != jobName {
			continue
		}
		// A Job deleted and created again under the same name may leave
		// Pods of the old one behind: only this Job's own Pods count.
		if uid := p.Labels[batchv1.ControllerUidLabel]; uid != "" && job.UID != "" && uid != string(job.UID) {
			continue
		}
		pods = append(pods, p)
	}
	return job, pods, true
}

// Finished reports whether a Job has reached a terminal condition, and
// whether it succeeded. Both the classic (Complete, Failed) and the newer
// interim conditions (SuccessCriteriaMet, FailureTarget) count: the interim
// ones appear first and already decide the outcome.
func Finished(job *batchv1.Job) (done, succeeded bool) {
	for _, c := range job.Status.Conditions {
		if c.Status != corev1.ConditionTrue {
			continue
		}
		switch c.Type {
		case batchv1.JobComplete, batchv1.JobSuccessCriteriaMet:
			return true, true
		case batchv1.JobFailed, batchv1.JobFailureTarget:
			return true, false
		}
	}
	return false, false
}

// IsTransient reports whether an API error is worth retrying later: 429,
// 5xx and timeouts, and errors that carry no API status at all (the API
// server was not reached).
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return true
	}
	code := status.Status().Code
	return code == 429 || code >= 500 || apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err)
}
