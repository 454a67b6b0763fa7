//go:build integration

package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/crane"
	"github.com/google/go-containerregistry/pkg/name"
	gcr "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/buildq/buildq/api/v1"
)

// Issue 29, "where it runs", on the real node (linux/amd64, no binfmt_misc
// emulation).

// goarchProgram prints the architecture it was built for and writes it,
// and the platform build arguments it sees in its environment (kaniko
// gives a RUN step its declared ARGs as variables), into the image.
const goarchProgram = `package main

import (
	"fmt"
	"os"
	"runtime"
)

func main() {
	fmt.Println("running as GOARCH=" + runtime.GOARCH)
	args := os.Getenv("TARGETPLATFORM") + " " + os.Getenv("TARGETARCH") + " " + os.Getenv("BUILDPLATFORM")
	if err := os.WriteFile("/arch", []byte(runtime.GOARCH), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := os.WriteFile("/platform-args", []byte(args), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
`

// goarchBase builds goarchProgram static for linux/goarch, puts it at
// /hello in an image whose config names linux/goarch (the node tests'
// other images are made the same way, with go-containerregistry),
// pushes it to the suite's registry and returns its reference by digest
// as the Pods reach it.
func goarchBase(t *testing.T, node *realNode, goarch string) string {
	t.Helper()
	img := goarchImage(t, goarch)
	repo := "node/goarch-" + goarch
	ref, err := name.ParseReference(shared.registryHost+"/"+repo+":latest", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, registryAuth(), remote.WithContext(context.Background())); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return node.registryHost + "/" + repo + "@" + d.String()
}

func registryAuth() remote.Option {
	return remote.WithAuth(&authn.Basic{Username: shared.registryUser, Password: shared.registryPass})
}

// goarchIndex is goarchBase for several architectures at once: an image
// index of goarchProgram's image for each, by digest as the Pods reach it.
func goarchIndex(t *testing.T, node *realNode, goarchs ...string) string {
	t.Helper()
	var adds []mutate.IndexAddendum
	for _, a := range goarchs {
		adds = append(adds, mutate.IndexAddendum{Add: goarchImage(t, a), Descriptor: gcr.Descriptor{Platform: &gcr.Platform{OS: "linux", Architecture: a}}})
	}
	idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, "application/vnd.oci.image.index.v1+json"), adds...)
	repo := "node/goarch-" + strings.Join(goarchs, "-")
	ref, err := name.ParseReference(shared.registryHost+"/"+repo+":latest", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, idx, registryAuth()); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	d, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return node.registryHost + "/" + repo + "@" + d.String()
}

// goarchImage builds goarchProgram static for linux/goarch into an image
// whose config names linux/goarch.
func goarchImage(t *testing.T, goarch string) gcr.Image {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(goarchProgram), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module goarch\n\ngo 1.22\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", "hello", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+goarch, "GOFLAGS=-mod=mod", "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build for %s: %v\n%s", goarch, err, out)
	}
	bin, err := os.ReadFile(filepath.Join(dir, "hello"))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: "hello", Mode: 0o755, Size: int64(len(bin)), ModTime: time.Unix(0, 0), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write(bin); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", goarch
	cf.Config = gcr.Config{Env: []string{"PATH=/"}}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

