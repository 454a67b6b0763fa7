//go:build integration

package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"golang.org/x/crypto/bcrypt"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/buildq/buildq/internal/loopback"
	"github.com/buildq/buildq/internal/registry"
)

// The shared real components: one control plane (etcd, kube-apiserver,
// kube-controller-manager), one MinIO and one registry with htpasswd auth
// for the whole package. Each test gets its own namespace, NATS server,
// kubelet emulator and workers, so tests do not see each other's work.
var shared struct {
	tools      string // directory of the built binaries
	bin        string // directory of buildq and nats-server built for the suite
	env        *envtest.Environment
	restConfig *rest.Config
	kube       kubernetes.Interface
	kubeconfig string
	kcm        *exec.Cmd

	minioEndpoint string // http://127.0.0.1:port
	minioUser     string
	minioPassword string
	bucket        string

	registryHost string // 127.0.0.1:port, plain HTTP, htpasswd auth
	registryUser string
	registryPass string
	// acmeUser and acmePass are tenant acme's own registry account
	// (--tenant-registry-secret).
	acmeUser     string
	acmePass     string
	dockerConfig []byte // a docker config.json with the right credentials
}

// subprocessMains are programs a test runs in a process of its own, this
// test binary run again with the program's environment variable set
// (bench_bare_p1_test.go).
var subprocessMains = map[string]func() int{}

func TestMain(m *testing.M) {
	for env, run := range subprocessMains {
		if os.Getenv(env) != "" {
			os.Exit(run())
		}
	}
	code, err := runSuite(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		code = 1
	}
	os.Exit(code)
}

func runSuite(m *testing.M) (int, error) {
	ctx := context.Background()
	tmp, err := os.MkdirTemp("", "buildq-integration-")
	if err != nil {
		return 1, err
	}
	defer os.RemoveAll(tmp)

	// The real components, built from Go modules and cached outside the
	// clone (tools/build.sh builds only what is missing).
	out, err := exec.Command("bash", "tools/build.sh").Output()
	if err != nil {
		return 1, fmt.Errorf("build the tools: %w", err)
	}
	shared.tools = strings.TrimSpace(string(out))
	shared.bin = filepath.Join(tmp, "bin")
	for _, b := range [][2]string{{"buildq", "github.com/buildq/buildq/cmd/buildq"}, {"nats-server", "github.com/nats-io/nats-server/v2"}} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(shared.bin, b[0]), b[1])
		cmd.Stderr = os.Stderr
		if err := cmd.Run(); err != nil {
			return 1, fmt.Errorf("build %s: %w", b[0], err)
		}
	}

	// Control plane.
	shared.env = &envtest.Environment{
		BinaryAssetsDirectory:    shared.tools,
		ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	// The real node (node_test.go) is known by its InternalIP only: its
	// host name resolves nowhere, and pods/log goes through the kubelet.
	shared.env.ControlPlane.GetAPIServer().Configure().Set("kubelet-preferred-address-types", "InternalIP")
	shared.restConfig, err = shared.env.Start()
	if err != nil {
		return 1, fmt.Errorf("start envtest: %w", err)
	}
	defer func() { _ = shared.env.Stop() }()
	shared.kube, err = kubernetes.NewForConfig(shared.restConfig)
	if err != nil {
		return 1, err
	}
	admin, err := shared.env.AddUser(envtest.User{Name: "buildq-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return 1, err
	}
	kc, err := admin.KubeConfig()
	if err != nil {
		return 1, err
	}
	shared.kubeconfig = filepath.Join(tmp, "kubeconfig")
	if err := os.WriteFile(shared.kubeconfig, kc, 0o600); err != nil {
		return 1, err
	}
	stopKCM, err := startKCM(filepath.Join(tmp, "kcm.log"))
	if err != nil {
		return 1, err
	}
	defer stopKCM()

	stopMinio, err := startMinio(ctx, filepath.Join(tmp, "minio"))
	if err != nil {
		return 1, err
	}
	defer stopMinio()

	stopRegistry, err := startRegistry(filepath.Join(tmp, "registry"))
	if err != nil {
		return 1, err
	}
	defer stopRegistry()

	return m.Run(), nil
}

// startKCM runs kube-controller-manager with the controllers a Job's life
// needs: the Job controller, TTL-after-finished, and the garbage collector
// (which carries out foreground deletion of a Job's Pods); and for the
// worker Deployment of deploy/ (workerpod_test.go): the Deployment and
// ReplicaSet controllers, and the namespace controller that empties a
// deleted namespace.
func startKCM(logPath string) (func(), error) {
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(shared.tools, "kube-controller-manager"),
		"--kubeconfig="+shared.kubeconfig,
		"--controllers=job,ttl-after-finished,garbagecollector,deployment,replicaset,statefulset,namespace",
		"--leader-elect=false",
		"--use-service-account-credentials=false",
		"--secure-port=0",
		"--concurrent-job-syncs=10",
		// Above the default 20/s: the benchmarks (make bench-e2e) run
		// a thousand Jobs, and the Job controller must not be what they
		// measure.
		"--kube-api-qps=200",
		"--kube-api-burst=400",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start kube-controller-manager: %w", err)
	}
	shared.kcm = cmd
	var waitErr error // set before exited is closed
	exited := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(exited) }()
	select {
	case <-exited:
		b, _ := os.ReadFile(logPath)
		if waitErr == nil {
			waitErr = errors.New("exit status 0")
		}
		return nil, fmt.Errorf("kube-controller-manager exited: %w\n%s", waitErr, tail(string(b), 3000))
	case <-time.After(3 * time.Second):
	}
	return func() {
		_ = cmd.Process.Kill()
		<-exited
		logf.Close()
	}, nil
}

