package kube

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/kaniko"
)

func node(name, arch string, mutate ...func(*corev1.Node)) *corev1.Node {
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelOSStable: "linux", corev1.LabelArchStable: arch}},
		Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}},
			Images: []corev1.ContainerImage{{Names: []string{"big/image:1"}, SizeBytes: 1 << 30}}},
	}
	for _, m := range mutate {
		m(n)
	}
	return n
}

// startNodes runs a Watcher's informers over a fake cluster holding
// objs, as the worker does, and waits for the Node cache.
func startNodes(t *testing.T, objs ...*corev1.Node) (*Nodes, *fake.Clientset) {
	t.Helper()
	client := fake.NewClientset()
	for _, o := range objs {
		if _, err := client.CoreV1().Nodes().Create(context.Background(), o, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	factory := NewInformerFactory(client, "builds")
	w, err := NewWatcher(factory, nil)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	factory.Start(stop)
	t.Cleanup(func() { close(stop); factory.Shutdown() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !cache.WaitForCacheSync(ctx.Done(), w.Nodes().HasSynced) {
		t.Fatal("the Node cache did not sync")
	}
	return w.Nodes(), client
}

func request(platform string) *v1.Request {
	return &v1.Request{Tenant: "acme", Name: "web", Platforms: []string{platform}}
}

// Issue 29: a platform no Ready, schedulable node runs is refused with
// the platform and the selector named; what a node runs is allowed.
func TestNodesRefuseAPlatformNoNodeRuns(t *testing.T) {
	t.Parallel()
	taint := corev1.Taint{Key: "builds", Value: "only", Effect: corev1.TaintEffectNoSchedule}
	nodes, _ := startNodes(t,
		node("amd", "amd64"),
		node("arm-not-ready", "arm64", func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionFalse }),
		node("ppc-cordoned", "ppc64le", func(n *corev1.Node) { n.Spec.Unschedulable = true }),
		node("s390x-tainted", "s390x", func(n *corev1.Node) { n.Spec.Taints = []corev1.Taint{taint} }),
		node("riscv-prefers-not", "riscv64", func(n *corev1.Node) {
			n.Spec.Taints = []corev1.Taint{{Key: "slow", Effect: corev1.TaintEffectPreferNoSchedule}}
		}),
	)
	override := kaniko.Config{PlatformNodeSelectors: kaniko.PlatformSelectors{"linux/386": {corev1.LabelArchStable: "amd64"}}}
	tolerant := kaniko.Config{Tolerations: []corev1.Toleration{{Key: "builds", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}}
	pooled := kaniko.Config{NodeSelector: map[string]string{"pool": "builds"}}
	cases := []struct {
		name, platform string
		cfg            kaniko.Config
		refused        bool
	}{
		{"a node of the platform", "linux/amd64", kaniko.Config{}, false},
		{"no node of the platform", "linux/386", kaniko.Config{}, true},
		{"--platform-node-selector names nodes that run it", "linux/386", override, false},
		{"the only node is not Ready", "linux/arm64", kaniko.Config{}, true},
		{"the only node is cordoned", "linux/ppc64le", kaniko.Config{}, true},
		{"a taint the build Pods do not tolerate", "linux/s390x", kaniko.Config{}, true},
		{"a taint the job template tolerates", "linux/s390x", tolerant, false},
		{"PreferNoSchedule does not keep a Pod off", "linux/riscv64", kaniko.Config{}, false},
		{"the job template's selector matches no node", "linux/amd64", pooled, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := request(c.platform)
			_, overridden := c.cfg.PlatformNodeSelectors[c.platform]
			sel := kaniko.NodeSelector(r, c.cfg)
			err := nodes.Check(c.platform, sel, c.cfg.Tolerations, overridden)
			if !c.refused {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			var nn *NoNodeError
			if !errors.As(err, &nn) {
				t.Fatalf("allowed (err %v)", err)
			}
			msg := err.Error()
			for _, want := range []string{"platform " + c.platform, kaniko.FormatSelector(sel), "no Ready, schedulable node"} {
				if !strings.Contains(msg, want) {
					t.Errorf("message %q does not say %q", msg, want)
				}
			}
		})
	}
}

// It allows whenever it cannot know: before the cache has synced (the
// worker may lack the ClusterRole), and in a cluster that shows no nodes.
func TestNodesAllowWhenTheyCannotTell(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset(node("amd", "amd64"))
	unstarted := NewNodes(NewInformerFactory(client, "builds"))
	if err := unstarted.Check("linux/s390x", map[string]string{corev1.LabelArchStable: "s390x"}, nil, false); err != nil {
		t.Errorf("an unsynced cache refused: %v", err)
	}
	var none *Nodes
	if err := none.Check("linux/s390x", nil, nil, false); err != nil {
		t.Errorf("no cache refused: %v", err)
	}
	empty, _ := startNodes(t)
	if err := empty.Check("linux/s390x", map[string]string{corev1.LabelArchStable: "s390x"}, nil, false); err != nil {
		t.Errorf("a cluster without nodes refused: %v", err)
	}
}

// The cache follows the cluster: a node added later serves the platform
// (a refused request's next try builds), and the cache keeps no image
// list.
func TestNodesFollowTheCluster(t *testing.T) {
	t.Parallel()
	nodes, client := startNodes(t, node("amd", "amd64"))
	sel := map[string]string{corev1.LabelOSStable: "linux", corev1.LabelArchStable: "arm64"}
	if err := nodes.Check("linux/arm64", sel, nil, false); err == nil {
		t.Fatal("arm64 allowed without an arm64 node")
	}
	if _, err := client.CoreV1().Nodes().Create(context.Background(), node("arm", "arm64"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := wait.PollUntilContextCancel(ctx, 10*time.Millisecond, true, func(context.Context) (bool, error) {
		return nodes.Check("linux/arm64", sel, nil, false) == nil, nil
	}); err != nil {
		t.Fatalf("the new arm64 node was never seen: %v", err)
	}
	for _, o := range nodes.informer.GetStore().List() {
		if n := o.(*corev1.Node); len(n.Status.Images) > 0 {
			t.Errorf("node %s kept its image list in the cache", n.Name)
		}
	}
}

// WaitForSync waits once: after it has run out, later calls return at
// once (a worker that may not list nodes does not wait on every build).
func TestNodesWaitForSyncOnce(t *testing.T) {
	t.Parallel()
	unstarted := NewNodes(NewInformerFactory(fake.NewClientset(), "builds"))
	if unstarted.WaitForSync(context.Background(), 50*time.Millisecond) {
		t.Fatal("an unstarted cache says it synced")
	}
	start := time.Now()
	if unstarted.WaitForSync(context.Background(), time.Hour) {
		t.Fatal("an unstarted cache says it synced")
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("the second wait took %s", d)
	}
	started, _ := startNodes(t, node("amd", "amd64"))
	if !started.WaitForSync(context.Background(), time.Second) {
		t.Fatal("a synced cache says it did not sync")
	}
}
