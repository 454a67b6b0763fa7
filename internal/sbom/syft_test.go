package sbom

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// dpkgImage is an image whose dpkg database lists one package.
func dpkgImage(t *testing.T) v1.Image {
	t.Helper()
	status := "Package: buildq-hello\nStatus: install ok installed\nPriority: optional\nSection: misc\nMaintainer: buildq <dev@buildq.invalid>\nArchitecture: amd64\nVersion: 1.2.3\nDescription: a package for the SBOM test\n"
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, d := range []string{"var/", "var/lib/", "var/lib/dpkg/"} {
		if err := tw.WriteHeader(&tar.Header{Name: d, Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.WriteHeader(&tar.Header{Name: "var/lib/dpkg/status", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(status))}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write([]byte(status)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// fakeSyft writes a script standing in for syft: it records its
// arguments and environment, and does what body says.
func fakeSyft(t *testing.T, body string) (path, record string) {
	t.Helper()
	dir := t.TempDir()
	record = filepath.Join(dir, "record")
	path = filepath.Join(dir, "syft")
	script := "#!/bin/sh\nprintf '%s\\n' \"$@\" > " + record + ".args\nenv > " + record + ".env\n" + body + "\n"
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path, record
}

func TestScanRunsSyftOnTheImageAloneWithoutTheWorkersEnvironment(t *testing.T) {
	t.Setenv("AWS_SECRET_ACCESS_KEY", "worker-secret")
	t.Setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
	// The fake writes an SPDX document where --output says, after
	// checking that the layout holds the image.
	path, record := fakeSyft(t, `out=""; dir=""
prev=""
for a in "$@"; do
  case "$prev" in --output) out="${a#spdx-json=}";; esac
  case "$prev" in scan) dir="$a";; esac
  prev="$a"
done
test -f "$dir/index.json" || { echo "no OCI layout at $dir" >&2; exit 3; }
echo '{"spdxVersion":"SPDX-2.3","name":"x","packages":[]}' > "$out"`)
	s := &Syft{Path: path}
	img := dpkgImage(t)
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	doc, err := s.Scan(context.Background(), img, "registry.test/acme/web", d.String())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "SPDX-2.3") {
		t.Fatalf("document %s", doc)
	}
	argsB, err := os.ReadFile(record + ".args")
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Split(strings.TrimSpace(string(argsB)), "\n")
	for _, want := range [][]string{{"--from", "oci-dir"}, {"--source-name", "registry.test/acme/web"}, {"--source-version", d.String()}} {
		i := slices.Index(args, want[0])
		if i < 0 || i+1 >= len(args) || args[i+1] != want[1] {
			t.Errorf("syft's arguments %q lack %s %s", args, want[0], want[1])
		}
	}
	envB, err := os.ReadFile(record + ".env")
	if err != nil {
		t.Fatal(err)
	}
	for _, leak := range []string{"worker-secret", "proxy.invalid"} {
		if strings.Contains(string(envB), leak) {
			t.Errorf("syft's environment holds the worker's %q:\n%s", leak, envB)
		}
	}
	if !strings.Contains(string(envB), "SYFT_CHECK_FOR_APP_UPDATE=false") {
		t.Errorf("syft's environment does not turn off its update check:\n%s", envB)
	}
}

func TestScanSaysWhySyftFailed(t *testing.T) {
	path, _ := fakeSyft(t, `echo "loading image" >&2; echo "unable to catalog: boom" >&2; exit 1`)
	_, err := (&Syft{Path: path}).Scan(context.Background(), dpkgImage(t), "r/x", "sha256:00")
	var se *ScanError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), "unable to catalog: boom") {
		t.Fatalf("error %v; want a ScanError with syft's words", err)
	}
}

func TestScanOfNoDocumentIsAnError(t *testing.T) {
	path, _ := fakeSyft(t, `exit 0`)
	_, err := (&Syft{Path: path}).Scan(context.Background(), dpkgImage(t), "r/x", "sha256:00")
	var se *ScanError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), "no SBOM written") {
		t.Fatalf("error %v; want no SBOM written", err)
	}
}

func TestScanRefusesAnImageLargerThanItsLimit(t *testing.T) {
	path, record := fakeSyft(t, `exit 0`)
	_, err := (&Syft{Path: path, MaxBytes: 10}).Scan(context.Background(), dpkgImage(t), "r/x", "sha256:00")
	var se *ScanError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), "--sbom-max-bytes") {
		t.Fatalf("error %v; want the limit named", err)
	}
	if _, err := os.Stat(record + ".args"); err == nil {
		t.Fatal("syft ran on an image over the limit")
	}
}
