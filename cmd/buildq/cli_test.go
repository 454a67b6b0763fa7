package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/loopback"
)

// dev is an in-process `buildq dev` on free ports.
type dev struct {
	nats, s3, registry string
	stop               func()
}

var readyRe = regexp.MustCompile(`nats=(\S+)\s+s3=(\S+) .*registry=(\S+)`)

func startDev(t *testing.T, data string) *dev {
	t.Helper()
	return startDevOn(t, data, "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
}

// freeAddr returns a loopback address that was free a moment ago and
// was not handed out before.
func freeAddr(*testing.T) string { return loopback.FreeAddr() }

func startDevOn(t *testing.T, data, natsAddr, s3Addr, registryAddr string, extra ...string) *dev {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		code := run(ctx, append([]string{"dev", "--data", data, "--nats-addr", natsAddr, "--s3-addr", s3Addr,
			"--registry-addr", registryAddr, "--log-level", "warn"}, extra...), io.Discard, pw)
		pw.Close()
		done <- code
	}()
	lines := make(chan string)
	var tail bytes.Buffer
	var mu sync.Mutex
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			mu.Lock()
			tail.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if strings.Contains(sc.Text(), "buildq dev ready") {
				lines <- sc.Text()
			}
		}
		close(lines)
	}()
	select {
	case l, ok := <-lines:
		if !ok {
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("buildq dev exited before ready:\n%s", tail.String())
		}
		m := readyRe.FindStringSubmatch(l)
		if m == nil {
			t.Fatalf("ready line %q lacks endpoints", l)
		}
		d := &dev{nats: m[1], s3: m[2], registry: m[3]}
		stopped := false
		d.stop = func() {
			if stopped {
				return
			}
			stopped = true
			cancel()
			select {
			case code := <-done:
				if code != 0 {
					t.Errorf("buildq dev exited %d", code)
				}
			case <-time.After(30 * time.Second):
				t.Error("buildq dev did not stop")
			}
		}
		t.Cleanup(d.stop)
		return d
	case <-time.After(60 * time.Second):
		cancel()
		t.Fatal("buildq dev not ready in 60s")
	}
	return nil
}

// cli runs one buildq command and returns its exit code and output.
func cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	code := run(ctx, args, &out, &errb)
	return code, out.String(), errb.String()
}

func (d *dev) submit(t *testing.T, dir string, extra ...string) (int, string, string) {
	t.Helper()
	args := append([]string{"submit", dir, "--nats-url", d.nats, "--s3-endpoint", d.s3}, extra...)
	return cli(t, args...)
}

func writeTree(t *testing.T, files map[string]string) string {
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

func decodeResult(t *testing.T, stdout string) v1.ResultData {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(stdout))
	var d v1.ResultData
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("stdout is not one JSON object: %v\n%s", err, stdout)
	}
	if dec.More() {
		t.Fatalf("stdout holds more than one JSON object:\n%s", stdout)
	}
	return d
}

