//go:build integration

package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/devstack"
	"github.com/buildq/buildq/internal/kaniko"
)

// TestDevWithKubeconfigLaunchesKanikoJobs runs `buildq dev --kubeconfig`
// and `buildq submit --wait -o json` as a user would: the build runs as a
// kaniko Job on the cluster, not in-process.
func TestDevWithKubeconfigLaunchesKanikoJobs(t *testing.T) {
	ctx := context.Background()
	ns := "it-dev-kubeconfig"
	if _, err := shared.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := shared.kube.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "buildq-s3", Namespace: ns},
		Data:       map[string][]byte{"AWS_ACCESS_KEY_ID": []byte(devstack.DevAccessKey), "AWS_SECRET_ACCESS_KEY": []byte(devstack.DevSecretKey)},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	startKubelet(t, ns, nil)

	dctx, cancel := context.WithCancel(ctx)
	dev := exec.CommandContext(dctx, filepath.Join(shared.bin, "buildq"), "dev", "--data", t.TempDir(),
		"--nats-addr", freeAddr(), "--s3-addr", freeAddr(), "--registry-addr", freeAddr(),
		"--kubeconfig", shared.kubeconfig, "--namespace", ns, "--executor-image", executorImage, "--s3-credentials-secret", "buildq-s3")
	stderr, err := dev.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = dev.Wait() })
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "buildq dev ready") {
				ready <- sc.Text()
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
	}()
	var line string
	select {
	case line = <-ready:
	case <-time.After(2 * time.Minute):
		t.Fatal("buildq dev --kubeconfig not ready")
	}
	m := regexp.MustCompile(`nats=(\S+)\s+s3=(\S+) `).FindStringSubmatch(line)
	if m == nil || !strings.Contains(line, "executor=kaniko Jobs in namespace "+ns) {
		t.Fatalf("ready line %q", line)
	}

	dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "from dev"})
	out, err := exec.Command(filepath.Join(shared.bin, "buildq"), "submit", dir, "--nats-url", m[1], "--s3-endpoint", m[2],
		"--wait", "--wait-timeout", "2m", "-o", "json").Output()
	if err != nil {
		t.Fatalf("submit: %v\n%s", err, out)
	}
	var res v1.ResultData
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("stdout %q: %v", out, err)
	}
	if res.Status != v1.StatusSucceeded || res.Origin != v1.OriginBuild || res.Job != kaniko.JobName(res.Key) {
		t.Fatalf("result %+v", res)
	}
}
