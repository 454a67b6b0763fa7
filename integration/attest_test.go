//go:build integration

package integration

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
)

// Issue 30: the provenance `buildq dev` attaches to what it builds is
// checked by a third party — cosign, built from its Go module — as a user
// would: `cosign verify-attestation --key … --type slsaprovenance1
// --insecure-ignore-tlog` accepts it under dev's key, refuses it under
// another key, and refuses a statement with one byte changed. `buildq
// verify` agrees on all three.
func TestDevAttestationsVerifyWithCosign(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	data := t.TempDir()
	addrs := map[string]string{"nats": freeAddr(), "s3": freeAddr(), "registry": freeAddr(), "gateway": freeAddr()}
	env := append(os.Environ(), "NATS_URL=nats://"+addrs["nats"], "BUILDQ_S3_ENDPOINT=http://"+addrs["s3"])
	line := startReadmeDev(t, root, env, addrs, "--data", data)
	pub := filepath.Join(data, attest.PublicKeyFile)
	if !strings.Contains(line, "signing-key="+pub) {
		t.Fatalf("dev's ready line does not name its public key %s: %s", pub, line)
	}
	ctxDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM scratch\nCOPY hello /hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ctxDir, "hello"), []byte("attested\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(bin string, args ...string) (string, int) {
		t.Helper()
		return runTool(t, env, bin, args...)
	}
	buildq := filepath.Join(shared.bin, "buildq")
	cosign := filepath.Join(shared.tools, "cosign")
	out, code := run(buildq, "submit", ctxDir, "--name", "attested", "--wait", "-o", "json")
	if code != 0 {
		t.Fatalf("submit: exit %d\n%s", code, out)
	}
	var res v1.ResultData
	if err := json.Unmarshal([]byte(out[strings.LastIndex(out, "\n{")+1:]), &res); err != nil {
		t.Fatalf("submit -o json: %v\n%s", err, out)
	}
	if res.Status != v1.StatusSucceeded || res.Attestation == "" {
		t.Fatalf("result %+v, want a success with an attestation", res)
	}
	cosignVerify := func(key, image string) (string, int) {
		return run(cosign, "verify-attestation", "--key", key, "--type", "slsaprovenance1", "--insecure-ignore-tlog", "--allow-http-registry", image)
	}

	// Accepted under dev's key; the payload cosign prints is the statement.
	out, code = cosignVerify(pub, res.ImageRef)
	if code != 0 {
		t.Fatalf("cosign refuses buildq's attestation (exit %d):\n%s", code, out)
	}
	var env1 struct {
		Payload string `json:"payload"`
	}
	if err := json.Unmarshal([]byte(firstJSONLine(out)), &env1); err != nil {
		t.Fatalf("cosign's output: %v\n%s", err, out)
	}
	statement, err := base64.StdEncoding.DecodeString(env1.Payload)
	if err != nil {
		t.Fatal(err)
	}
	p, err := attest.ParseStatement(statement)
	if err != nil {
		t.Fatalf("the statement cosign verified does not validate as in-toto with SLSA provenance: %v", err)
	}
	if p.InvocationID != res.RequestID || len(p.Subjects) != 1 || p.Subjects[0].Digest != res.Digest {
		t.Fatalf("the statement is about %+v for %s, want %s for %s", p.Subjects, p.InvocationID, res.Digest, res.RequestID)
	}
	if out, code := run(buildq, "verify", res.ImageRef, "--key", pub); code != 0 || !strings.Contains(out, "Verified: "+res.ImageRef) {
		t.Fatalf("buildq verify: exit %d\n%s", code, out)
	}

	// Refused under another key.
	other := t.TempDir()
	if _, _, err := attest.EnsureKeyPair(other); err != nil {
		t.Fatal(err)
	}
	otherPub := filepath.Join(other, attest.PublicKeyFile)
	if out, code := cosignVerify(otherPub, res.ImageRef); code == 0 {
		t.Fatalf("cosign accepts buildq's attestation under another key:\n%s", out)
	}
	if out, code := run(buildq, "verify", res.ImageRef, "--key", otherPub); code != 1 {
		t.Fatalf("buildq verify under another key: exit %d, want 1\n%s", code, out)
	}

	// One byte of the statement changed, attached to a copy of the image
	// in a repository of its own (the original's stays as it was).
	ctx := context.Background()
	src, err := name.NewDigest(res.ImageRef)
	if err != nil {
		t.Fatal(err)
	}
	found, err := attest.Find(ctx, src, nil)
	if err != nil || len(found) != 1 {
		t.Fatalf("attachments of %s: %d, %v", src, len(found), err)
	}
	var b map[string]any
	if err := json.Unmarshal(found[0].Bundle, &b); err != nil {
		t.Fatal(err)
	}
	dsse := b["dsseEnvelope"].(map[string]any)
	payload, err := base64.StdEncoding.DecodeString(dsse["payload"].(string))
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(string(payload), `"invocationId":"`) + len(`"invocationId":"`)
	payload[i] ^= 0x01
	dsse["payload"] = base64.StdEncoding.EncodeToString(payload)
	tampered, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	copyRepo := src.Context().RegistryStr() + "/default/tampered"
	dst, err := name.NewDigest(copyRepo + "@" + res.Digest)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(dst, img); err != nil {
		t.Fatal(err)
	}
	if _, err := attest.Attach(ctx, dst, tampered, time.Now(), nil); err != nil {
		t.Fatal(err)
	}
	if out, code := cosignVerify(pub, dst.String()); code == 0 {
		t.Fatalf("cosign accepts a statement with a byte changed:\n%s", out)
	}
	if out, code := run(buildq, "verify", dst.String(), "--key", pub); code != 1 {
		t.Fatalf("buildq verify of a changed statement: exit %d, want 1\n%s", code, out)
	}
}

// runTool runs bin with args in env (bounded to 5 minutes) and returns
// its combined output and exit code.
func runTool(t *testing.T, env []string, bin string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &ee):
		return string(out), ee.ExitCode()
	default:
		t.Fatalf("%s %v: %v\n%s", bin, args, err, out)
		return "", -1
	}
}

// firstJSONLine is the first line of out that is a JSON object.
func firstJSONLine(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "{") {
			return l
		}
	}
	return ""
}
