//go:build e2e

// Copied from integration/node_test.go (package integration, whose test files
// no other package can import); keep the two in step. The e2e suite runs
// the same real node, under the same machine-wide lock.

package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

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
	out, err := exec.Command("bash", "../tools/node-packages.sh").CombinedOutput()
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

	dir, err := os.MkdirTemp("", "buildq-node-") //nolint:usetesting // the buildq-node- name is how sweepLeftovers finds a crashed run's mounts and processes
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