// imageConfig reads a pushed image's config, as a third party would.
func imageConfig(t *testing.T, ref string) *gcr.ConfigFile {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r, remote.WithAuth(&authn.Basic{Username: shared.registryUser, Password: shared.registryPass}))
	if err != nil {
		t.Fatalf("pull %s: %v", ref, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	return cf
}

// A RUN whose program the node cannot execute (an arm64 binary on the
// amd64 node, placed there by --platform-node-selector: the default
// selector would have the request refused first) fails once with
// PlatformUnsupported and kaniko's "exec format error" line.
func testPlatformUnsupportedOnRealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node, workerArgs: []string{"--platform-node-selector", "linux/arm64=kubernetes.io/arch=amd64"}})
	pods := s.podsCreated()
	s.startWorker("w1")
	res := s.collect()
	base := goarchBase(t, node, "arm64")
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN [\"/hello\"]\n"})
	start := time.Now()
	s.submitWith(dir, "arm64run", 1, func(r *v1.Request) {
		r.BuildArgs = map[string]string{"BASE": base}
		r.Platforms = []string{"linux/arm64"}
	})
	r := res.wait(t, 1, 5*time.Minute)[0]
	d := r.Data
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonPlatformUnsupported {
		t.Fatalf("result %s, want failed/%s", mustJSON(r), v1.ReasonPlatformUnsupported)
	}
	for _, want := range []string{"fork/exec /hello: exec format error", "error building image:"} {
		if !strings.Contains(d.Message, want) {
			t.Errorf("message %q does not quote kaniko's line (%q)", d.Message, want)
		}
	}
	if !strings.Contains(d.LogTail, "exec format error") {
		t.Errorf("log tail lacks the line:\n%s", d.LogTail)
	}
	if n := pods(); n != 1 {
		t.Errorf("%d pods ran, want 1", n)
	}
	t.Logf("answered %s in %s: %s", d.Reason, time.Since(start).Round(100*time.Millisecond), d.Message)
}

// linux/386 runs natively on the amd64 node: with
// --platform-node-selector linux/386=kubernetes.io/arch=amd64 its RUN
// executes a static 386 program, the image's config says 386, and the
// RUN saw BuildKit's platform arguments.
func test386OnAmd64RealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node, workerArgs: []string{"--platform-node-selector", "linux/386=kubernetes.io/arch=amd64"}})
	s.startWorker("w1")
	res := s.collect()
	base := goarchBase(t, node, "386")
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nARG TARGETPLATFORM\nARG TARGETARCH\nARG BUILDPLATFORM\nRUN [\"/hello\"]\n"})
	s.submitWith(dir, "i386", 1, func(r *v1.Request) {
		r.BuildArgs = map[string]string{"BASE": base}
		r.Platforms = []string{"linux/386"}
	})
	r := res.wait(t, 1, 5*time.Minute)[0]
	if !hostRuns386(t) {
		// This machine's kernel runs no 32-bit x86 programs (built
		// without IA32 emulation), and the real node is this machine:
		// the RUN cannot execute, and the user is told so.
		if r.Data.Status != v1.StatusFailed || r.Data.Reason != v1.ReasonPlatformUnsupported || !strings.Contains(r.Data.Message, "exec format error") {
			t.Fatalf("on a kernel without 32-bit x86 support: result %s, want failed/%s with the node's words", mustJSON(r), v1.ReasonPlatformUnsupported)
		}
		t.Log("this kernel runs no linux/386 programs: checked the PlatformUnsupported answer instead of a 386 RUN")
		return
	}
	if r.Data.Status != v1.StatusSucceeded {
		t.Fatalf("result %s", mustJSON(r))
	}
	ref := r.Data.Image + "@" + r.Data.Digest
	if cf := imageConfig(t, ref); cf.OS != "linux" || cf.Architecture != "386" {
		t.Errorf("image config names %s/%s, want linux/386", cf.OS, cf.Architecture)
	}
	files := imageFiles(t, ref)
	if got := string(files["arch"].body); got != "386" {
		t.Errorf("/arch holds %q, want 386 (the RUN ran the 386 program)", got)
	}
	if got := string(files["platform-args"].body); got != "linux/386 386 linux/amd64" {
		t.Errorf("/platform-args holds %q, want TARGETPLATFORM, TARGETARCH and BUILDPLATFORM \"linux/386 386 linux/amd64\"", got)
	}
}

