package sbom

// Attacks on the scanner of fe61488 (internal/sbom/syft.go): the worker's
// disk and memory, as a hostile tenant's image or a worker killed during
// a scan can spend them. A failing test is a break.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	ggcrregistry "github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// spdxFake is a fake syft that writes a small SPDX document.
const spdxFake = `out=""; prev=""
for a in "$@"; do
  case "$prev" in --output) out="${a#spdx-json=}";; esac
  prev="$a"
done
echo '{"spdxVersion":"SPDX-2.3","name":"x","packages":[]}' > "$out"`

// The size limit is the sum of the sizes the manifest declares. A tag a
// tenant pushed by hand (the worker answers a request with it: preflight)
// may declare a layer's size as -1, go-containerregistry's "unknown": the
// sum drops under --sbom-max-bytes, and the layer is then read whole (the
// registry's Content-Length is taken instead) onto the worker's disk.
func TestAttack_SBOMLayerOfUnknownSizeSlipsPastMaxBytes(t *testing.T) {
	srv := httptest.NewServer(ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	repo, err := name.NewRepository(host+"/mallory/app", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 1<<20)
	if _, err := rand.Read(big); err != nil {
		t.Fatal(err)
	}
	layer := static.NewLayer(big, types.OCILayer)
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	img = mutate.MediaType(img, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	if err := remote.Write(repo.Tag("real"), img); err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	m = m.DeepCopy()
	m.Layers[0].Size = -1
	raw, _ := json.Marshal(m)
	d, _, _ := v1.SHA256(bytes.NewReader(raw))
	ref := repo.Digest(d.String())
	if err := remote.Put(ref, rawManifestOf{raw: raw}); err != nil {
		t.Skipf("the registry refuses a manifest declaring size -1: %v", err)
	}
	remoteImg, err := remote.Image(ref)
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	limit := int64(64 << 10)
	// What reaches the disk: the fake measures the layout it is given.
	path, _ := fakeSyft(t, `dir=""; prev=""; out=""
for a in "$@"; do
  case "$prev" in scan) dir="$a";; --output) out="${a#spdx-json=}";; esac
  prev="$a"
done
du -sk "$dir" | cut -f1 > `+filepath.Join(tmp, "du")+`
echo '{"spdxVersion":"SPDX-2.3","name":"x","packages":[]}' > "$out"`)
	s := &Syft{Path: path, MaxBytes: limit, TempDir: tmp}
	_, err = s.Scan(context.Background(), remoteImg, ref.Context().Name(), d.String())
	du, _ := os.ReadFile(filepath.Join(tmp, "du"))
	if err == nil {
		t.Fatalf("a %d-byte layer declared as size -1 was written to the worker's disk (%s KiB of layout) and scanned, "+
			"past --sbom-max-bytes %d", len(big), strings.TrimSpace(string(du)), limit)
	}
}

// rawManifestOf is a manifest written as it is.
type rawManifestOf struct{ raw []byte }

func (r rawManifestOf) RawManifest() ([]byte, error) { return r.raw, nil }
func (r rawManifestOf) MediaType() (types.MediaType, error) {
	return types.OCIManifestSchema1, nil
}

// syft writes the document; the worker reads all of it into memory
// (os.ReadFile) before anything looks at its size, though no document over
// 3 MiB can be attached (attest.SBOMStatement). An image whose packages
// list makes a huge document (a tenant's own dpkg database) makes the
// worker — 512 MiB in deploy/base — hold all of it. Scan must refuse a
// document larger than an attachment holds without reading it whole.
func TestAttack_SBOMHugeDocumentIsReadWholeIntoMemory(t *testing.T) {
	path, _ := fakeSyft(t, `out=""; prev=""
for a in "$@"; do
  case "$prev" in --output) out="${a#spdx-json=}";; esac
  prev="$a"
done
{ printf '{"spdxVersion":"SPDX-2.3","name":"x","packages":[],"pad":"'; head -c 33554432 /dev/zero | tr '\0' x; printf '"}'; } > "$out"`)
	doc, err := (&Syft{Path: path}).Scan(context.Background(), dpkgImage(t), "r/x", "sha256:00")
	if err == nil {
		t.Fatalf("Scan read a %d MiB document into memory and returned it; want it refused (no attachment holds more than 3 MiB)", len(doc)>>20)
	}
}

// A worker killed during a scan (an OOM kill, a node drain past its grace
// period) never runs Scan's deferred RemoveAll: its directory, holding a
// copy of the image (up to --sbom-max-bytes) and whatever syft unpacked,
// stays in TempDir — /tmp, an emptyDir that outlives a container restart
// in deploy/base (sizeLimit 4Gi). Nothing removes it later: a few kills
// fill the emptyDir and the pod is evicted. A later scan (or the worker's
// start) must sweep the leftovers of scans no longer running.
func TestAttack_SBOMScanDirOfAKilledWorkerIsNeverRemoved(t *testing.T) {
	tmp := t.TempDir()
	stale := filepath.Join(tmp, "buildq-sbom-1234567")
	if err := os.MkdirAll(filepath.Join(stale, "image", "blobs", "sha256"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(stale, "image", "blobs", "sha256", "layer"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-48 * time.Hour)
	for _, p := range []string{filepath.Join(stale, "image", "blobs", "sha256", "layer"), stale} {
		if err := os.Chtimes(p, old, old); err != nil {
			t.Fatal(err)
		}
	}
	path, _ := fakeSyft(t, spdxFake)
	s := &Syft{Path: path, TempDir: tmp}
	if _, err := s.Scan(context.Background(), dpkgImage(t), "r/x", "sha256:00"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stale); err == nil {
		t.Fatalf("the scan directory %s a killed worker left two days ago is still there after another scan: nothing ever removes it", stale)
	}
}
