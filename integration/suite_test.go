//go:build integration

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/registry"
	"github.com/buildq/buildq/internal/s3store"
	"github.com/buildq/buildq/publisher"
)

// executorImage is what the Jobs name; the emulated kubelet does not pull
// it, but the worker requires a digest-pinned reference.
const executorImage = "ghcr.io/buildq/kaniko-emulated@sha256:0000000000000000000000000000000000000000000000000000000000000001"

// suite is one test's slice of the environment.
type suite struct {
	t        *testing.T
	ns       string
	natsDir  string
	natsAddr string
	// natsURL is what the workers and the test's connection dial: the
	// single server's, or every node's of a cluster (comma-separated).
	natsURL    string
	cluster    *natsCluster
	nats       *exec.Cmd
	natsMu     sync.Mutex
	nc         *nats.Conn
	pub        *publisher.Client
	store      *s3store.Store
	regClient  *registry.Client
	dockerCfg  string
	kubelet    *kubelet
	workerArgs []string
	// kubeconfig of the workers (default: the shared admin one).
	kubeconfig string
	// natsConfig, natsEnv and natsOptions: see options.
	natsConfig  string
	natsEnv     []string
	natsOptions []nats.Option
	// registryHost, minioEndpoint and executorImage are what the workers
	// and the Jobs use: the shared ones, or the real node's view of them.
	registryHost  string
	minioEndpoint string
	executorImage string
	// node, when set, runs the Jobs (no kubelet emulator).
	node *realNode
	// natsLog is the single nats-server's output.
	natsLog *lockedBuffer
	// republishOK lets a request's result be published more than once,
	// as long as every publish carries the same decision (the stream
	// stores one): a worker whose PubAck, ack or ledger write is lost in a
	// cluster failover publishes the same result again.
	republishOK bool
	// watchMayLag: in a cluster whose nodes are killed, publisher.Watch's
	// ordered consumer (one replica, on one server) can take longer than
	// the check allows to come back; these tests assert on the results
	// stream itself instead (answeredOnce).
	watchMayLag bool
}

type options struct {
	// registryPassword for the Secret the Jobs mount (default: the right one).
	registryPassword string
	// tenantCreds gives tenant acme its own registry account: the Jobs
	// mount Secret buildq-registry-acme (--tenant-registry-secret), the
	// worker's checks and copies for acme use it, and the shared Secret
	// buildq-registry holds a wrong password, so any use of it fails.
	tenantCreds bool
	faults      func(*corev1.Pod) fault
	workerArgs  []string
	// clusterNodes, when set, runs a JetStream cluster of that many
	// nats-server processes instead of the single server (cluster_test.go).
	clusterNodes int
	// natsConfig, when set, is a configuration file the single nats-server
	// runs with (-c; the address and store flags still apply), natsEnv
	// its extra environment, and natsOptions how the test's own
	// connection authenticates (natsauth_test.go).
	natsConfig  string
	natsEnv     []string
	natsOptions []nats.Option
	// node runs the test's Jobs on the real node (node_test.go) instead
	// of the kubelet emulator: the workers get the node's registry and
	// MinIO addresses, the real kaniko image and a job template that
	// tolerates the node's taint.
	node *realNode
}

var nsSeq struct {
	sync.Mutex
	n int
}

