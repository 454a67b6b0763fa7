//go:build integration

package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The real node: containerd (its own root, state, socket and config, never
// the machine's), runc, a CNI bridge of its own, kubelet and kube-scheduler,
// registered with the suite's kube-apiserver. Pods reach exactly one
// address of this machine, the bridge's gateway, where the test forwards
// the suite's registry and MinIO; the CNI config gives them no default
// route and kubelet's resolv.conf no nameserver, so nothing a build does can
// leave the machine. The node is tainted: only Jobs whose template
// tolerates the taint (the node tests' workers) run there, and the kubelet
// emulator of the other tests never competes with it.
const (
	nodeName    = "buildq-real-node"
	nodeBridge  = "buildq-node0"
	nodeSubnet  = "10.213.77.0/24"
	nodeGateway = "10.213.77.1"
	nodeTaint   = "buildq.dev/real-node"
)

// nodeJobTemplate is the worker's --job-template for builds on the node.
const nodeJobTemplate = `nodeSelector: {"buildq.dev/real-node": "true"}
tolerations:
  - {key: "buildq.dev/real-node", operator: Exists, effect: NoSchedule}
`

type realNode struct {
	t   *testing.T
	dir string

	// registryHost and minioEndpoint are the suite's registry and MinIO as
	// the Pods (and the node tests' workers) address them.
	registryHost  string
	minioEndpoint string
	images        nodeImages

	containerdSock string
	procs          []*nodeProc
	cleanups       []func()
}

type nodeProc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	log  string
}

// kernelTunables are the sysctls kubelet sets at start when
// protectKernelDefaults is off; the harness restores their values after.
var kernelTunables = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"}

