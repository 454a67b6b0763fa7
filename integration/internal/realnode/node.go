//go:build integration || e2e

// Package realnode is the real Kubernetes node of the integration suite
// (integration) and the Docker-host suite (integration/e2e): containerd
// (its own root, state, socket and config, never the machine's), runc, a
// CNI bridge of its own, kubelet and kube-scheduler, registered with the
// suite's kube-apiserver.
//
// Pods reach exactly one address of this machine, the bridge's gateway,
// where the node forwards the suite's registry and MinIO; the CNI config
// gives them no default route and kubelet's resolv.conf no nameserver, so
// nothing a build does can leave the machine. The node is tainted: only
// Jobs whose template tolerates the taint (JobTemplate) run there, and the
// kubelet emulator of the other tests never competes with it.
//
// One real node runs per machine at a time, whichever suite starts it:
// Start takes a machine-wide lock.
package realnode

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
	"k8s.io/client-go/kubernetes"
)

// The node's name, its bridge, the bridge's subnet and gateway (the node's
// address, and the one address of this machine its Pods reach), and the
// taint (also a label, "true") that keeps other Pods off it.
const (
	Name    = "buildq-real-node"
	Bridge  = "buildq-node0"
	Subnet  = "10.213.77.0/24"
	Gateway = "10.213.77.1"
	Taint   = "buildq.dev/real-node"
)

// JobTemplate is the worker's --job-template for builds on the node.
const JobTemplate = `nodeSelector: {"buildq.dev/real-node": "true"}
tolerations:
  - {key: "buildq.dev/real-node", operator: Exists, effect: NoSchedule}
`

// Env is what the node needs of the suite that starts it.
type Env struct {
	// PackagesScript is integration/tools/node-packages.sh, relative to
	// the test's working directory.
	PackagesScript string
	// Tools is the directory of the built binaries
	// (integration/tools/build.sh): kubelet, kube-scheduler and
	// kaniko-executor.
	Tools      string
	Kube       kubernetes.Interface
	Kubeconfig string
	// RegistryHost is the suite's registry at its loopback address
	// (127.0.0.1:port), with RegistryUser and RegistryPass its account;
	// MinioEndpoint is the suite's MinIO, http://127.0.0.1:port.
	RegistryHost  string
	RegistryUser  string
	RegistryPass  string
	MinioEndpoint string
	// NATSImage builds and pushes Images.NATS too (nats-server from its Go
	// module); without it Images.NATS is empty.
	NATSImage bool
}

// Node is a running real node.
type Node struct {
	// RegistryHost and MinioEndpoint are the suite's registry and MinIO as
	// the Pods (and the node tests' workers) address them.
	RegistryHost  string
	MinioEndpoint string
	Images        Images

	t   *testing.T
	env Env
	dir string

	containerdSock string
	procs          []*proc
	cleanups       []func()
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	log  string
}

// kernelTunables are the sysctls kubelet sets at start when
// protectKernelDefaults is off; the harness restores their values after.
var kernelTunables = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"}

// Start brings the node up and registers its teardown with t: everything
// it started stops and everything it made is removed, also after a failed
// test.
func Start(t *testing.T, env Env) *Node {
	t.Helper()
	out, err := exec.Command("bash", env.PackagesScript).CombinedOutput()
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
	n := &Node{t: t, env: env, dir: dir}
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
	_ = exec.Command("ip", "link", "del", Bridge).Run() // a crashed run's
	for _, args := range [][]string{
		{"link", "add", Bridge, "type", "bridge"},
		{"addr", "add", Gateway + "/24", "dev", Bridge},
		{"link", "set", Bridge, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	n.cleanups = append(n.cleanups, func() { _ = exec.Command("ip", "link", "del", Bridge).Run() })

	n.RegistryHost = n.Forward(env.RegistryHost)
	n.MinioEndpoint = "http://" + n.Forward(strings.TrimPrefix(env.MinioEndpoint, "http://"))

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n.Images, err = pushImages(ctx, env, n.RegistryHost)
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

// Forward listens on the bridge's gateway and forwards each connection to
// target on 127.0.0.1; it returns the gateway address. The listener and
// its connections close with the node.
func (n *Node) Forward(target string) string {
	l, err := net.Listen("tcp", Gateway+":0")
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

func (n *Node) path(p ...string) string { return filepath.Join(append([]string{n.dir}, p...)...) }

func (n *Node) write(rel, content string) string {
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
func (n *Node) start(name string, bin string, args ...string) *proc {
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
	p := &proc{name: name, cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() { _ = cmd.Wait(); logf.Close(); close(p.done) }()
	n.procs = append(n.procs, p)
	return p
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// tail is the last 3000 bytes of the process's log.
func (p *proc) tail() string {
	b, _ := os.ReadFile(p.log)
	const n = 3000
	if len(b) <= n {
		return string(b)
	}
	return "…" + string(b[len(b)-n:])
}

// stopProc ends a node process: SIGTERM, then SIGKILL after grace.
func stopProc(p *proc, grace time.Duration) {
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

// DumpNamespace logs the Jobs, Pods and Events of ns (when a node test
// fails, this is what says why).
func DumpNamespace(t *testing.T, kube kubernetes.Interface, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var b strings.Builder
	if jobs, err := kube.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, j := range jobs.Items {
			fmt.Fprintf(&b, "job %s: active=%d succeeded=%d failed=%d conditions=%v\n", j.Name, j.Status.Active, j.Status.Succeeded, j.Status.Failed, j.Status.Conditions)
		}
	}
	if pods, err := kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, p := range pods.Items {
			fmt.Fprintf(&b, "pod %s: node=%q phase=%s conditions=%v\n", p.Name, p.Spec.NodeName, p.Status.Phase, p.Status.Conditions)
			for _, c := range p.Status.ContainerStatuses {
				fmt.Fprintf(&b, "  container %s: %+v\n", c.Name, c.State)
			}
		}
	}
	if evs, err := kube.CoreV1().Events(ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, e := range evs.Items {
			fmt.Fprintf(&b, "event %s %s: %s %s\n", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
	t.Logf("namespace %s:\n%s", ns, b.String())
}
