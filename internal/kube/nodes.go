package kube

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/buildq/buildq/internal/kaniko"
)

// Nodes tells, from a Node informer, whether any node can take a build
// Pod with a given node selector and tolerations: a request for a platform
// no node runs is refused at once instead of leaving its Pod Pending until
// the build's deadline (issue 29).
type Nodes struct {
	informer cache.SharedIndexInformer
	// waited is set once a WaitForSync has run out: later ones do not
	// wait (a worker that may not list nodes would wait on every build).
	waited atomic.Bool
}

// NewNodes registers a Node informer on factory, started and stopped with
// it. Nodes are cluster-scoped and carry no buildq label, so the informer
// ignores the factory's namespace and label filter (list/watch nodes needs
// a ClusterRole: deploy/base/rbac.yaml). Only what the check reads is
// kept: a node's image list and managed fields are dropped.
func NewNodes(factory informers.SharedInformerFactory) *Nodes {
	inf := factory.InformerFor(&corev1.Node{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredNodeInformer(c, resync, cache.Indexers{}, nil)
	})
	// After InformerFor, which sets the factory's own (none); an error
	// means the informer already runs, which keeps the fields.
	_ = inf.SetTransform(func(obj any) (any, error) {
		if n, ok := obj.(*corev1.Node); ok {
			n.ManagedFields = nil
			n.Status.Images = nil
		}
		return obj, nil
	})
	return &Nodes{informer: inf}
}

// HasSynced reports whether the Node cache holds a full list.
func (n *Nodes) HasSynced() bool { return n != nil && n.informer.HasSynced() }

// WaitForSync waits at most limit for the Node cache to sync, or not at
// all once an earlier wait ran out; it reports whether it has synced. A
// request that arrives while the worker starts is checked, rather than
// let through; a worker without the right to list nodes waits once.
func (n *Nodes) WaitForSync(ctx context.Context, limit time.Duration) bool {
	if n == nil {
		return false
	}
	if n.HasSynced() || n.waited.Load() {
		return n.HasSynced()
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	if cache.WaitForCacheSync(ctx.Done(), n.HasSynced) {
		return true
	}
	n.waited.Store(true)
	return false
}

// NoNodeError says that no Ready, schedulable node takes a platform's
// build Pods.
type NoNodeError struct {
	Platform string
	Selector map[string]string
	// Nodes is how many nodes the cluster has; Overridden whether the
	// selector is the operator's (--platform-node-selector) rather than
	// the platform's default.
	Nodes      int
	Overridden bool
}

func (e *NoNodeError) Error() string {
	hint := fmt.Sprintf("add such a node, or name nodes that run %s programs natively with --platform-node-selector %s=KEY=VALUE", e.Platform, e.Platform)
	if e.Overridden {
		hint = "check the worker's --platform-node-selector for " + e.Platform
	}
	return fmt.Sprintf("platform %s: no Ready, schedulable node (of %d in the cluster) matches the build Pods' node selector %s and tolerates their taints; the build would never start: %s",
		e.Platform, e.Nodes, kaniko.FormatSelector(e.Selector), hint)
}

// Check returns a *NoNodeError when no node can take a build Pod of
// platform with selector and tolerations: none is Ready, schedulable, not
// being deleted, labelled as selector says, and free of NoSchedule and
// NoExecute taints the tolerations do not tolerate. It allows (nil)
// whenever it cannot know: before the cache has synced (the worker may
// not be allowed to list nodes), and when the cluster shows no node at
// all (an API server without kubelets, whose Pods something else
// binds). A node group that scales up from zero for a Pending Pod is not
// seen either: such a platform needs a node to exist.
func (n *Nodes) Check(platform string, selector map[string]string, tolerations []corev1.Toleration, overridden bool) error {
	if !n.HasSynced() {
		return nil
	}
	objs := n.informer.GetStore().List()
	if len(objs) == 0 {
		return nil
	}
	for _, o := range objs {
		if node, ok := o.(*corev1.Node); ok && Takes(node, selector, tolerations) {
			return nil
		}
	}
	return &NoNodeError{Platform: platform, Selector: selector, Nodes: len(objs), Overridden: overridden}
}

// Takes reports whether node would take a Pod with selector and
// tolerations, as far as the scheduler's node-selector, unschedulable
// and taint filters go (not resources or affinity).
func Takes(node *corev1.Node, selector map[string]string, tolerations []corev1.Toleration) bool {
	if node.DeletionTimestamp != nil || node.Spec.Unschedulable || !ready(node) {
		return false
	}
	for k, v := range selector {
		if got, ok := node.Labels[k]; !ok || got != v {
			return false
		}
	}
	for i := range node.Spec.Taints {
		taint := &node.Spec.Taints[i]
		if taint.Effect != corev1.TaintEffectNoSchedule && taint.Effect != corev1.TaintEffectNoExecute {
			continue
		}
		tolerated := false
		for j := range tolerations {
			if tolerations[j].ToleratesTaint(klog.Background(), taint, false) {
				tolerated = true
				break
			}
		}
		if !tolerated {
			return false
		}
	}
	return true
}

func ready(node *corev1.Node) bool {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
