//go:build integration

package integration

import (
	"archive/tar"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
)

// testDevOnRealNode runs `buildq dev --kubeconfig` against the real node
// and builds examples/with-run with `buildq submit`, as the README says a
// user points dev at kind or k3d.
func testDevOnRealNode(t *testing.T, node *realNode) {
	ctx := context.Background()
	ns := "it-dev-real-node"
	if _, err := shared.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			dumpNamespace(t, ns)
		}
	})
	tmpl := filepath.Join(t.TempDir(), "job-template.yaml")
	if err := os.WriteFile(tmpl, []byte(nodeJobTemplate), 0o600); err != nil {
		t.Fatal(err)
	}
	dctx, cancel := context.WithCancel(ctx)
	dev := exec.CommandContext(dctx, filepath.Join(shared.bin, "buildq"), "dev", "--data", t.TempDir(),
		"--nats-addr", "127.0.0.1:0", "--unsafe-listen",
		"--s3-addr", nodeGateway+":0", "--registry-addr", nodeGateway+":0",
		"--kubeconfig", shared.kubeconfig, "--namespace", ns, "--job-template", tmpl,
		"--executor-image", node.images.kaniko)
	out := &lockedBuffer{}
	dev.Stdout, dev.Stderr = out, out
	if err := dev.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = dev.Wait()
		if t.Failed() {
			t.Logf("buildq dev:\n%s", tail(out.String(), 4000))
		}
	})
	ready := regexp.MustCompile(`buildq dev ready\s+nats=(\S+)\s+s3=(\S+) \(bucket \S+\)\s+registry=(\S+)`)
	var m []string
	eventually(t, 2*time.Minute, "buildq dev to be ready", func() bool {
		m = ready.FindStringSubmatch(out.String())
		return m != nil
	})
	if !strings.Contains(out.String(), "WARNING: --unsafe-listen") {
		t.Errorf("dev exposed its S3 store and registry without the warning:\n%s", out.String())
	}
	// The example's base image, in the dev registry.
	devReg := m[3]
	src, err := name.ParseReference(strings.Replace(node.images.base, node.registryHost, shared.registryHost, 1), name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(src, remote.WithAuth(&authn.Basic{Username: shared.registryUser, Password: shared.registryPass}))
	if err != nil {
		t.Fatal(err)
	}
	dst, _ := name.ParseReference(devReg+"/library/busybox:1", name.Insecure)
	if err := remote.Write(dst, img); err != nil {
		t.Fatal(err)
	}

	sub := exec.Command(filepath.Join(shared.bin, "buildq"), "submit", "../examples/with-run",
		"--nats-url", m[1], "--s3-endpoint", m[2], "--build-arg", "BASE="+devReg+"/library/busybox:1",
		"--wait", "--wait-timeout", "5m", "-o", "json")
	stdout, err := sub.Output()
	if err != nil {
		t.Fatalf("buildq submit examples/with-run: %v\n%s", err, stdout)
	}
	var res v1.ResultData
	if err := json.Unmarshal(stdout, &res); err != nil {
		t.Fatalf("stdout %q: %v", stdout, err)
	}
	if res.Status != v1.StatusSucceeded || res.Origin != v1.OriginBuild {
		t.Fatalf("result %+v", res)
	}
	// The image in the dev registry runs as app, with the example's
	// entrypoint and the user its RUN step created.
	ref, _ := name.ParseReference(res.ImageRef, name.Insecure)
	built, err := remote.Image(ref)
	if err != nil {
		t.Fatalf("pull %s: %v", res.ImageRef, err)
	}
	cf, err := built.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != "app" || len(cf.Config.Entrypoint) != 1 || cf.Config.Entrypoint[0] != "/usr/local/bin/hello" {
		t.Fatalf("image config %+v", cf.Config)
	}
	rc := mutate.Extract(built)
	defer rc.Close()
	tr := tar.NewReader(rc)
	var passwd []byte
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		if strings.TrimPrefix(h.Name, "/") == "etc/passwd" {
			passwd, _ = io.ReadAll(tr)
		}
	}
	if !strings.Contains(string(passwd), "app:x:1000:1000") {
		t.Fatalf("/etc/passwd of the built image:\n%s", passwd)
	}
}

// jobPods lists the Pods of a Job.