// A platform no node runs (linux/s390x, default selector) is refused at
// once with InvalidRequest naming it and the selector; no Job is made.
func testPlatformWithoutNodeRefusedOnRealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node})
	pods := s.podsCreated()
	s.startWorker("w1")
	res := s.collect()
	dir := contextDir(t, map[string]string{"Dockerfile": "FROM scratch\nCOPY f /f\n", "f": "x"})
	start := time.Now()
	s.submitWith(dir, "s390x", 1, func(r *v1.Request) { r.Platforms = []string{"linux/s390x"} })
	r := res.wait(t, 1, 2*time.Minute)[0]
	took := time.Since(start)
	d := r.Data
	if d.Status != v1.StatusFailed || d.Reason != v1.ReasonInvalidRequest {
		t.Fatalf("result %s, want failed/%s", mustJSON(r), v1.ReasonInvalidRequest)
	}
	for _, want := range []string{"linux/s390x", "kubernetes.io/arch=s390x"} {
		if !strings.Contains(d.Message, want) {
			t.Errorf("message %q does not name %q", d.Message, want)
		}
	}
	jobs, err := shared.kube.BatchV1().Jobs(s.ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(jobs.Items) != 0 || d.Job != "" {
		t.Errorf("%d Jobs in the namespace (result's job %q), want none", len(jobs.Items), d.Job)
	}
	if n := pods(); n != 0 {
		t.Errorf("%d pods created, want none", n)
	}
	if took > 30*time.Second {
		t.Errorf("refused after %s: want at once", took)
	}
	t.Logf("refused in %s: %s", took.Round(100*time.Millisecond), d.Message)
}

// One request for linux/amd64 and linux/386 with a RUN: one Job per
// platform on the node (386 placed on amd64 by --platform-node-selector),
// an OCI image index at the destination naming both, each image's config
// naming its architecture and holding what its RUN wrote. Read back with
// crane, as a third party would. Then a one-platform request of the same
// inputs is a cache hit (no Pod), and linux/arm64 builds COPY-only.
//
// Origin: issue 29, tests.
func testImageIndexOnRealNode(t *testing.T, node *realNode) {
	s := newSuite(t, options{node: node, workerArgs: []string{
		"--platform-node-selector", "linux/386=kubernetes.io/arch=amd64",
		"--platform-node-selector", "linux/arm64=kubernetes.io/arch=amd64"}})
	pods := s.podsCreated()
	s.startWorker("w1")
	res := s.collect()
	base := goarchIndex(t, node, "amd64", "386", "arm64")
	dir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nRUN [\"/hello\"]\n"})
	start := time.Now()
	s.submitWith(dir, "multi", 1, func(r *v1.Request) {
		r.BuildArgs = map[string]string{"BASE": base}
		r.Platforms = []string{"linux/amd64", "linux/386"}
	})
	r := res.wait(t, 1, 8*time.Minute)[0]
	d := r.Data
	t.Logf("answered in %s", time.Since(start).Round(100*time.Millisecond))
	got := 1 // results so far
	if !hostRuns386(t) {
		// This kernel runs no 32-bit x86 programs (see test386OnAmd64RealNode):
		// linux/386's RUN fails the index with its own reason, and the
		// platform that built is listed.
		if d.Status != v1.StatusFailed || d.Reason != v1.ReasonPlatformUnsupported || !strings.Contains(d.Message, "platform linux/386") || d.Platforms["linux/amd64"] == "" {
			t.Fatalf("on a kernel without 32-bit x86 support: result %s, want failed/%s for linux/386 with linux/amd64 built", mustJSON(r), v1.ReasonPlatformUnsupported)
		}
		t.Log("this kernel runs no linux/386 programs: checked the index's PlatformUnsupported answer; the COPY-only index below still builds")
	} else {
		got = testIndexOf386(t, s, res, d, dir, base, pods)
	}
	testIndexCopyOnly(t, s, res, base, got)
}

