//go:build integration && benche2e

package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	batchv1 "k8s.io/api/batch/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// P1's two bare programs, the baseline (fetch, then create the Job) and
// the floor (fetch, the entry's create and the key's claim at once, then
// the same Job create and the tag's HEAD), run in a process of their own,
// as the worker does: this test binary run again with bareP1Env set.
// In the benchmark's own process they had threads already running
// whenever a reply came (the benchmark's informers, publishers and
// clocks), where a program of its own, idle between requests, first has
// a thread woken: the same KV create sent from the worker's process took
// 1.0-1.7 ms at p50 where the floor's took 0.8-0.9 ms from the
// benchmark's (2026-12-06, docs/benchmarks.md, P1).
const bareP1Env = "BUILDQ_BENCH_BARE_P1"

func init() { subprocessMains[bareP1Env] = runBareP1 }

// bareP1Config is what the bare programs' process is told, as JSON in
// bareP1Env.
type bareP1Config struct {
	NATS       string `json:"nats"`
	Kubeconfig string `json:"kubeconfig"`
	Namespace  string `json:"namespace"`
	// JobFile holds the Job the baseline and the floor create copies of
	// (the worker's first Job, baselineJob).
	JobFile      string `json:"jobFile"`
	Registry     string `json:"registry"`
	RegistryUser string `json:"registryUser"`
	RegistryPass string `json:"registryPass"`
}

// runBareP1 is the bare programs' process: it takes the consumers
// "bench" and "floor" of stream BENCH_P1 and the bucket bench-p1-floor
// (the benchmark made them), says "ready" on stdout, and runs until its
// stdin closes. Each failure is a line on stderr starting "bare:".
func runBareP1() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bare:", err)
		return 2
	}
	var cfg bareP1Config
	if err := json.Unmarshal([]byte(os.Getenv(bareP1Env)), &cfg); err != nil {
		return fail(fmt.Errorf("%s: %w", bareP1Env, err))
	}
	raw, err := os.ReadFile(cfg.JobFile)
	if err != nil {
		return fail(err)
	}
	var like batchv1.Job
	if err := json.Unmarshal(raw, &like); err != nil {
		return fail(fmt.Errorf("%s: %w", cfg.JobFile, err))
	}
	rc, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	if err != nil {
		return fail(err)
	}
	// The worker's default rate limit, as benchRest.
	rc.QPS, rc.Burst = 50, 100
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fail(err)
	}
	nc, err := nats.Connect(cfg.NATS)
	if err != nil {
		return fail(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	stream, err := js.Stream(ctx, "BENCH_P1")
	if err != nil {
		return fail(err)
	}
	kv, err := js.KeyValue(ctx, "bench-p1-floor")
	if err != nil {
		return fail(err)
	}
	var wg sync.WaitGroup
	consume := func(durable string, handle func(name string) error) error {
		cons, err := stream.Consumer(ctx, durable)
		if err != nil {
			return err
		}
		it, err := cons.Messages()
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				m, err := it.Next()
				if err != nil {
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := handle(string(m.Data())); err != nil && ctx.Err() == nil {
						fmt.Fprintf(os.Stderr, "bare: %s %s: %v\n", durable, m.Data(), err)
					}
					_ = m.Ack()
				}()
			}
		}()
		context.AfterFunc(ctx, it.Stop)
		return nil
	}
	jobs := kube.BatchV1().Jobs(cfg.Namespace)
	// P1's baseline: publish → fetch → create a Job, nothing else.
	if err := consume("bench", func(name string) error {
		_, err := jobs.Create(ctx, baselineJob(&like, name), metav1.CreateOptions{})
		return err
	}); err != nil {
		return fail(err)
	}
	// P1's floor: what a bare program keeping buildq's guarantees pays
	// before the same Job create, at the least — the request's entry
	// created (one answer per request: a KV create) and the key claimed
	// (one build per key: a KV create), at once; the tag's HEAD (no tag
	// overwritten: the suite's registry, the suite's credentials) goes
	// once the Job is created, as buildq's does where the build Pod
	// checks the tag too.
	if err := consume("floor", func(name string) error {
		claim := make(chan error, 1)
		go func() {
			_, err := kv.Create(ctx, "claim."+name, []byte("claimed"))
			claim <- err
		}()
		_, err := kv.Create(ctx, "entry."+name, []byte("open"))
		if cerr := <-claim; err == nil {
			err = cerr
		}
		if err == nil {
			_, err = jobs.Create(ctx, baselineJob(&like, name), metav1.CreateOptions{})
		}
		if err == nil {
			err = floorHead(ctx, cfg.Registry, cfg.RegistryUser, cfg.RegistryPass, name)
		}
		return err
	}); err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	stop()
	wg.Wait()
	return 0
}

// floorHead is P1's floor's registry check: a HEAD of the tag with the
// suite's credentials, which must find nothing there.
func floorHead(ctx context.Context, registry, user, pass, name string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodHead, "http://"+registry+"/v2/acme/p1-floor/manifests/"+name, nil)
	if err != nil {
		return err
	}
	req.SetBasicAuth(user, pass)
	req.Header.Set("Accept", "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		return fmt.Errorf("HEAD %s: %s, want 404 Not Found", req.URL, resp.Status)
	}
	return nil
}

// startBareP1 runs P1's bare programs in their own process, creating
// copies of like, until the test ends; each failure they report fails
// the test.
func (s *suite) startBareP1(t *testing.T, like *batchv1.Job) {
	t.Helper()
	raw, err := json.Marshal(like)
	if err != nil {
		t.Fatal(err)
	}
	jobFile := filepath.Join(t.TempDir(), "like.json")
	if err := os.WriteFile(jobFile, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := json.Marshal(bareP1Config{NATS: s.natsURL, Kubeconfig: shared.kubeconfig, Namespace: s.ns, JobFile: jobFile,
		Registry: shared.registryHost, RegistryUser: shared.registryUser, RegistryPass: shared.registryPass})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), bareP1Env+"="+string(cfg))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		ok := sc.Scan() && sc.Text() == "ready"
		ready <- ok
		_, _ = io.Copy(io.Discard, stdout)
		done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = stdin.Close()
		var err error
		select {
		case err = <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			err = errors.Join(errors.New("did not stop within 30s of its stdin closing"), <-done)
		}
		if err != nil || stderr.String() != "" {
			t.Errorf("P1's bare programs: %v\n%s", err, stderr.String())
		}
	})
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("P1's bare programs did not start:\n%s", stderr.String())
		}
	case <-time.After(time.Minute):
		t.Fatalf("P1's bare programs not ready within a minute:\n%s", stderr.String())
	}
}
