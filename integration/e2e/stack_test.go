//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/k3s"
	tcminio "github.com/testcontainers/testcontainers-go/modules/minio"
	tcnats "github.com/testcontainers/testcontainers-go/modules/nats"
	tcregistry "github.com/testcontainers/testcontainers-go/modules/registry"
	"github.com/testcontainers/testcontainers-go/network"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/crypto/bcrypt"
	"golang.org/x/sync/errgroup"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kwait "k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/buildq/buildq/internal/kaniko"
	"github.com/buildq/buildq/internal/kube"
	"github.com/buildq/buildq/internal/naming"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/publisher"
	"github.com/buildq/buildq/worker"
)

// Images of the stack; each can be replaced through its environment
// variable (a mirror, a newer release).
const (
	defaultK3sImage      = "rancher/k3s:v1.33.5-k3s1"                 // BUILDQ_E2E_K3S_IMAGE
	defaultMinioImage    = "minio/minio:RELEASE.2024-01-16T16-07-38Z" // BUILDQ_E2E_MINIO_IMAGE
	defaultRegistryImage = "registry:2.8.3"                           // BUILDQ_E2E_REGISTRY_IMAGE
	defaultNATSImage     = "nats:2.11.7"                              // BUILDQ_E2E_NATS_IMAGE
)

// Names shared by the containers, the cluster and the worker.
const (
	namespace          = "builds"
	bucket             = "buildq"
	s3SecretName       = "buildq-s3"
	registrySecretName = "buildq-registry"
	s3AccessKey        = "buildq-e2e"
	registryUser       = "buildq"

	// Network aliases on the stack's Docker network. The k3s node (its
	// containerd) resolves them through Docker's DNS; pods resolve them
	// through CoreDNS, which the stack teaches them (see teachCoreDNS).
	minioAlias    = "buildq-minio"
	registryAlias = "buildq-registry"
	natsAlias     = "buildq-nats"
	k3sAlias      = "buildq-k3s"

	// registryInCluster is the registry as kaniko, the k3s node and the
	// image names see it; the host reaches it through aliasTransport.
	registryInCluster = registryAlias + ":5000"
	// s3InCluster is MinIO as kaniko sees it.
	s3InCluster = "http://" + minioAlias + ":9000"
)

// stack is everything the scenarios use: the cluster, the context store,
// the publisher, and the registry as seen from the host.
type stack struct {
	kube  kubernetes.Interface
	store *s3store.Store
	pub   *publisher.Client
	// registryHost is host:port of the registry's published port.
	registryHost string
	registryPass string
}

