//go:build integration

package integration

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// kubeAPIServer is a second kube-apiserver process on the suite's etcd, with
// envtest's own certificates and flags but its own port: a test's worker
// talks to it alone, so the test can kill and restart it while the shared
// one serves the Job controller and the kubelet emulator.
type kubeAPIServer struct {
	t          *testing.T
	path       string
	args       []string
	addr       string
	kubeconfig string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logs *lockedBuffer
}

// envtestAPIServerCmd returns the command line envtest started its
// kube-apiserver with: the child of this test process running that binary
// on envtest's secure port.
func envtestAPIServerCmd() (string, []string, error) {
	port := shared.env.ControlPlane.APIServer.SecureServing.Port
	me := strconv.Itoa(os.Getpid())
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return "", nil, err
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		open, end := bytes.IndexByte(stat, '('), bytes.LastIndexByte(stat, ')')
		if open < 0 || end < open || end+2 > len(stat) {
			continue
		}
		fields := strings.Fields(string(stat[end+2:]))
		if string(stat[open+1:end]) != "kube-apiserver" || len(fields) < 2 || fields[1] != me {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		for _, a := range argv[1:] {
			if a == "--secure-port="+port {
				return argv[0], argv[1:], nil
			}
		}
	}
	return "", nil, fmt.Errorf("no kube-apiserver child of pid %s serves envtest's port %s", me, port)
}

func startPrivateAPIServer(t *testing.T) *kubeAPIServer {
	t.Helper()
	path, args, err := envtestAPIServerCmd()
	if err != nil {
		t.Fatal(err)
	}
	a := &kubeAPIServer{t: t, path: path, addr: freeAddr()}
	_, port, _ := net.SplitHostPort(a.addr)
	for _, arg := range args {
		if strings.HasPrefix(arg, "--secure-port=") {
			arg = "--secure-port=" + port
		}
		a.args = append(a.args, arg)
	}
	// The worker's kubeconfig: the admin user, this server. The serving
	// certificate is for 127.0.0.1, whatever the port.
	kc, err := clientcmd.LoadFromFile(shared.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range kc.Clusters {
		c.Server = "https://" + a.addr
	}
	a.kubeconfig = filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, a.kubeconfig); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a.kill()
		if t.Failed() {
			a.mu.Lock()
			t.Logf("private kube-apiserver log:\n%s", tail(a.logs.String(), 3000))
			a.mu.Unlock()
		}
	})
	a.start()
	return a
}

// start runs the server on its port and waits until it is ready.
func (a *kubeAPIServer) start() {
	a.t.Helper()
	cmd := exec.Command(a.path, a.args...)
	logs := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		a.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	a.mu.Lock()
	a.cmd, a.done, a.logs = cmd, done, logs
	a.mu.Unlock()

	rc, err := clientcmd.BuildConfigFromFlags("", a.kubeconfig)
	if err != nil {
		a.t.Fatal(err)
	}
	rc.Timeout = 2 * time.Second
	started := time.Now()
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		a.t.Fatal(err)
	}
	eventually(a.t, 2*time.Minute, "the private kube-apiserver to be ready", func() bool {
		select {
		case <-done:
			a.t.Fatalf("kube-apiserver exited:\n%s", tail(logs.String(), 3000))
		default:
		}
		_, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		return err == nil
	})
	a.t.Logf("private kube-apiserver (pid %d) on %s ready after %s", cmd.Process.Pid, a.addr, time.Since(started).Round(time.Millisecond))
}

// kill ends the server with SIGKILL and waits for it.
func (a *kubeAPIServer) kill() {
	a.mu.Lock()
	cmd, done := a.cmd, a.done
	a.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
	a.t.Logf("private kube-apiserver (pid %d) killed", cmd.Process.Pid)
}
