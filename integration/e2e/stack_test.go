//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/nats-io/nats.go"
	"github.com/testcontainers/testcontainers-go"
	"golang.org/x/crypto/bcrypt"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kwait "k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/buildq/buildq/integration/internal/realnode"
	"github.com/buildq/buildq/internal/loopback"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/publisher"
)

// The stack on the Docker host:
//
//   - containers, from images this project builds and loads into the
//     engine pinned by digest (hack/docker/images): NATS with JetStream,
//     MinIO, the distribution registry (htpasswd), and `buildq worker`
//     itself; all with host networking on 127.0.0.1 (the suite's engine
//     runs with --bridge=none, so nothing touches the host's firewall);
//   - Kubernetes: the integration suite's own control plane (envtest's
//     etcd and kube-apiserver, kube-controller-manager) and its real node
//     (containerd, runc, a CNI bridge, kubelet, kube-scheduler;
//     integration/internal/realnode), all built from Go modules by
//     integration/tools/build.sh; the worker
//     container reaches the API server through a kubeconfig;
//   - the real kaniko executor (built from its module, in upstream's image
//     layout) running in the Jobs on that node.
const (
	namespace          = "buildq-e2e"
	s3SecretName       = "buildq-s3"
	registrySecretName = "buildq-registry"
	registryUser       = "buildq"
	s3AccessKey        = "buildq-e2e"
	bucket             = "buildq"
)

// shared is what the real node (integration/internal/realnode, started
// by startRealNode) reads, named as in the integration suite.
var shared struct {
	tools         string // directory of the built binaries (integration/tools/build.sh)
	kube          kubernetes.Interface
	kubeconfig    string
	registryHost  string // the registry container, 127.0.0.1:port
	registryUser  string
	registryPass  string
	minioEndpoint string // the MinIO container, http://127.0.0.1:port
}

// images are the Docker images of the stack, repo@sha256:… each.
type images struct {
	worker, nats, minio, registry string
}

// stackImages reads the images make e2e loaded (hack/docker/images).
func stackImages(t *testing.T) images {
	t.Helper()
	im := images{
		worker:   os.Getenv("BUILDQ_WORKER_IMAGE"),
		nats:     os.Getenv("BUILDQ_NATS_IMAGE"),
		minio:    os.Getenv("BUILDQ_MINIO_IMAGE"),
		registry: os.Getenv("BUILDQ_REGISTRY_IMAGE"),
	}
	for k, v := range map[string]string{"BUILDQ_WORKER_IMAGE": im.worker, "BUILDQ_NATS_IMAGE": im.nats, "BUILDQ_MINIO_IMAGE": im.minio, "BUILDQ_REGISTRY_IMAGE": im.registry} {
		if !strings.Contains(v, "@sha256:") {
			fail(t, "e2e: %s=%q is not an image pinned by digest; make e2e builds and loads the images (hack/docker/images) and sets it", k, v)
		}
	}
	return im
}

// stack is everything the scenarios use.
type stack struct {
	kube  kubernetes.Interface
	store *s3store.Store
	pub   *publisher.Client
	node  *realnode.Node
	reg   *registry.Client
	// registryHost is the registry as the Pods, the worker and the image
	// names see it (the node's bridge gateway, forwarded to the container).
	registryHost string
}