func newSuite(t *testing.T, o options) *suite {
	t.Helper()
	ctx := context.Background()
	nsSeq.Lock()
	nsSeq.n++
	ns := fmt.Sprintf("it-%d-%s", nsSeq.n, strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return '-'
	}, strings.ToLower(t.Name())))
	nsSeq.Unlock()
	if len(ns) > 63 {
		ns = ns[:63]
	}
	ns = strings.TrimRight(ns, "-")
	s := &suite{t: t, ns: ns, kubeconfig: shared.kubeconfig, natsConfig: o.natsConfig, natsEnv: o.natsEnv, natsOptions: o.natsOptions,
		registryHost: shared.registryHost, minioEndpoint: shared.minioEndpoint, executorImage: executorImage, node: o.node}
	if o.node != nil {
		s.registryHost, s.minioEndpoint, s.executorImage = o.node.registryHost, o.node.minioEndpoint, o.node.images.kaniko
		o.tenantCreds = true // the production shape
	}
	if _, err := shared.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The Secrets the worker references: S3 keys and a .dockerconfigjson.
	pass := shared.registryPass
	if o.registryPassword != "" {
		pass = o.registryPassword
	}
	jobDockerCfg, err := registry.DockerConfigJSON(s.registryHost, shared.registryUser, pass)
	if err != nil {
		t.Fatal(err)
	}
	secrets := []*corev1.Secret{
		{ObjectMeta: metav1.ObjectMeta{Name: "buildq-s3", Namespace: ns}, Type: corev1.SecretTypeOpaque,
			Data: map[string][]byte{"AWS_ACCESS_KEY_ID": []byte(shared.minioUser), "AWS_SECRET_ACCESS_KEY": []byte(shared.minioPassword)}},
	}
	if o.tenantCreds {
		acmeJob, err := registry.DockerConfigJSON(s.registryHost, shared.acmeUser, map[bool]string{true: o.registryPassword, false: shared.acmePass}[o.registryPassword != ""])
		if err != nil {
			t.Fatal(err)
		}
		acmeWorker, err := registry.DockerConfigJSON(s.registryHost, shared.acmeUser, shared.acmePass)
		if err != nil {
			t.Fatal(err)
		}
		wrong, err := registry.DockerConfigJSON(s.registryHost, shared.registryUser, "the-shared-secret-must-not-be-used")
		if err != nil {
			t.Fatal(err)
		}
		jobDockerCfg = wrong
		secrets = append(secrets, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry-acme", Namespace: ns}, Type: corev1.SecretTypeDockerConfigJson,
			Data: map[string][]byte{corev1.DockerConfigJsonKey: acmeJob}})
		dir := t.TempDir()
		if err := os.MkdirAll(filepath.Join(dir, "acme"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "acme", "config.json"), acmeWorker, 0o600); err != nil {
			t.Fatal(err)
		}
		o.workerArgs = append([]string{"--tenant-registry-secret", "buildq-registry-{tenant}", "--tenant-registry-configs", dir}, o.workerArgs...)
	}
	secrets = append(secrets, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "buildq-registry", Namespace: ns}, Type: corev1.SecretTypeDockerConfigJson,
		Data: map[string][]byte{corev1.DockerConfigJsonKey: jobDockerCfg}})
	for _, sec := range secrets {
		if _, err := shared.kube.CoreV1().Secrets(ns).Create(ctx, sec, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The worker's own registry credentials: the right ones, as mounted
	// from the same Secret in a healthy deployment.
	s.dockerCfg = filepath.Join(t.TempDir(), "config.json")
	workerDockerCfg, err := registry.DockerConfigJSON(s.registryHost, shared.registryUser, shared.registryPass)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(s.dockerCfg, workerDockerCfg, 0o600); err != nil {
		t.Fatal(err)
	}
	s.regClient, err = registry.New(registry.Options{DockerConfig: s.dockerCfg, Insecure: []string{s.registryHost}})
	if err != nil {
		t.Fatal(err)
	}
	s.store, err = s3store.New(s3store.Config{Endpoint: s.minioEndpoint, AccessKey: shared.minioUser, SecretKey: shared.minioPassword, Bucket: shared.bucket})
	if err != nil {
		t.Fatal(err)
	}

	if o.clusterNodes > 0 {
		s.cluster = startNATSCluster(t, o.clusterNodes)
		s.natsURL = s.cluster.url()
	} else {
		s.natsDir, s.natsAddr = t.TempDir(), freeAddr()
		s.startNATS()
		s.natsURL = "nats://" + s.natsAddr
	}
	s.nc, err = nats.Connect(s.natsURL, append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond)}, s.natsOptions...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.nc.Close)
	s.pub, err = publisher.New(s.nc)
	if err != nil {
		t.Fatal(err)
	}
	s.workerArgs = o.workerArgs
	if o.node == nil {
		s.kubelet = startKubelet(t, ns, o.faults)
	} else {
		tmpl := filepath.Join(t.TempDir(), "job-template.yaml")
		if err := os.WriteFile(tmpl, []byte(nodeJobTemplate), 0o600); err != nil {
			t.Fatal(err)
		}
		// The production shape: contexts reach kaniko through the
		// fetch-context init container; only the worker holds S3 keys.
		s.workerArgs = append([]string{"--job-template", tmpl, "--fetch-image", o.node.images.buildq,
			"--s3-access-key", shared.minioUser, "--s3-secret-key", shared.minioPassword}, s.workerArgs...)
		t.Cleanup(func() {
			if t.Failed() {
				dumpNamespace(t, ns)
			}
		})
	}
	return s
}

// startNATS runs nats-server as a separate process, so tests can kill and
// restart it.
func (s *suite) startNATS() {
	s.t.Helper()
	host, port, _ := strings.Cut(s.natsAddr, ":")
	args := []string{"-js", "-a", host, "-p", port, "-sd", s.natsDir}
	if s.natsConfig != "" {
		args = append(args, "-c", s.natsConfig)
	}
	cmd := exec.Command(filepath.Join(shared.bin, "nats-server"), args...)
	cmd.Env = append(os.Environ(), s.natsEnv...)
	logs := &lockedBuffer{}
	s.natsLog = logs
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	s.natsMu.Lock()
	s.nats = cmd
	s.natsMu.Unlock()
	s.t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	eventually(s.t, 20*time.Second, "nats-server", func() bool {
		nc, err := nats.Connect("nats://"+s.natsAddr, s.natsOptions...)
		if err != nil {
			return false
		}
		nc.Close()
		return true
	})
}

// worker is one `buildq worker` process.
type workerProc struct {
	cmd  *exec.Cmd
	logs *bytes.Buffer
	done chan struct{}
	// out is logs behind its lock, safe to read while the worker runs.
	out *lockedBuffer
}