func TestDevSubmitBuildsAndDeduplicates(t *testing.T) {
	t.Parallel()
	d := startDev(t, t.TempDir())
	ctxDir := writeTree(t, map[string]string{
		"Dockerfile": "FROM scratch\nARG GREETING=hi\nENV GREETING=$GREETING MODE=prod\n" +
			"LABEL org.example.team=platform\nCOPY app/ /app/\nENTRYPOINT [\"/app/run\"]\n",
		"app/run":        "#!/bin/sh\necho run\n",
		"app/data/a.txt": "a",
		"notes.swp":      "ignored",
		".dockerignore":  "*.swp\n",
	})
	repo := strings.Replace(d.registry, "http://", "", 1) + "/acme/site"

	code, stdout, stderr := d.submit(t, ctxDir, "--image", repo, "--tenant", "acme", "--name", "site",
		"--build-arg", "GREETING=hello", "--wait", "-o", "json")
	if code != 0 {
		t.Fatalf("submit exit %d\nstdout %s\nstderr %s", code, stdout, stderr)
	}
	res := decodeResult(t, stdout)
	if res.Status != v1.StatusSucceeded || res.Origin != v1.OriginBuild || !strings.HasPrefix(res.Digest, "sha256:") {
		t.Fatalf("result %+v", res)
	}
	for _, phase := range []string{"queued", "claimed", "building", "pushed"} {
		if !strings.Contains(stderr, phase) {
			t.Errorf("stderr lacks progress %q:\n%s", phase, stderr)
		}
	}

	// The image in the registry: layers hold exactly the context's COPY
	// sources, the config what the Dockerfile says.
	ref, err := name.ParseReference(res.ImageRef, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(ref)
	if err != nil {
		t.Fatal(err)
	}
	digest, _ := img.Digest()
	if digest.String() != res.Digest {
		t.Fatalf("registry digest %s, result %s", digest, res.Digest)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(cfg.Config.Env, "GREETING=hello") || !slices.Contains(cfg.Config.Env, "MODE=prod") {
		t.Errorf("env %v", cfg.Config.Env)
	}
	if !slices.Equal(cfg.Config.Entrypoint, []string{"/app/run"}) {
		t.Errorf("entrypoint %v", cfg.Config.Entrypoint)
	}
	if cfg.Config.Labels["org.example.team"] != "platform" {
		t.Errorf("labels %v", cfg.Config.Labels)
	}
	var files []string
	layers, _ := img.Layers()
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if h.Typeflag == tar.TypeReg {
				files = append(files, strings.TrimPrefix(h.Name, "/"))
			}
		}
		rc.Close()
	}
	slices.Sort(files)
	if want := []string{"app/data/a.txt", "app/run"}; !slices.Equal(files, want) {
		t.Errorf("image files %v, want %v", files, want)
	}

	// The same submit again: answered from the index, same digest.
	code, stdout, stderr = d.submit(t, ctxDir, "--image", repo, "--tenant", "acme", "--name", "site",
		"--build-arg", "GREETING=hello", "--wait", "-o", "json")
	if code != 0 {
		t.Fatalf("second submit exit %d: %s", code, stderr)
	}
	again := decodeResult(t, stdout)
	if again.Origin != v1.OriginCache || again.Digest != res.Digest || again.RequestID == res.RequestID {
		t.Fatalf("second result %+v", again)
	}
	if !strings.Contains(stderr, "already uploaded") {
		t.Errorf("the context was uploaded twice:\n%s", stderr)
	}

	// status by request id and by key.
	code, stdout, _ = cli(t, "status", res.RequestID, "--tenant", "acme", "--nats-url", d.nats, "-o", "json")
	if code != 0 || !strings.Contains(stdout, res.Digest) || !strings.Contains(stdout, res.Key) {
		t.Errorf("status exit %d: %s", code, stdout)
	}
	// Request ids are per tenant: another tenant does not see this one.
	code, _, _ = cli(t, "status", res.RequestID, "--tenant", "other", "--nats-url", d.nats, "-o", "json")
	if code != 1 {
		t.Errorf("status of another tenant's request: exit %d, want 1", code)
	}
	code, stdout, _ = cli(t, "status", res.RequestID, "--tenant", "acme", "--nats-url", d.nats, "-o", "json")
	if code != 0 || !strings.Contains(stdout, res.Digest) || !strings.Contains(stdout, res.Key) {
		t.Errorf("status exit %d: %s", code, stdout)
	}
	code, stdout, _ = cli(t, "status", res.Key, "--tenant", "acme", "--nats-url", d.nats)
	if code != 0 || !strings.Contains(stdout, "succeeded") {
		t.Errorf("status by key exit %d: %s", code, stdout)
	}
}

func TestDevRefusesRun(t *testing.T) {
	t.Parallel()
	d := startDev(t, t.TempDir())
	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\nRUN echo hi\n"})
	code, stdout, stderr := d.submit(t, dir, "--wait")
	if code != 1 {
		t.Fatalf("exit %d, want 1\nstdout %s\nstderr %s", code, stdout, stderr)
	}
	if !strings.Contains(stdout, "RUN") || !strings.Contains(stdout, "kaniko") || !strings.Contains(stdout, "BuildFailed") {
		t.Errorf("output does not explain the refusal:\n%s", stdout)
	}
}