func startStack(t *testing.T, im images) *stack {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	tools, err := exec.Command("bash", "../tools/build.sh").Output()
	if err != nil {
		t.Fatalf("e2e: build the tools (integration/tools/build.sh): %v", err)
	}
	shared.tools = strings.TrimSpace(string(tools))
	startControlPlane(t)

	// The containers, on 127.0.0.1 through host networking.
	shared.registryUser, shared.registryPass = registryUser, randomHex(t, 16)
	s3Secret := randomHex(t, 16)
	shared.registryHost = startRegistry(ctx, t, im.registry)
	shared.minioEndpoint = startMinio(ctx, t, im.minio, s3Secret)
	natsURL := startNATS(ctx, t, im.nats)
	t.Logf("e2e: registry %s, minio %s, nats %s (containers)", shared.registryHost, shared.minioEndpoint, natsURL)

	node := startRealNode(t)
	s := &stack{kube: shared.kube, node: node, registryHost: node.RegistryHost}

	s.store, err = s3store.New(s3store.Config{Endpoint: node.MinioEndpoint, AccessKey: s3AccessKey, SecretKey: s3Secret, Bucket: bucket})
	must(t, "s3 store", err)
	must(t, "create bucket "+bucket, s.store.EnsureBucket(ctx))

	dockerConfig, err := registry.DockerConfigJSON(s.registryHost, registryUser, shared.registryPass)
	must(t, "docker config", err)
	prepareCluster(ctx, t, shared.kube, s3Secret, dockerConfig)
	t.Cleanup(func() {
		if t.Failed() {
			realnode.DumpNamespace(t, shared.kube, namespace)
		}
	})

	// The worker's files, readable by the image's non-root user.
	wdir := t.TempDir()
	must(t, "chmod", os.Chmod(wdir, 0o755))
	put := func(name string, b []byte) string {
		p := filepath.Join(wdir, name)
		must(t, "write "+name, os.WriteFile(p, b, 0o644))
		return p
	}
	kc, err := os.ReadFile(shared.kubeconfig)
	must(t, "read kubeconfig", err)
	put("kubeconfig", kc)
	put("config.json", dockerConfig)
	put("job-template.yaml", []byte(realnode.JobTemplate))
	s.reg, err = registry.New(registry.Options{DockerConfig: filepath.Join(wdir, "config.json"), Insecure: []string{s.registryHost}})
	must(t, "registry client", err)

	startWorker(ctx, t, im.worker, wdir, []string{"worker",
		"--id", "e2e-worker",
		"--nats-url", natsURL,
		"--kubeconfig", "/etc/buildq/kubeconfig",
		"--namespace", namespace,
		"--executor-image", node.Images.Kaniko,
		"--fetch-image", node.Images.Buildq,
		"--job-template", "/etc/buildq/job-template.yaml",
		"--s3-endpoint", node.MinioEndpoint,
		"--s3-credentials-secret", s3SecretName,
		"--s3-access-key", s3AccessKey,
		"--s3-secret-key", s3Secret,
		"--registry-secret", registrySecretName,
		"--registry-config", "/etc/buildq/config.json",
		"--registry", s.registryHost,
		"--insecure-registry", s.registryHost,
		"--single-tenant",
		"--max-in-flight", "4",
		"--log-format", "console",
	})

	pnc, err := nats.Connect(natsURL, nats.Name("buildq-e2e-publisher"))
	must(t, "publisher NATS connection", err)
	t.Cleanup(pnc.Close)
	s.pub, err = publisher.New(pnc)
	must(t, "publisher", err)
	t.Logf("e2e: stack ready; executor %s", node.Images.Kaniko)
	return s
}

// startControlPlane runs envtest's etcd and kube-apiserver from the tools
// directory, an admin kubeconfig, and kube-controller-manager.
func startControlPlane(t *testing.T) {
	t.Helper()
	env := &envtest.Environment{
		BinaryAssetsDirectory:    shared.tools,
		ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	// The real node is known by its InternalIP only.
	env.ControlPlane.GetAPIServer().Configure().Set("kubelet-preferred-address-types", "InternalIP")
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("e2e: start envtest: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	shared.kube, err = kubernetes.NewForConfig(cfg)
	must(t, "kubernetes client", err)
	admin, err := env.AddUser(envtest.User{Name: "buildq-admin", Groups: []string{"system:masters"}}, nil)
	must(t, "admin user", err)
	kc, err := admin.KubeConfig()
	must(t, "admin kubeconfig", err)
	shared.kubeconfig = filepath.Join(t.TempDir(), "kubeconfig")
	must(t, "write kubeconfig", os.WriteFile(shared.kubeconfig, kc, 0o600))

	logPath := filepath.Join(t.TempDir(), "kcm.log")
	logf, err := os.Create(logPath)
	must(t, "kcm log", err)
	cmd := exec.Command(filepath.Join(shared.tools, "kube-controller-manager"),
		"--kubeconfig="+shared.kubeconfig,
		"--controllers=job,ttl-after-finished,garbagecollector,namespace",
		"--leader-elect=false",
		"--use-service-account-credentials=false",
		"--secure-port=0",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	must(t, "start kube-controller-manager", cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("kube-controller-manager log:\n%s", tail(string(b), 3000))
		}
	})
	select {
	case <-exited:
		b, _ := os.ReadFile(logPath)
		t.Fatalf("e2e: kube-controller-manager exited:\n%s", tail(string(b), 3000))
	case <-time.After(2 * time.Second):
	}
}

// run starts a container with host networking and registers its removal.
// files are host paths bind-mounted read-only (host path -> container path).
func run(ctx context.Context, t *testing.T, what, image string, cmd, env []string, binds []string, user string) testcontainers.Container {
	t.Helper()
	envMap := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		envMap[k] = v
	}
	req := testcontainers.ContainerRequest{
		Image: image,
		Cmd:   cmd,
		Env:   envMap,
		User:  user,
		Name:  fmt.Sprintf("buildq-e2e-%s-%s", what, randomHex(t, 4)),
		// The images are in the engine already (make e2e loads them);
		// nothing is pulled.
		AlwaysPullImage: false,
		HostConfigModifier: func(hc *container.HostConfig) {
			hc.NetworkMode = "host"
			hc.Binds = append(hc.Binds, binds...)
		},
	}
	// A provider whose default network is the host's: without it,
	// testcontainers (finding no "bridge" network on an engine started
	// with --bridge=none) would create a bridge network of its own.
	p, err := testcontainers.NewDockerProvider(testcontainers.DefaultNetwork("host")) //nolint:staticcheck // deprecated without a replacement; the only way to keep testcontainers from creating a bridge network here
	must(t, "testcontainers provider", err)
	c, err := p.CreateContainer(ctx, req)
	testcontainers.CleanupContainer(t, c)
	if err != nil {
		t.Fatalf("e2e: create the %s container (%s): %v", what, image, err)
	}
	if err := c.Start(ctx); err != nil {
		t.Fatalf("e2e: start the %s container (%s): %v", what, image, err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		if rc, err := c.Logs(context.Background()); err == nil {
			b, _ := io.ReadAll(rc)
			rc.Close()
			t.Logf("%s container log:\n%s", what, tail(string(b), 4000))
		}
	})
	return c
}