func startMinio(ctx context.Context, dir string) (func(), error) {
	addr, console := freeAddr(), freeAddr()
	shared.minioUser, shared.minioPassword, shared.bucket = "buildq-it", "buildq-it-secret-value", "buildq"
	cmd := exec.Command(filepath.Join(shared.tools, "minio"), "server", "--quiet", "--address", addr, "--console-address", console, dir)
	cmd.Env = append(os.Environ(), "MINIO_ROOT_USER="+shared.minioUser, "MINIO_ROOT_PASSWORD="+shared.minioPassword,
		"MINIO_BROWSER=off", "MINIO_UPDATE=off")
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start minio: %w", err)
	}
	stop := func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	shared.minioEndpoint = "http://" + addr
	if err := waitHTTP(shared.minioEndpoint+"/minio/health/ready", 200, time.Minute); err != nil {
		stop()
		return nil, fmt.Errorf("minio: %w\n%s", err, tail(logs.String(), 2000))
	}
	mc, err := minio.New(addr, &minio.Options{Creds: credentials.NewStaticV4(shared.minioUser, shared.minioPassword, "")})
	if err != nil {
		stop()
		return nil, err
	}
	if err := mc.MakeBucket(ctx, shared.bucket, minio.MakeBucketOptions{}); err != nil {
		stop()
		return nil, fmt.Errorf("minio bucket: %w", err)
	}
	return stop, nil
}

func startRegistry(dir string) (func(), error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	shared.registryUser, shared.registryPass = "pusher", "registry-password-value"
	hash, err := bcrypt.GenerateFromPassword([]byte(shared.registryPass), bcrypt.MinCost)
	if err != nil {
		return nil, err
	}
	htpasswd := filepath.Join(dir, "htpasswd")
	shared.acmeUser, shared.acmePass = "acme-pusher", "acme-password-value"
	acmeHash, err := bcrypt.GenerateFromPassword([]byte(shared.acmePass), bcrypt.MinCost)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(htpasswd, []byte(shared.registryUser+":"+string(hash)+"\n"+shared.acmeUser+":"+string(acmeHash)+"\n"), 0o600); err != nil {
		return nil, err
	}
	addr := freeAddr()
	config := fmt.Sprintf(`version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
http:
  addr: %s
auth:
  htpasswd:
    realm: buildq-it
    path: %s
`, filepath.Join(dir, "data"), addr, htpasswd)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(shared.tools, "registry"), "serve", cfgPath)
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start registry: %w", err)
	}
	stop := func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	shared.registryHost = addr
	if err := waitHTTP("http://"+addr+"/v2/", http.StatusUnauthorized, time.Minute); err != nil {
		stop()
		return nil, fmt.Errorf("registry: %w\n%s", err, tail(logs.String(), 2000))
	}
	shared.dockerConfig, err = registry.DockerConfigJSON(addr, shared.registryUser, shared.registryPass)
	if err != nil {
		stop()
		return nil, err
	}
	return stop, nil
}

func freeAddr() string { return loopback.FreeAddr() }

// waitHTTP polls url until it answers with status (startup only).
func waitHTTP(url string, status int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == status {
				return nil
			}
			last = fmt.Errorf("%s answered %d", url, resp.StatusCode)
		} else {
			last = err
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("not ready after %s: %w", timeout, last)
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}
