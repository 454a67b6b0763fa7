//go:build integration || e2e

package realnode

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// stop tears the node down in the order that leaves nothing behind: the
// scheduler; the Pods (deleted, so kubelet stops their containers and
// CNI releases their addresses and network namespaces); kubelet; any
// container still running; containerd and its shims; the mounts under the
// node's directory; the bridge; the directory.
func (n *Node) stop() {
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
	_ = n.env.Kube.CoreV1().Nodes().Delete(ctx, Name, metav1.DeleteOptions{})
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
func (n *Node) drain(ctx context.Context) error {
	pods := n.env.Kube.CoreV1().Pods("")
	sel := metav1.ListOptions{FieldSelector: "spec.nodeName=" + Name}
	list, err := pods.List(ctx, sel)
	if err != nil {
		return err
	}
	for _, p := range list.Items {
		_ = n.env.Kube.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
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
func (n *Node) killContainers() {
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
func (n *Node) killShims() {
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
func (n *Node) unmountAll() {
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
func (n *Node) removeLogLinks() { removeLogLinksTo(n.dir) }

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
		n := &Node{t: t, dir: dir}
		n.killShims() // and every other process started from that directory
		n.unmountAll()
		removeLogLinksTo(dir)
		if err := os.RemoveAll(dir); err != nil {
			t.Logf("real node: remove %s: %v", dir, err)
		}
	}
	removeCNICache()
	_ = exec.Command("ip", "link", "del", Bridge).Run()
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