func startRegistry(ctx context.Context, t *testing.T, image string) string {
	t.Helper()
	addr := freeAddr()
	dir := t.TempDir()
	must(t, "chmod", os.Chmod(dir, 0o755))
	hash, err := bcrypt.GenerateFromPassword([]byte(shared.registryPass), bcrypt.MinCost)
	must(t, "bcrypt", err)
	must(t, "htpasswd", os.WriteFile(filepath.Join(dir, "htpasswd"), []byte(registryUser+":"+string(hash)+"\n"), 0o644))
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: /data
  delete:
    enabled: true
http:
  addr: %s
auth:
  htpasswd:
    realm: buildq-e2e
    path: /etc/distribution/htpasswd
`, addr)
	must(t, "registry config", os.WriteFile(filepath.Join(dir, "config.yml"), []byte(cfg), 0o644))
	run(ctx, t, "registry", image, nil, []string{"OTEL_TRACES_EXPORTER=none"},
		[]string{dir + "/config.yml:/etc/distribution/config.yml:ro", dir + "/htpasswd:/etc/distribution/htpasswd:ro"}, "")
	waitFor(t, "the registry", func() error { return httpStatus("http://"+addr+"/v2/", http.StatusUnauthorized) })
	return addr
}

func startMinio(ctx context.Context, t *testing.T, image, secret string) string {
	t.Helper()
	addr, console := freeAddr(), freeAddr()
	run(ctx, t, "minio", image, []string{"server", "--quiet", "--address", addr, "--console-address", console, "/data"},
		[]string{"MINIO_ROOT_USER=" + s3AccessKey, "MINIO_ROOT_PASSWORD=" + secret, "MINIO_BROWSER=off"}, nil, "")
	endpoint := "http://" + addr
	waitFor(t, "MinIO", func() error { return httpStatus(endpoint+"/minio/health/ready", http.StatusOK) })
	return endpoint
}

func startNATS(ctx context.Context, t *testing.T, image string) string {
	t.Helper()
	addr := freeAddr()
	host, port, _ := strings.Cut(addr, ":")
	run(ctx, t, "nats", image, []string{"-js", "-a", host, "-p", port, "-sd", "/data"}, nil, nil, "")
	url := "nats://" + addr
	waitFor(t, "nats-server", func() error {
		nc, err := nats.Connect(url)
		if err != nil {
			return err
		}
		nc.Close()
		return nil
	})
	return url
}

// startWorker runs `buildq worker` from the worker image; dir is mounted at
// /etc/buildq. The scenarios wait for its results; nothing to wait for here.
func startWorker(ctx context.Context, t *testing.T, image, dir string, args []string) {
	t.Helper()
	run(ctx, t, "worker", image, args, nil, []string{dir + ":/etc/buildq:ro"}, "")
}

func httpStatus(url string, want int) error {
	resp, err := http.Get(url) //nolint:gosec,noctx // a startup probe of the test's own server
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != want {
		return fmt.Errorf("%s answered %d, want %d", url, resp.StatusCode, want)
	}
	return nil
}

func waitFor(t *testing.T, what string, probe func() error) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		err := probe()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("e2e: %s not ready after a minute: %v", what, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// prepareCluster creates the builds namespace and the two Secrets the
// Jobs read, and waits for the namespace's default service account.
func prepareCluster(ctx context.Context, t *testing.T, client kubernetes.Interface, s3Secret string, dockerConfig []byte) {
	t.Helper()
	_, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{})
	must(t, "create namespace "+namespace, err)
	_, err = client.CoreV1().Secrets(namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: s3SecretName},
		Type:       corev1.SecretTypeOpaque,
		StringData: map[string]string{"AWS_ACCESS_KEY_ID": s3AccessKey, "AWS_SECRET_ACCESS_KEY": s3Secret},
	}, metav1.CreateOptions{})
	must(t, "create secret "+s3SecretName, err)
	_, err = client.CoreV1().Secrets(namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: registrySecretName},
		Type:       corev1.SecretTypeDockerConfigJson,
		Data:       map[string][]byte{corev1.DockerConfigJsonKey: dockerConfig},
	}, metav1.CreateOptions{})
	must(t, "create secret "+registrySecretName, err)
	// envtest runs no service account controller: make the default one.
	_, err = client.CoreV1().ServiceAccounts(namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		must(t, "create service account "+namespace+"/default", err)
	}
	err = kwait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().ServiceAccounts(namespace).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
	must(t, "wait for service account "+namespace+"/default", err)
}

func freeAddr() string { return loopback.FreeAddr() }

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}

func must(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("e2e: %s: %v", what, err)
	}
}