// startStack starts MinIO, the registry, NATS and k3s on one Docker
// network, prepares the cluster (namespace, Secrets, DNS) and runs a worker
// in process, the way `buildq worker` wires one. Everything is torn down
// by t's cleanups.
func startStack(t *testing.T, executor string) *stack {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	s := &stack{registryPass: randomHex(t, 16)}
	s3Secret := randomHex(t, 16)

	nw, err := network.New(ctx)
	testcontainers.CleanupNetwork(t, nw)
	if err != nil {
		t.Fatalf("e2e: create the Docker network: %v", err)
	}

	hash, err := bcrypt.GenerateFromPassword([]byte(s.registryPass), bcrypt.DefaultCost)
	if err != nil {
		t.Fatal(err)
	}
	htpasswd := writeFile(t, "htpasswd", []byte(registryUser+":"+string(hash)+"\n"))
	// The k3s node pulls built images (the run check) from the plain-HTTP
	// registry: containerd must be told so, and given the credentials.
	registriesYAML := fmt.Sprintf(`mirrors:
  %[1]q:
    endpoint:
      - "http://%[1]s"
configs:
  %[1]q:
    auth:
      username: %[2]q
      password: %[3]q
`, registryInCluster, registryUser, s.registryPass)

	var (
		mc  *tcminio.MinioContainer
		rc  *tcregistry.RegistryContainer
		ncc *tcnats.NATSContainer
		kc  *k3s.K3sContainer
	)
	t.Logf("e2e: starting k3s, MinIO, the registry and NATS on Docker network %s", nw.Name)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		c, err := tcminio.Run(gctx, envOr("BUILDQ_E2E_MINIO_IMAGE", defaultMinioImage),
			tcminio.WithUsername(s3AccessKey), tcminio.WithPassword(s3Secret),
			network.WithNetwork([]string{minioAlias}, nw))
		testcontainers.CleanupContainer(t, c)
		mc = c
		return labelErr("minio", err)
	})
	g.Go(func() error {
		c, err := tcregistry.Run(gctx, envOr("BUILDQ_E2E_REGISTRY_IMAGE", defaultRegistryImage),
			tcregistry.WithHtpasswdFile(htpasswd),
			network.WithNetwork([]string{registryAlias}, nw))
		testcontainers.CleanupContainer(t, c)
		rc = c
		return labelErr("registry", err)
	})
	g.Go(func() error {
		c, err := tcnats.Run(gctx, envOr("BUILDQ_E2E_NATS_IMAGE", defaultNATSImage),
			network.WithNetwork([]string{natsAlias}, nw))
		testcontainers.CleanupContainer(t, c)
		ncc = c
		return labelErr("nats", err)
	})
	g.Go(func() error {
		c, err := k3s.Run(gctx, envOr("BUILDQ_E2E_K3S_IMAGE", defaultK3sImage),
			network.WithNetwork([]string{k3sAlias}, nw),
			testcontainers.WithFiles(testcontainers.ContainerFile{
				Reader:            strings.NewReader(registriesYAML),
				ContainerFilePath: "/etc/rancher/k3s/registries.yaml",
				FileMode:          0o600,
			}))
		testcontainers.CleanupContainer(t, c)
		kc = c
		return labelErr("k3s", err)
	})
	if err := g.Wait(); err != nil {
		t.Fatalf("e2e: start the stack: %v", err)
	}

	// Addresses: published ports for the host, network IPs for CoreDNS.
	minioHost, err := mc.ConnectionString(ctx)
	must(t, "minio address", err)
	s.registryHost, err = rc.HostAddress(ctx)
	must(t, "registry address", err)
	natsURL, err := ncc.ConnectionString(ctx)
	must(t, "nats address", err)
	minioIP, err := networkIP(ctx, mc, nw.Name)
	must(t, "minio network IP", err)
	registryIP, err := networkIP(ctx, rc, nw.Name)
	must(t, "registry network IP", err)
	kubeconfig, err := kc.GetKubeConfig(ctx)
	must(t, "k3s kubeconfig", err)
	t.Logf("e2e: minio %s (%s), registry %s (%s), nats %s", minioHost, minioIP, s.registryHost, registryIP, natsURL)

	// The context store, from the host.
	s.store, err = s3store.New(s3store.Config{Endpoint: "http://" + minioHost, AccessKey: s3AccessKey, SecretKey: s3Secret, Bucket: bucket})
	must(t, "s3 store", err)
	must(t, "create bucket "+bucket, s.store.EnsureBucket(ctx))

	// The cluster.
	rcfg, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	must(t, "k3s rest config", err)
	rcfg.UserAgent = "buildq-worker"
	client, err := kubernetes.NewForConfig(rcfg)
	must(t, "kubernetes client", err)
	s.kube = client
	dockerConfig, err := registry.DockerConfigJSON(registryInCluster, registryUser, s.registryPass)
	must(t, "docker config", err)
	prepareCluster(ctx, t, client, s3Secret, dockerConfig)
	teachCoreDNS(ctx, t, client, map[string]string{minioAlias: minioIP, registryAlias: registryIP})
	t.Cleanup(func() {
		if t.Failed() {
			s.dumpDiagnostics(t)
		}
	})

	// The worker, wired as cmd/buildq's runWorker and kubeBackend do.
	reg, err := registry.New(registry.Options{
		DockerConfig: writeFile(t, "config.json", dockerConfig),
		Insecure:     []string{registryInCluster},
		Transport:    aliasTransport(map[string]string{registryInCluster: s.registryHost}),
		UserAgent:    "buildq-e2e",
	})
	must(t, "registry client", err)
	kcfg := kaniko.Config{
		Namespace:          namespace,
		ExecutorImage:      executor,
		S3Endpoint:         s3InCluster,
		S3Secret:           s3SecretName,
		RegistrySecret:     registrySecretName,
		InsecureRegistries: []string{registryInCluster},
		DefaultTimeout:     15 * time.Minute,
	}
	factory := kube.NewInformerFactory(client, namespace)
	watcher, err := kube.NewWatcher(factory, nil)
	must(t, "watcher", err)
	backend, err := worker.NewKubeBackend(client, watcher, kcfg)
	must(t, "kube backend", err)
	stopInformers := make(chan struct{})
	factory.Start(stopInformers)
	t.Cleanup(func() { close(stopInformers); factory.Shutdown() })
	if !watcher.WaitForSync(ctx) {
		t.Fatalf("e2e: the Job and Pod informers of namespace %s did not sync", namespace)
	}
	backend.WithDigestResolver(reg.Head)

	wnc, err := nats.Connect(natsURL, nats.Name("buildq-e2e-worker"), nats.MaxReconnects(-1))
	must(t, "worker NATS connection", err)
	t.Cleanup(wnc.Close)
	w, err := worker.New(wnc, backend, worker.Config{
		ID:              "e2e-worker",
		MaxInFlight:     4,
		Naming:          naming.Policy{Registry: registryInCluster, Mode: naming.ModeProject},
		Registry:        reg,
		Logger:          newLogger(),
		ShutdownTimeout: 10 * time.Second,
	})
	must(t, "worker", err)
	// Streams first, so that publishing cannot race the worker's start.
	must(t, "worker setup", w.Setup(ctx))
	runCtx, stopWorker := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	t.Cleanup(func() {
		stopWorker()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("e2e: worker: %v", err)
			}
		case <-time.After(time.Minute):
			t.Errorf("e2e: the worker did not stop within a minute")
		}
	})

	pnc, err := nats.Connect(natsURL, nats.Name("buildq-e2e-publisher"))
	must(t, "publisher NATS connection", err)
	t.Cleanup(pnc.Close)
	s.pub, err = publisher.New(pnc)
	must(t, "publisher", err)
	t.Logf("e2e: stack ready; executor %s", executor)
	return s
}