func TestDevKeepsImagesAcrossRestart(t *testing.T) {
	t.Parallel()
	data := t.TempDir()
	// The index records where images live: restart on the same addresses,
	// as `buildq dev` does with its fixed defaults.
	addrs := []string{freeAddr(t), freeAddr(t), freeAddr(t)}
	d := startDevOn(t, data, addrs[0], addrs[1], addrs[2])
	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "content"})
	code, stdout, stderr := d.submit(t, dir, "--wait", "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	first := decodeResult(t, stdout)
	d.stop()

	d2 := startDevOn(t, data, addrs[0], addrs[1], addrs[2])
	// The image is still in the registry.
	repo := strings.SplitN(first.ImageRef, "/", 2)[1]
	ref, err := name.ParseReference(d2.registry+"/"+repo, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Head(ref)
	if err != nil || desc.Digest.String() != first.Digest {
		t.Fatalf("image after restart: %v %v", desc, err)
	}
	// And the dedupe index too.
	code, stdout, stderr = d2.submit(t, dir, "--wait", "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if again := decodeResult(t, stdout); again.Origin != v1.OriginCache || again.Digest != first.Digest {
		t.Fatalf("after restart %+v", again)
	}
}

func TestUsageErrorsExit2(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\n"})
	cases := map[string][]string{
		"unknown flag":               {"submit", dir, "--bogus"},
		"missing DIR":                {"submit"},
		"no such DIR":                {"submit", filepath.Join(dir, "nope")},
		"no Dockerfile":              {"submit", dir, "-f", "Other.Dockerfile"},
		"bad build arg":              {"submit", dir, "--build-arg", "NOVALUE"},
		"bad platform":               {"submit", dir, "--platform", "plan9/mips"},
		"bad tenant":                 {"submit", dir, "--tenant", "a.b"},
		"image with tag":             {"submit", dir, "--image", "127.0.0.1:5000/a/b:v1"},
		"bad output":                 {"submit", dir, "-o", "xml"},
		"bad priority":               {"submit", dir, "--priority", "urgent"},
		"DIR and --git":              {"submit", dir, "--git", "https://git.example.com/a/web.git", "--ref", "main"},
		"--git without ref":          {"submit", "--git", "https://git.example.com/a/web.git"},
		"--ref without --git":        {"submit", dir, "--ref", "main"},
		"--git ref like a flag":      {"submit", "--git", "https://git.example.com/a/web.git", "--ref=--upload-pack=touch"},
		"--git file URL":             {"submit", "--git", "file:///etc", "--ref", "main"},
		"--git short commit":         {"submit", "--git", "https://git.example.com/a/web.git", "--commit", "abc"},
		"render bad name":            {"render", dir, "--name", "Bad_Name", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64)},
		"render unpinned":            {"render", dir, "--executor-image", "ghcr.io/x/kaniko:latest"},
		"render no executor":         {"render", dir},
		"worker without fetch-image": {"worker", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64)},
		"worker fetch-image unpinned": {"worker", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64),
			"--fetch-image", "ghcr.io/buildq/buildq:latest"},
		"worker fetch-image without keys": {"worker", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64),
			"--fetch-image", "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("1", 64), "--s3-endpoint", "http://minio:9000"},
		"worker pprof without metrics": {"worker", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64),
			"--single-tenant", "--pprof"},
		"worker zero qps": {"worker", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64),
			"--allow-unverified-contexts", "--kube-api-qps", "0"}, // --single-tenant's first name
		"worker shared registry secret": {"worker", "--executor-image", "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64),
			"--fetch-image", "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("1", 64), "--registry-secret", "buildq-registry",
			"--s3-endpoint", "http://minio:9000", "--s3-access-key", "a", "--s3-secret-key", "b", "--kubeconfig", "/nonexistent"},
		"status no arg":    {"status"},
		"bad inbox prefix": {"status", "x", "--inbox-prefix", "_INBOX_acme.*"},
		"unknown command":  {"frobnicate"},
	}
	for name, args := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := cli(t, append(args, "--nats-url", "nats://127.0.0.1:1")...)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", code, stderr)
			}
			if !strings.HasPrefix(stderr, "buildq: ") {
				t.Errorf("stderr %q does not say what is wrong", stderr)
			}
		})
	}
}

func TestNoNATSSaysStartDev(t *testing.T) {
	t.Parallel()
	code, _, stderr := cli(t, "watch", "--nats-url", "nats://127.0.0.1:1")
	if code != 1 || !strings.Contains(stderr, "no NATS at nats://127.0.0.1:1 — check --nats-url") {
		t.Fatalf("exit %d stderr %q", code, stderr)
	}
	// At the default address the advice is to start buildq dev. The test
	// needs that address free; another process owning it is not this
	// test's failure.
	l, err := net.Listen("tcp", "127.0.0.1:4222")
	if err != nil {
		t.Logf("127.0.0.1:4222 is in use; the default-address hint is not checked")
		return
	}
	l.Close()
	code, _, stderr = cli(t, "status", strings.Repeat("a", 64))
	if code != 1 || !strings.Contains(stderr, "no NATS at nats://127.0.0.1:4222 — is `buildq dev` running?") {
		t.Fatalf("exit %d stderr %q", code, stderr)
	}
}