// testIndexOf386 checks the index of linux/amd64 and linux/386 that
// succeeded (d), then a one-platform request answered from it; it returns
// how many results arrived.
func testIndexOf386(t *testing.T, s *suite, res *results, d v1.ResultData, dir, base string, pods func() int) int {
	t.Helper()
	if d.Status != v1.StatusSucceeded || len(d.Platforms) != 2 {
		t.Fatalf("result %s, want an index of two platforms", mustJSON(d))
	}
	if n := pods(); n != 2 {
		t.Errorf("%d pods ran, want one per platform", n)
	}
	opts := []crane.Option{crane.Insecure, crane.WithAuth(&authn.Basic{Username: shared.registryUser, Password: shared.registryPass})}
	raw, err := crane.Manifest(d.ImageRef, opts...)
	if err != nil {
		t.Fatal(err)
	}
	m, err := gcr.ParseIndexManifest(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != "application/vnd.oci.image.index.v1+json" || len(m.Manifests) != 2 {
		t.Fatalf("crane manifest %s:\n%s\nwant an OCI image index of two manifests", d.ImageRef, raw)
	}
	for _, desc := range m.Manifests {
		p := desc.Platform.String()
		if d.Platforms[p] != desc.Digest.String() {
			t.Errorf("the index names %s for %s, the result %s", desc.Digest, p, d.Platforms[p])
		}
	}
	for p, goarch := range map[string]string{"linux/amd64": "amd64", "linux/386": "386"} {
		cfg, err := crane.Config(d.ImageRef, append(opts, crane.WithPlatform(&gcr.Platform{OS: "linux", Architecture: goarch}))...)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := gcr.ParseConfigFile(bytes.NewReader(cfg))
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != goarch {
			t.Errorf("crane config --platform %s: architecture %s", p, cf.Architecture)
		}
		if got := string(imageFiles(t, d.Image+"@"+d.Platforms[p])["arch"].body); got != goarch {
			t.Errorf("%s's /arch holds %q, want %q (its RUN ran the %s program)", p, got, goarch, goarch)
		}
	}

	// One platform of it: from the cache, no Pod.
	s.submitWith(dir, "one", 1, func(r *v1.Request) {
		r.BuildArgs = map[string]string{"BASE": base}
		r.Platforms = []string{"linux/386"}
	})
	one := res.wait(t, 2, 2*time.Minute)[1].Data
	if one.Status != v1.StatusSucceeded || one.Origin != v1.OriginCache || one.Digest != d.Platforms["linux/386"] {
		t.Errorf("the one-platform request: %+v, want linux/386's image from the cache", one)
	}
	if n := pods(); n != 2 {
		t.Errorf("%d pods after the one-platform request, want still 2", n)
	}
	return 2
}

// testIndexCopyOnly: linux/arm64 without RUN builds on the amd64 node,
// in an index with linux/amd64; got results arrived before.
func testIndexCopyOnly(t *testing.T, s *suite, res *results, base string, got int) {
	t.Helper()
	copyDir := contextDir(t, map[string]string{"Dockerfile": "ARG BASE\nFROM $BASE\nCOPY f /f\n", "f": "copied"})
	s.submitWith(copyDir, "arm", 1, func(r *v1.Request) {
		r.BuildArgs = map[string]string{"BASE": base}
		r.Platforms = []string{"linux/amd64", "linux/arm64"}
	})
	arm := res.wait(t, got+1, 8*time.Minute)[got].Data
	if arm.Status != v1.StatusSucceeded || arm.Platforms["linux/arm64"] == "" {
		t.Fatalf("the arm64 COPY-only request: %+v", arm)
	}
	ref := arm.Image + "@" + arm.Platforms["linux/arm64"]
	if cf := imageConfig(t, ref); cf.Architecture != "arm64" {
		t.Errorf("linux/arm64's image config names %s", cf.Architecture)
	}
	if got := string(imageFiles(t, ref)["f"].body); got != "copied" {
		t.Errorf("linux/arm64's /f holds %q", got)
	}
}

// hostRuns386 reports whether this machine's kernel runs 32-bit x86
// programs: the real node is this machine, its containers share the
// kernel, and some kernels are built without IA32 emulation.
func hostRuns386(t *testing.T) bool {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte("package main\n\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "probe")
	cmd := exec.Command("go", "build", "-o", bin, "main.go")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOOS=linux", "GOARCH=386", "CGO_ENABLED=0", "GO111MODULE=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build a linux/386 probe: %v\n%s", err, out)
	}
	return exec.Command(bin).Run() == nil
}
