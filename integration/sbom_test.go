//go:build integration

package integration

import (
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
)

// Issue 30, item 3: `buildq dev --sbom-scanner` (syft, built from its Go
// module into the tools cache) attaches a signed SPDX SBOM to the image
// of a request that asks for one (`submit --sbom`), beside its
// provenance. cosign verifies it as a user would (`verify-attestation
// --type spdxjson`), the document lists the dpkg package the image
// holds, and `buildq verify` names it. A request that does not ask gets
// none, and costs no scan.
func TestDevSBOMVerifiesWithCosign(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	syft := filepath.Join(shared.tools, "syft")
	data := t.TempDir()
	addrs := map[string]string{"nats": freeAddr(), "s3": freeAddr(), "registry": freeAddr(), "gateway": freeAddr()}
	env := append(os.Environ(), "NATS_URL=nats://"+addrs["nats"], "BUILDQ_S3_ENDPOINT=http://"+addrs["s3"])
	startReadmeDev(t, root, env, addrs, "--data", data, "--sbom-scanner", syft)
	pub := filepath.Join(data, attest.PublicKeyFile)
	ctxDir := t.TempDir()
	status := "Package: buildq-hello\nStatus: install ok installed\nPriority: optional\nSection: misc\nMaintainer: buildq <dev@buildq.invalid>\nArchitecture: amd64\nVersion: 1.2.3\nDescription: a package for the SBOM test\n"
	if err := os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM scratch\nCOPY status /var/lib/dpkg/status\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ctxDir, "status"), []byte(status), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(bin string, args ...string) (string, int) {
		t.Helper()
		return runTool(t, env, bin, args...)
	}
	buildq := filepath.Join(shared.bin, "buildq")
	submit := func(extra ...string) (v1.ResultData, time.Duration) {
		t.Helper()
		began := time.Now()
		out, code := run(buildq, append([]string{"submit", ctxDir, "--name", "sbom", "--wait", "-o", "json"}, extra...)...)
		took := time.Since(began)
		if code != 0 {
			t.Fatalf("submit %v: exit %d\n%s", extra, code, out)
		}
		var res v1.ResultData
		if err := json.Unmarshal([]byte(out[strings.LastIndex(out, "\n{")+1:]), &res); err != nil {
			t.Fatalf("submit -o json: %v\n%s", err, out)
		}
		return res, took
	}

	// Not asked: built and attested, no SBOM.
	plain, _ := submit()
	if plain.Status != v1.StatusSucceeded || plain.Attestation == "" || plain.SBOM != "" {
		t.Fatalf("result %+v, want a success with provenance and no SBOM", plain)
	}
	// A cache hit without an SBOM: the cost of answering alone.
	hit, hitTook := submit()
	// Asked: the same image, its SBOM made now.
	asked, askedTook := submit("--sbom")
	if asked.Status != v1.StatusSucceeded || asked.SBOM == "" || asked.Digest != plain.Digest || hit.SBOM != "" {
		t.Fatalf("results %+v / %+v, want the same image with an SBOM", hit, asked)
	}
	t.Logf("measured: a cache hit %s; with its SBOM made (syft on a 1-file image, signed, attached) %s",
		hitTook.Round(time.Millisecond), askedTook.Round(time.Millisecond))

	cosign := filepath.Join(shared.tools, "cosign")
	out, code := run(cosign, "verify-attestation", "--key", pub, "--type", "spdxjson", "--insecure-ignore-tlog", "--allow-http-registry", asked.ImageRef)
	if code != 0 {
		t.Fatalf("cosign refuses buildq's SBOM (exit %d):\n%s", code, out)
	}
	var envl struct {
		Payload string `json:"payload"`
	}
	if err := json.Unmarshal([]byte(firstJSONLine(out)), &envl); err != nil {
		t.Fatalf("cosign's output: %v\n%s", err, out)
	}
	statement, err := base64.StdEncoding.DecodeString(envl.Payload)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := attest.ParseSBOMStatement(statement)
	if err != nil {
		t.Fatalf("the statement cosign verified is not an SPDX SBOM: %v", err)
	}
	if len(sb.Subjects) != 1 || sb.Subjects[0].Digest != asked.Digest || !slices.Contains(sb.Packages, "buildq-hello@1.2.3") {
		t.Fatalf("the SBOM is about %+v and lists %v; want %s with buildq-hello@1.2.3", sb.Subjects, sb.Packages, asked.Digest)
	}
	// The provenance still verifies with cosign beside it.
	if out, code := run(cosign, "verify-attestation", "--key", pub, "--type", "slsaprovenance1", "--insecure-ignore-tlog", "--allow-http-registry", asked.ImageRef); code != 0 {
		t.Fatalf("cosign refuses the provenance beside the SBOM (exit %d):\n%s", code, out)
	}
	out, code = run(buildq, "verify", asked.ImageRef, "--key", pub)
	if code != 0 || !strings.Contains(out, "sbom") || !strings.Contains(out, asked.SBOM) {
		t.Fatalf("buildq verify: exit %d, want the SBOM %s named\n%s", code, asked.SBOM, out)
	}
	// Under another key, cosign refuses the SBOM.
	other := t.TempDir()
	if _, _, err := attest.EnsureKeyPair(other); err != nil {
		t.Fatal(err)
	}
	if out, code := run(cosign, "verify-attestation", "--key", filepath.Join(other, attest.PublicKeyFile), "--type", "spdxjson", "--insecure-ignore-tlog", "--allow-http-registry", asked.ImageRef); code == 0 {
		t.Fatalf("cosign accepts buildq's SBOM under another key:\n%s", out)
	}
}