// buildq dev confines each tenant to its own part of its registry, as a
// worker does (issue 23: dev let any tenant push anywhere, so the policy
// could not be tried locally); --allowed-destination relaxes it.
func TestDevConfinesDestinations(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "confined"})

	d := startDev(t, t.TempDir())
	code, stdout, stderr := d.submit(t, dir, "--tenant", "acme", "--image", d.registry+"/globex/site", "--wait", "-o", "json")
	if code != 1 {
		t.Fatalf("acme pushing to globex's repository: exit %d, want 1\n%s%s", code, stdout, stderr)
	}
	if r := decodeResult(t, stdout); r.Reason != v1.ReasonInvalidRequest || !strings.Contains(r.Message, d.registry+"/acme/**") {
		t.Fatalf("result %+v, want InvalidRequest naming %s/acme/**", r, d.registry)
	}
	code, stdout, stderr = d.submit(t, dir, "--tenant", "acme", "--wait", "-o", "json")
	if r := decodeResult(t, stdout); code != 0 || r.Status != v1.StatusSucceeded || !strings.HasPrefix(r.Image, d.registry+"/acme/") {
		t.Fatalf("acme's own repository: exit %d, %+v\n%s", code, r, stderr)
	}

	open := startDevOn(t, t.TempDir(), "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", "--allowed-destination", "{registry}/**")
	code, stdout, stderr = open.submit(t, dir, "--tenant", "acme", "--image", open.registry+"/globex/site", "--wait", "-o", "json")
	if r := decodeResult(t, stdout); code != 0 || r.Status != v1.StatusSucceeded {
		t.Fatalf("with --allowed-destination '{registry}/**': exit %d, %+v\n%s", code, r, stderr)
	}
}

// render runs the checks a worker runs at start and on the request's
// destination, and refuses what a worker would refuse (issue 23: it
// printed Jobs the worker itself would not create).
func TestRenderRunsTheWorkersChecks(t *testing.T) {
	t.Parallel()
	dir := writeTree(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "render"})
	executor := "ghcr.io/x/kaniko@sha256:" + strings.Repeat("0", 64)
	fetch := "ghcr.io/buildq/buildq@sha256:" + strings.Repeat("1", 64)
	base := []string{"render", dir, "--tenant", "acme", "--name", "web", "--registry", "registry.example.com",
		"--executor-image", executor, "--s3-endpoint", "http://minio:9000"}
	refused := map[string]struct {
		args []string
		want string
	}{
		"no fetch-image":            {nil, "--fetch-image"},
		"fetch-image unpinned":      {[]string{"--fetch-image", "ghcr.io/buildq/buildq:latest"}, "not pinned by digest"},
		"shared registry secret":    {[]string{"--fetch-image", fetch, "--registry-secret", "buildq-registry"}, "--single-tenant"},
		"tenant secret without tag": {[]string{"--fetch-image", fetch, "--tenant-registry-secret", "buildq-registry"}, "must contain {tenant}"},
		"shared cache repository":   {[]string{"--fetch-image", fetch, "--cache-repo", "registry.example.com/cache"}, "must contain {tenant}"},
		"another tenant's repository": {[]string{"--fetch-image", fetch, "--image", "registry.example.com/globex/web"},
			`tenant "acme" may push only to registry.example.com/acme/**`},
		"no registry for the policy": {[]string{"--fetch-image", fetch, "--registry", "", "--image", "registry.example.com/acme/web"}, "allows no destination"},
		"bad job template":           {[]string{"--fetch-image", fetch, "--job-template", filepath.Join(dir, "nope.yaml")}, "--job-template"},
	}
	for name, c := range refused {
		t.Run("refused: "+name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := cli(t, append(append([]string{}, base...), c.args...)...)
			if code != 2 || stdout != "" || !strings.Contains(stderr, c.want) {
				t.Fatalf("exit %d, stdout %q, stderr %q; want exit 2 naming %q", code, stdout, stderr, c.want)
			}
		})
	}
	accepted := map[string]struct {
		args   []string
		secret string
		checks bool // the Pod checks its first tag (fetch-context --absent)
	}{
		"per-tenant secrets": {[]string{"--fetch-image", fetch, "--tenant-registry-secret", "buildq-registry-{tenant}"}, "buildq-registry-acme", true},
		"single tenant":      {[]string{"--single-tenant", "--s3-credentials-secret", "buildq-s3", "--registry-secret", "buildq-registry"}, "buildq-registry", false},
	}
	for name, c := range accepted {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := cli(t, append(append([]string{}, base...), append(c.args, "-o", "json")...)...)
			if code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			var job struct {
				Metadata struct{ Name string }
				Spec     struct {
					Template struct {
						Spec struct {
							Volumes []struct {
								Name   string
								Secret *struct{ SecretName string }
							}
						}
					}
				}
			}
			if err := json.Unmarshal([]byte(stdout), &job); err != nil || !strings.HasPrefix(job.Metadata.Name, "buildq-") {
				t.Fatalf("not a Job: %v\n%s", err, stdout)
			}
			var secrets []string
			for _, v := range job.Spec.Template.Spec.Volumes {
				if v.Secret != nil {
					secrets = append(secrets, v.Secret.SecretName)
				}
			}
			if !slices.Equal(secrets, []string{c.secret}) {
				t.Errorf("Secrets mounted: %v, want [%s]", secrets, c.secret)
			}
			if checks := strings.Contains(stdout, `"--absent"`); checks != c.checks {
				t.Errorf("the rendered Pod checks its first tag: %v, want %v (as the worker makes it)", checks, c.checks)
			}
		})
	}
}
