//go:build integration || e2e

package realnode

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func (n *Node) startContainerd() {
	n.containerdSock = n.path("containerd", "containerd.sock")
	cni := n.write("cni/net.d/10-buildq.conflist", fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "buildq-node",
  "plugins": [{
    "type": "bridge",
    "bridge": %q,
    "isGateway": true,
    "ipMasq": false,
    "hairpinMode": true,
    "ipam": {"type": "host-local", "subnet": %q, "dataDir": %q, "routes": []}
  }]
}
`, Bridge, Subnet, n.path("cni", "ipam")))
	reg := n.RegistryHost
	cfg := n.write("containerd/config.toml", fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = %q

[ttrpc]
  address = %q

[debug]
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # No CAP_SYS_RESOURCE on these machines: runc may not raise a process's
  # oom_score_adj above its parent's.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors.%q]
    endpoint = ["http://%s"]
  [plugins."io.containerd.grpc.v1.cri".registry.configs.%q.auth]
    username = %q
    password = %q
`, n.path("containerd", "root"), n.path("containerd", "state"), n.containerdSock, n.containerdSock+".ttrpc",
		n.path("containerd", "opt"), n.Images.Pause, filepath.Dir(cni), reg, reg, reg, n.env.RegistryUser, n.env.RegistryPass))
	p := n.start("containerd", "containerd", "--config", cfg)
	deadline := time.Now().Add(time.Minute)
	for {
		if c, err := net.Dial("unix", n.containerdSock); err == nil {
			c.Close()
			break
		}
		if p.exited() || time.Now().After(deadline) {
			n.t.Fatalf("containerd did not start:\n%s", p.tail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (n *Node) startKubelet() {
	resolv := n.write("kubelet/resolv.conf", "")
	cfg := n.write("kubelet/config.yaml", fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: %d
readOnlyPort: 0
healthzPort: 0
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
makeIPTablesUtilChains: false
resolvConf: %s
podLogsDir: %s
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "100Mi", "nodefs.available": "1%%", "imagefs.available": "1%%", "nodefs.inodesFree": "1%%"}
registerWithTaints:
  - {key: %q, value: "true", effect: NoSchedule}
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
`, Gateway, freePort(Gateway), n.containerdSock, resolv, n.path("pod-logs"), Taint))
	n.start("kubelet", filepath.Join(n.env.Tools, "kubelet"),
		"--config", cfg,
		"--kubeconfig", n.env.Kubeconfig,
		"--root-dir", n.path("kubelet", "root"),
		"--cert-dir", n.path("kubelet", "pki"),
		"--node-ip", Gateway,
		"--hostname-override", Name,
		"--node-labels", Taint+"=true",
		"--v", "2",
	)
}

func (n *Node) startScheduler() {
	// Its own copy of the kubeconfig, so that its command line names the
	// node's directory (sweepLeftovers finds it by that).
	kc, err := os.ReadFile(n.env.Kubeconfig)
	if err != nil {
		n.t.Fatal(err)
	}
	n.start("kube-scheduler", filepath.Join(n.env.Tools, "kube-scheduler"),
		"--kubeconfig", n.write("kube-scheduler/kubeconfig", string(kc)),
		"--leader-elect=false",
		"--secure-port=0",
	)
}

func (n *Node) waitReady(ctx context.Context) {
	kubelet := n.procs[len(n.procs)-1]
	for {
		node, err := n.env.Kube.CoreV1().Nodes().Get(ctx, Name, metav1.GetOptions{})
		if err == nil {
			for _, c := range node.Status.Conditions {
				if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
					// kubelet registers with the not-ready taint; the node
					// lifecycle controller, which the suite does not run,
					// would lift it.
					kept := slices.DeleteFunc(slices.Clone(node.Spec.Taints), func(t corev1.Taint) bool {
						return strings.HasPrefix(t.Key, "node.kubernetes.io/")
					})
					if len(kept) == len(node.Spec.Taints) {
						return
					}
					node.Spec.Taints = kept
					if _, err := n.env.Kube.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err == nil {
						return
					}
				}
			}
		}
		if kubelet.exited() || ctx.Err() != nil {
			n.t.Fatalf("the node did not become Ready:\n%s", kubelet.tail())
		}
		time.Sleep(250 * time.Millisecond)
	}
}