func (s *suite) startWorker(id string) *workerProc {
	s.t.Helper()
	args := []string{"worker",
		"--id", id,
		"--nats-url", s.natsURL,
		"--kubeconfig", s.kubeconfig,
		"--namespace", s.ns,
		"--executor-image", s.executorImage,
		"--s3-endpoint", s.minioEndpoint,
		"--s3-credentials-secret", "buildq-s3",
		"--registry-secret", "buildq-registry",
		"--registry-config", s.dockerCfg,
		"--registry", s.registryHost,
		"--insecure-registry", s.registryHost,
		// Most tests run the emulator's kaniko contract on s3:// with one
		// shared registry Secret (the fetch-context shape and per-tenant
		// Secrets are their own tests' and the real node's).
		"--single-tenant",
		"--ack-wait", "5s",
		"--lease", "3s",
		"--max-in-flight", "16",
		"--log-format", "console",
		"--log-level", "debug",
	}
	args = append(args, s.workerArgs...)
	cmd := exec.Command(filepath.Join(shared.bin, "buildq"), args...)
	logs := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	w := &workerProc{cmd: cmd, logs: &logs.Buffer, done: make(chan struct{}), out: logs}
	go func() { _ = cmd.Wait(); close(w.done) }()
	s.t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-w.done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-w.done
		}
		if s.t.Failed() {
			s.t.Logf("worker %s log:\n%s", id, tail(logs.String(), 6000))
		}
	})
	return w
}

type lockedBuffer struct {
	mu sync.Mutex
	bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.Buffer.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.Buffer.String()
}

// contextDir writes a build context.
func contextDir(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for p, c := range files {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// submit uploads dir and publishes n requests for it (distinct ids).
func (s *suite) submit(dir, name string, n int) []*v1.Request {
	s.t.Helper()
	return s.submitWith(dir, name, n, nil)
}

// results collects every stored result until ctx ends.
type results struct {
	mu  sync.Mutex
	got []v1.Result
}

func (s *suite) collect() *results {
	r := &results{}
	// The stream drops a repeated Nats-Msg-Id, so what is stored cannot show
	// a second result for a request; a core subscription sees every
	// publish. Each request id must be published at most once.
	published := map[string]int{}
	decisions := map[string]map[string]bool{}
	var pmu sync.Mutex
	sub, err := s.nc.Subscribe(v1.ResultsPrefix+".>", func(m *nats.Msg) {
		pmu.Lock()
		defer pmu.Unlock()
		id := m.Header.Get(v1.MsgIDHeader)
		published[id]++
		var res v1.Result
		if json.Unmarshal(m.Data, &res) == nil {
			d := res.Data
			if decisions[id] == nil {
				decisions[id] = map[string]bool{}
			}
			decisions[id][fmt.Sprintf("%s/%s/%s/%s/%s", d.Status, d.Origin, d.Reason, d.Image, d.Digest)] = true
		}
	})
	if err != nil {
		s.t.Fatal(err)
	}
	if err := s.nc.Flush(); err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() {
		_ = s.nc.Flush()
		_ = sub.Unsubscribe()
		pmu.Lock()
		defer pmu.Unlock()
		republished := 0
		for id, n := range published {
			switch {
			case n > 1 && !s.republishOK:
				s.t.Errorf("request %s: %d results published, want exactly one", id, n)
			case len(decisions[id]) > 1:
				s.t.Errorf("request %s: %d different results published: %v", id, len(decisions[id]), decisions[id])
			case n > 1:
				republished++
			}
		}
		if republished > 0 {
			s.t.Logf("%d request(s) had the same result published more than once (the stream stored one)", republished)
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	s.t.Cleanup(cancel)
	go func() {
		for ctx.Err() == nil {
			err := s.pub.Watch(ctx, publisher.Filter{DeliverAll: true}, func(res v1.Result) error {
				r.mu.Lock()
				defer r.mu.Unlock()
				for _, g := range r.got {
					if g.ID == res.ID {
						// An ordered consumer replays after a reconnect;
						// publishes are counted above.
						return nil
					}
				}
				r.got = append(r.got, res)
				return nil
			})
			if err != nil && ctx.Err() == nil {
				time.Sleep(200 * time.Millisecond)
			}
		}
	}()
	return r
}

func (r *results) wait(t *testing.T, n int, timeout time.Duration) []v1.Result {
	t.Helper()
	eventually(t, timeout, fmt.Sprintf("%d results", n), func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.got) >= n
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]v1.Result(nil), r.got...)
}

// storedResults counts the messages in BUILDQ_RESULTS: what subscribers
// see, duplicates included.
func (s *suite) storedResults() uint64 {
	s.t.Helper()
	js, _ := jetstream.New(s.nc)
	st, err := js.Stream(context.Background(), v1.ResultsStream)
	if err != nil {
		s.t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		s.t.Fatal(err)
	}
	return info.State.Msgs
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