// prepareCluster creates the builds namespace and the two Secrets the
// Jobs read, and waits for the namespace's default service account (pods
// are refused until it exists).
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
	err = kwait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := client.CoreV1().ServiceAccounts(namespace).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
	must(t, "wait for service account "+namespace+"/default", err)
}

// corednsCustom is the ConfigMap k3s's CoreDNS imports *.server and
// *.override files from.
const corednsCustom = "coredns-custom"

// teachCoreDNS makes pods resolve the Docker network aliases. Pods cannot
// use Docker's embedded DNS (127.0.0.11 exists only in the node's network
// namespace, so k3s points CoreDNS elsewhere), so CoreDNS gets a server
// block answering the aliases with the containers' network IPs, and is
// restarted to load it at once.
func teachCoreDNS(ctx context.Context, t *testing.T, client kubernetes.Interface, hosts map[string]string) {
	t.Helper()
	deployments := client.AppsV1().Deployments("kube-system")
	var dep *appsv1.Deployment
	err := kwait.PollUntilContextTimeout(ctx, 2*time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		d, err := deployments.Get(ctx, "coredns", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // a failed Get is polled again until the timeout
		}
		dep = d
		return true, nil
	})
	must(t, "wait for deployment kube-system/coredns", err)
	mounted := false
	for _, v := range dep.Spec.Template.Spec.Volumes {
		if v.ConfigMap != nil && v.ConfigMap.Name == corednsCustom {
			mounted = true
		}
	}
	if !mounted {
		t.Fatalf("e2e: this k3s's CoreDNS does not mount ConfigMap kube-system/%s, so pods could not resolve the stack's aliases: use a newer k3s (BUILDQ_E2E_K3S_IMAGE)", corednsCustom)
	}

	names := make([]string, 0, len(hosts))
	for n := range hosts {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for i, n := range names {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(n + ":53")
	}
	b.WriteString(" {\n    errors\n    hosts {\n")
	for _, n := range names {
		fmt.Fprintf(&b, "        %s %s\n", hosts[n], n)
	}
	b.WriteString("    }\n}\n")

	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: corednsCustom, Namespace: "kube-system"},
		Data:       map[string]string{"buildq-e2e.server": b.String()},
	}
	_, err = client.CoreV1().ConfigMaps("kube-system").Create(ctx, cm, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		cur, gerr := client.CoreV1().ConfigMaps("kube-system").Get(ctx, corednsCustom, metav1.GetOptions{})
		must(t, "get configmap "+corednsCustom, gerr)
		if cur.Data == nil {
			cur.Data = map[string]string{}
		}
		cur.Data["buildq-e2e.server"] = b.String()
		_, err = client.CoreV1().ConfigMaps("kube-system").Update(ctx, cur, metav1.UpdateOptions{})
	}
	must(t, "write configmap kube-system/"+corednsCustom, err)

	// kubectl rollout restart, then wait for the rollout.
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"buildq.dev/e2e-restarted-at":%q}}}}}`, time.Now().UTC().Format(time.RFC3339Nano))
	_, err = deployments.Patch(ctx, "coredns", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{})
	must(t, "restart deployment kube-system/coredns", err)
	err = kwait.PollUntilContextTimeout(ctx, 2*time.Second, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		d, err := deployments.Get(ctx, "coredns", metav1.GetOptions{})
		if err != nil {
			return false, nil //nolint:nilerr // a failed Get is polled again until the timeout
		}
		want := int32(1)
		if d.Spec.Replicas != nil {
			want = *d.Spec.Replicas
		}
		st := d.Status
		return st.ObservedGeneration >= d.Generation && st.UpdatedReplicas == want &&
			st.Replicas == want && st.AvailableReplicas == want, nil
	})
	must(t, "wait for the CoreDNS rollout", err)
	t.Logf("e2e: CoreDNS answers %s", strings.Join(names, ", "))
}

// networkIP returns the container's address on the named Docker network.
func networkIP(ctx context.Context, c testcontainers.Container, networkName string) (string, error) {
	info, err := c.Inspect(ctx)
	if err != nil {
		return "", err
	}
	if info.NetworkSettings != nil {
		if ep, ok := info.NetworkSettings.Networks[networkName]; ok && ep != nil && ep.IPAddress != "" {
			return ep.IPAddress, nil
		}
	}
	return "", fmt.Errorf("container %s has no address on network %s", c.GetContainerID(), networkName)
}

// dumpDiagnostics logs what the cluster knows after a failure: the pods of
// the builds namespace and of kube-system, and the recent events.
func (s *stack) dumpDiagnostics(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, ns := range []string{namespace, "kube-system"} {
		pods, err := s.kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Logf("diagnostics: list pods in %s: %v", ns, err)
			continue
		}
		for _, p := range pods.Items {
			t.Logf("diagnostics: pod %s/%s phase=%s %s", ns, p.Name, p.Status.Phase, p.Status.Message)
			for _, cs := range p.Status.ContainerStatuses {
				switch {
				case cs.State.Waiting != nil:
					t.Logf("diagnostics:   %s waiting: %s %s", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
				case cs.State.Terminated != nil:
					t.Logf("diagnostics:   %s terminated: exit %d %s %s", cs.Name, cs.State.Terminated.ExitCode, cs.State.Terminated.Reason, oneLine(cs.State.Terminated.Message))
				}
			}
		}
		events, err := s.kube.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Logf("diagnostics: list events in %s: %v", ns, err)
			continue
		}
		for _, e := range events.Items {
			if ns == namespace || e.Type != corev1.EventTypeNormal {
				t.Logf("diagnostics: event %s %s/%s %s: %s", e.Type, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
			}
		}
	}
}

// newLogger logs the worker to stderr, readable next to go test -v.
func newLogger() *zap.Logger {
	enc := zap.NewDevelopmentEncoderConfig()
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(os.Stderr), zap.InfoLevel)
	return zap.New(core).Named("worker")
}

func labelErr(what string, err error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

func must(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("e2e: %s: %v", what, err)
	}
}