// startRealNode brings the node up and registers its teardown with t:
// everything it started stops and everything it made is removed, also
// after a failed test.
func startRealNode(t *testing.T) *realNode {
	t.Helper()
	out, err := exec.Command("bash", "tools/node-packages.sh").CombinedOutput()
	if err != nil {
		t.Fatalf("the real node's packages: %v\n%s", err, out)
	}
	// One real node per machine at a time: the bridge, its subnet and
	// kubelet's fixed paths are the machine's. The lock is the kernel's,
	// so a run that died holding it does not block the next.
	lock, err := os.OpenFile(filepath.Join(os.TempDir(), "buildq-node.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Close() })
	sweepLeftovers(t)

	dir, err := os.MkdirTemp("", "buildq-node-")
	if err != nil {
		t.Fatal(err)
	}
	n := &realNode{t: t, dir: dir}
	t.Cleanup(n.stop)

	saved := map[string]string{}
	for _, k := range kernelTunables {
		if b, err := os.ReadFile("/proc/sys/" + k); err == nil {
			saved[k] = string(b)
		}
	}
	n.cleanups = append(n.cleanups, func() {
		for k, v := range saved {
			_ = os.WriteFile("/proc/sys/"+k, []byte(v), 0o644)
		}
	})

	// The bridge, before kubelet: the node's address is its gateway.
	_ = exec.Command("ip", "link", "del", nodeBridge).Run() // a crashed run's
	for _, args := range [][]string{
		{"link", "add", nodeBridge, "type", "bridge"},
		{"addr", "add", nodeGateway + "/24", "dev", nodeBridge},
		{"link", "set", nodeBridge, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	n.cleanups = append(n.cleanups, func() { _ = exec.Command("ip", "link", "del", nodeBridge).Run() })

	n.registryHost = n.forward(shared.registryHost)
	n.minioEndpoint = "http://" + n.forward(strings.TrimPrefix(shared.minioEndpoint, "http://"))

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n.images, err = pushNodeImages(ctx, shared.registryHost, n.registryHost)
	if err != nil {
		t.Fatalf("node images: %v", err)
	}
	// Paths kubelet and CNI use that cannot be moved under the node's
	// directory: remove them after if this node made them.
	for _, d := range []string{"/var/lib/cni", "/var/lib/cni/results", "/var/log/containers"} {
		if _, err := os.Stat(d); errors.Is(err, os.ErrNotExist) {
			n.cleanups = append(n.cleanups, func() { _ = os.Remove(d) })
		}
	}
	n.cleanups = append(n.cleanups, removeCNICache)
	netnsBefore := netnsNames()
	n.cleanups = append(n.cleanups, func() { removeNewNetns(netnsBefore) })
	n.startContainerd()
	n.startKubelet()
	n.waitReady(ctx)
	n.startScheduler()
	return n
}

// forward listens on the bridge's gateway and forwards each connection to
// target on 127.0.0.1; it returns the gateway address.
func (n *realNode) forward(target string) string {
	l, err := net.Listen("tcp", nodeGateway+":0")
	if err != nil {
		n.t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	track := func(c net.Conn, add bool) {
		mu.Lock()
		defer mu.Unlock()
		if add {
			conns[c] = true
		} else {
			delete(conns, c)
		}
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			track(in, true)
			track(out, true)
			wg.Add(1)
			go func() {
				defer wg.Done()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(out, in); done <- struct{}{} }()
				go func() { _, _ = io.Copy(in, out); done <- struct{}{} }()
				<-done
				in.Close()
				out.Close()
				<-done
				track(in, false)
				track(out, false)
			}()
		}
	}()
	n.cleanups = append(n.cleanups, func() {
		l.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().String()
}

func (n *realNode) path(p ...string) string { return filepath.Join(append([]string{n.dir}, p...)...) }

func (n *realNode) write(rel, content string) string {
	p := n.path(rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		n.t.Fatal(err)
	}
	return p
}

// start runs a node process with its output in dir/<name>.log.
func (n *realNode) start(name string, bin string, args ...string) *nodeProc {
	logPath := n.path(name + ".log")
	logf, err := os.Create(logPath)
	if err != nil {
		n.t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		n.t.Fatalf("start %s: %v", name, err)
	}
	p := &nodeProc{name: name, cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() { _ = cmd.Wait(); logf.Close(); close(p.done) }()
	n.procs = append(n.procs, p)
	return p
}

func (p *nodeProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *nodeProc) tail() string {
	b, _ := os.ReadFile(p.log)
	return tail(string(b), 3000)
}

// stopProc ends a node process: SIGTERM, then SIGKILL after grace.
func stopProc(p *nodeProc, grace time.Duration) {
	if p.exited() {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

func (n *realNode) startContainerd() {
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
`, nodeBridge, nodeSubnet, n.path("cni", "ipam")))
	reg := n.registryHost
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
		n.path("containerd", "opt"), n.images.pause, filepath.Dir(cni), reg, reg, reg, shared.registryUser, shared.registryPass))
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

func (n *realNode) startKubelet() {
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
`, nodeGateway, freePort(nodeGateway), n.containerdSock, resolv, n.path("pod-logs"), nodeTaint))
	n.start("kubelet", filepath.Join(shared.tools, "kubelet"),
		"--config", cfg,
		"--kubeconfig", shared.kubeconfig,
		"--root-dir", n.path("kubelet", "root"),
		"--cert-dir", n.path("kubelet", "pki"),
		"--node-ip", nodeGateway,
		"--hostname-override", nodeName,
		"--node-labels", nodeTaint+"=true",
		"--v", "2",
	)
}

func (n *realNode) startScheduler() {
	// Its own copy of the kubeconfig, so that its command line names the
	// node's directory (sweepLeftovers finds it by that).
	kc, err := os.ReadFile(shared.kubeconfig)
	if err != nil {
		n.t.Fatal(err)
	}
	n.start("kube-scheduler", filepath.Join(shared.tools, "kube-scheduler"),
		"--kubeconfig", n.write("kube-scheduler/kubeconfig", string(kc)),
		"--leader-elect=false",
		"--secure-port=0",
	)
}

func (n *realNode) waitReady(ctx context.Context) {
	kubelet := n.procs[len(n.procs)-1]
	for {
		node, err := shared.kube.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
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
					if _, err := shared.kube.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err == nil {
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

// stop tears the node down in the order that leaves nothing behind: the
// scheduler; the Pods (deleted, so kubelet stops their containers and
// CNI releases their addresses and network namespaces); kubelet; any
// container still running; containerd and its shims; the mounts under the
// node's directory; the bridge; the directory.
func (n *realNode) stop() {
	t := n.t
	for _, p := range n.procs {
		if p.name == "kube-scheduler" {
			stopProc(p, 5*time.Second)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := n.drain(ctx); err != nil {
		t.Logf("real node: drain: %v", err)
	}
	for _, name := range []string{"kubelet", "containerd"} {
		for _, p := range n.procs {
			if p.name != name {
				continue
			}
			if name == "containerd" {
				n.killContainers()
			}
			stopProc(p, 10*time.Second)
		}
	}
	n.killShims()
	_ = shared.kube.CoreV1().Nodes().Delete(ctx, nodeName, metav1.DeleteOptions{})
	for i := len(n.cleanups) - 1; i >= 0; i-- {
		n.cleanups[i]()
	}
	n.unmountAll()
	n.removeLogLinks()
	if t.Failed() {
		for _, p := range n.procs {
			t.Logf("real node: %s log:\n%s", p.name, p.tail())
		}
	}
	if err := os.RemoveAll(n.dir); err != nil {
		t.Errorf("real node: remove %s: %v", n.dir, err)
	}
}

// drain deletes every Pod bound to the node and waits until kubelet has
// removed them.
func (n *realNode) drain(ctx context.Context) error {
	pods := shared.kube.CoreV1().Pods("")
	sel := metav1.ListOptions{FieldSelector: "spec.nodeName=" + nodeName}
	list, err := pods.List(ctx, sel)
	if err != nil {
		return err
	}
	for _, p := range list.Items {
		_ = shared.kube.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	}
	for {
		list, err := pods.List(ctx, sel)
		if err != nil {
			return err
		}
		if len(list.Items) == 0 {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%d pods still on the node", len(list.Items))
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// killContainers stops and removes whatever containerd still runs: Pod
// sandboxes whose network kubelet did not get to tear down, and their
// containers.
func (n *realNode) killContainers() {
	ctr := func(args ...string) string {
		out, _ := exec.Command("ctr", append([]string{"--address", n.containerdSock, "--namespace", "k8s.io"}, args...)...).Output()
		return string(out)
	}
	for _, id := range strings.Fields(ctr("tasks", "ls", "-q")) {
		ctr("tasks", "kill", "--signal", "SIGKILL", id)
	}
	time.Sleep(500 * time.Millisecond)
	for _, id := range strings.Fields(ctr("tasks", "ls", "-q")) {
		ctr("tasks", "delete", "--force", id)
	}
	for _, id := range strings.Fields(ctr("containers", "ls", "-q")) {
		ctr("containers", "delete", id)
	}
}

// killShims ends every process whose command line names the node's
// directory: containerd's shims (they outlive containerd by design), and
// after a crash containerd, kubelet and kube-scheduler themselves.
func (n *realNode) killShims() {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(cmdline, []byte(n.dir)) {
			continue
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// unmountAll detaches every mount under the node's directory (kubelet's
// bind mount of its root, volumes, overlay snapshots) and the network
// namespaces CNI made for Pods that never got torn down.
func (n *realNode) unmountAll() {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var points []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		p := unescapeMount(fields[4])
		if p == n.dir || strings.HasPrefix(p, n.dir+"/") {
			points = append(points, p)
		}
	}
	f.Close()
	// Deepest first.
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			n.t.Logf("real node: unmount %s: %v", p, err)
		}
	}
}

func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// removeLogLinks removes kubelet's /var/log/containers links into this
// node's pod logs (a path kubelet does not let one configure).
func (n *realNode) removeLogLinks() { removeLogLinksTo(n.dir) }

func removeLogLinksTo(dir string) {
	entries, _ := os.ReadDir("/var/log/containers")
	for _, e := range entries {
		p := filepath.Join("/var/log/containers", e.Name())
		if target, err := os.Readlink(p); err == nil && strings.HasPrefix(target, dir) {
			_ = os.Remove(p)
		}
	}
}

// sweepLeftovers removes what a run killed before its cleanup (a test
// binary's timeout, a SIGKILL) left behind: its node's processes, mounts,
// directory and bridge. Called with the node lock held, so no live node is
// touched.
func sweepLeftovers(t *testing.T) {
	old, _ := filepath.Glob(filepath.Join(os.TempDir(), "buildq-node-*"))
	if len(old) == 0 {
		return
	}
	t.Logf("real node: removing what an interrupted run left: %v", old)
	for _, dir := range old {
		n := &realNode{t: t, dir: dir}
		n.killShims() // and every other process started from that directory
		n.unmountAll()
		removeLogLinksTo(dir)
		if err := os.RemoveAll(dir); err != nil {
			t.Logf("real node: remove %s: %v", dir, err)
		}
	}
	removeCNICache()
	_ = exec.Command("ip", "link", "del", nodeBridge).Run()
}

// netnsNames lists the named network namespaces (containerd's CRI keeps a
// Pod's under /var/run/netns while the Pod runs).
func netnsNames() map[string]bool {
	names := map[string]bool{}
	entries, _ := os.ReadDir("/var/run/netns")
	for _, e := range entries {
		names[e.Name()] = true
	}
	return names
}

// removeNewNetns removes the CNI network namespaces made since before.
func removeNewNetns(before map[string]bool) {
	for name := range netnsNames() {
		if before[name] || !strings.HasPrefix(name, "cni-") {
			continue
		}
		p := filepath.Join("/var/run/netns", name)
		_ = syscall.Unmount(p, syscall.MNT_DETACH)
		_ = os.Remove(p)
	}
}

// removeCNICache removes libcni's cached results of the node's network
// (named after it) from /var/lib/cni/results.
func removeCNICache() {
	entries, _ := os.ReadDir("/var/lib/cni/results")
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "buildq-node-") {
			_ = os.Remove(filepath.Join("/var/lib/cni/results", e.Name()))
		}
	}
}

func freePort(host string) int {
	l, err := net.Listen("tcp", host+":0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// dumpNamespace logs the Jobs, Pods and Events of ns (when a node test
// fails, this is what says why).
func dumpNamespace(t *testing.T, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var b strings.Builder
	if jobs, err := shared.kube.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, j := range jobs.Items {
			fmt.Fprintf(&b, "job %s: active=%d succeeded=%d failed=%d conditions=%v\n", j.Name, j.Status.Active, j.Status.Succeeded, j.Status.Failed, j.Status.Conditions)
		}
	}
	if pods, err := shared.kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, p := range pods.Items {
			fmt.Fprintf(&b, "pod %s: node=%q phase=%s conditions=%v\n", p.Name, p.Spec.NodeName, p.Status.Phase, p.Status.Conditions)
			for _, c := range p.Status.ContainerStatuses {
				fmt.Fprintf(&b, "  container %s: %+v\n", c.Name, c.State)
			}
		}
	}
	if evs, err := shared.kube.CoreV1().Events(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, e := range evs.Items {
			fmt.Fprintf(&b, "event %s %s: %s %s\n", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
	t.Logf("namespace %s:\n%s", ns, b.String())
}
