package attest

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
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
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

func testBuild(digest string) Build {
	return Build{
		Subjects:        []Subject{{Name: "registry.test/acme/app", Digest: digest}},
		Key:             strings.Repeat("ab", 32),
		Source:          Source{ContextDigest: "sha256:" + strings.Repeat("1", 64)},
		Dockerfile:      "Dockerfile",
		BuildArgs:       map[string]string{"VERSION": "1.2", "TOKEN": "hunter2"},
		SecretBuildArgs: []string{"TOKEN"},
		Platforms:       []string{"linux/amd64"},
		Bases:           []Dependency{{URI: "registry.test/base/alpine:3", Digest: "sha256:" + strings.Repeat("2", 64)}},
		Executor:        Dependency{URI: "registry.test/kaniko/executor", Digest: "sha256:" + strings.Repeat("3", 64)},
		Worker:          "worker-1",
		InvocationID:    "req-1",
		StartedOn:       time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC),
		FinishedOn:      time.Date(2026, 12, 1, 10, 1, 0, 0, time.UTC),
	}
}

func TestStatementIsValidSLSAProvenanceWithSecretsMasked(t *testing.T) {
	digest := "sha256:" + strings.Repeat("f", 64)
	st, err := Statement(testBuild(digest))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(st), "hunter2") {
		t.Fatalf("a secret build argument's value is in the statement: %s", st)
	}
	p, err := ParseStatement(st)
	if err != nil {
		t.Fatalf("the statement does not validate: %v\n%s", err, st)
	}
	var raw map[string]any
	if err := json.Unmarshal(st, &raw); err != nil {
		t.Fatal(err)
	}
	if raw["_type"] != "https://in-toto.io/Statement/v1" || raw["predicateType"] != PredicateSLSAProvenance {
		t.Fatalf("statement type %v, predicate type %v", raw["_type"], raw["predicateType"])
	}
	if len(p.Subjects) != 1 || p.Subjects[0].Digest != digest {
		t.Fatalf("subjects %v", p.Subjects)
	}
	args := p.External["buildArgs"].(map[string]any)
	if args["TOKEN"] != Masked || args["VERSION"] != "1.2" {
		t.Fatalf("build args %v", args)
	}
	if p.InvocationID != "req-1" || p.Worker != "worker-1" || p.BuilderID != DefaultBuilderID || p.BuildKey != strings.Repeat("ab", 32) {
		t.Fatalf("run details %+v", p)
	}
	names := map[string]string{}
	for _, d := range p.Dependencies {
		names[d.Name] = d.Digest
	}
	if names["context"] != "sha256:"+strings.Repeat("1", 64) || names["base"] != "sha256:"+strings.Repeat("2", 64) || names["executor"] != "sha256:"+strings.Repeat("3", 64) {
		t.Fatalf("resolved dependencies %v", p.Dependencies)
	}
	if !p.StartedOn.Equal(testBuild(digest).StartedOn) || !p.FinishedOn.Equal(testBuild(digest).FinishedOn) {
		t.Fatalf("times %v %v", p.StartedOn, p.FinishedOn)
	}
}

func TestStatementRefusesWhatIsNotADigest(t *testing.T) {
	if _, err := Statement(Build{}); err == nil {
		t.Fatal("a statement without a subject was made")
	}
	b := testBuild("not-a-digest")
	if _, err := Statement(b); err == nil {
		t.Fatal("a subject without a digest was accepted")
	}
}

func signers(t *testing.T) map[string]*Signer {
	t.Helper()
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*Signer{}
	for n, k := range map[string]any{"ecdsa-p256": ec, "ed25519": ed} {
		s, err := NewSigner(k)
		if err != nil {
			t.Fatal(n, err)
		}
		out[n] = s
	}
	return out
}

func TestSignedBundleVerifiesOnlyUnderItsKeyAndUnchanged(t *testing.T) {
	st, err := Statement(testBuild("sha256:" + strings.Repeat("f", 64)))
	if err != nil {
		t.Fatal(err)
	}
	all := signers(t)
	for n, s := range all {
		t.Run(n, func(t *testing.T) {
			b, err := s.Sign(st)
			if err != nil {
				t.Fatal(err)
			}
			v, err := NewVerifier(s.PublicKeyPEM())
			if err != nil {
				t.Fatal(err)
			}
			got, err := v.Open(b)
			if err != nil {
				t.Fatalf("own bundle does not verify: %v", err)
			}
			if string(got) != string(st) {
				t.Fatal("the verified statement is not the one signed")
			}
			for on, other := range all {
				if on == n {
					continue
				}
				ov, err := NewVerifier(other.PublicKeyPEM())
				if err != nil {
					t.Fatal(err)
				}
				if _, err := ov.Open(b); !errors.Is(err, ErrNotVerified) {
					t.Fatalf("verified under another key (%s): %v", on, err)
				}
			}
			// Change one byte of the signed statement.
			var bb bundle
			if err := json.Unmarshal(b, &bb); err != nil {
				t.Fatal(err)
			}
			bb.DSSEEnvelope.Payload[len(bb.DSSEEnvelope.Payload)/2] ^= 1
			changed, _ := json.Marshal(bb)
			if _, err := v.Open(changed); !errors.Is(err, ErrNotVerified) {
				t.Fatalf("a changed statement verified: %v", err)
			}
		})
	}
}

func TestLoadSignerRefusesOtherKeys(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "p384.pem")
	k, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if _, err := NewSigner(k); err == nil || !strings.Contains(err.Error(), "P-256") {
		t.Fatalf("a P-384 key: %v", err)
	}
	if err := os.WriteFile(bad, []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadSigner(bad); err == nil || !strings.Contains(err.Error(), bad) {
		t.Fatalf("a file that is not a key: %v", err)
	}
	if _, err := LoadSigner(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("a missing key file loaded")
	}
}

func TestEnsureKeyPairMakesOneAndKeepsIt(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	s1, created, err := EnsureKeyPair(dir)
	if err != nil || !created {
		t.Fatalf("first start: created=%v err=%v", created, err)
	}
	fi, err := os.Stat(filepath.Join(dir, PrivateKeyFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("private key file: %v %v", fi, err)
	}
	if err := os.Remove(filepath.Join(dir, PublicKeyFile)); err != nil {
		t.Fatal(err)
	}
	s2, created, err := EnsureKeyPair(dir)
	if err != nil || created {
		t.Fatalf("second start: created=%v err=%v", created, err)
	}
	if string(s1.PublicKeyPEM()) != string(s2.PublicKeyPEM()) {
		t.Fatal("the second start made another key")
	}
	pub, err := os.ReadFile(filepath.Join(dir, PublicKeyFile))
	if err != nil || string(pub) != string(s1.PublicKeyPEM()) {
		t.Fatalf("signing.pub is not the key's public half: %v", err)
	}
}

// pushRandom pushes a random image to host/repo:tag and returns its
// digest reference.
func pushRandom(t *testing.T, host, repo string) name.Digest {
	t.Helper()
	img, err := random.Image(256, 1)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(host+"/"+repo+":v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, img); err != nil {
		t.Fatal(err)
	}
	d, _ := img.Digest()
	return tag.Context().Digest(d.String())
}

func TestAttachFindVerifyAndCopy(t *testing.T) {
	for _, referrersAPI := range []bool{true, false} {
		mode := "referrers-api"
		if !referrersAPI {
			mode = "referrers-tag"
		}
		t.Run(mode, func(t *testing.T) {
			srv := httptest.NewServer(ggcrregistry.New(ggcrregistry.Logger(log.New(io.Discard, "", 0)), ggcrregistry.WithReferrersSupport(referrersAPI)))
			defer srv.Close()
			host := strings.TrimPrefix(srv.URL, "http://")
			ctx := context.Background()
			img := pushRandom(t, host, "acme/app")
			s := signers(t)["ecdsa-p256"]
			b := testBuild(img.DigestStr())
			st, err := Statement(b)
			if err != nil {
				t.Fatal(err)
			}
			bundleJSON, err := s.Sign(st)
			if err != nil {
				t.Fatal(err)
			}
			ref, err := Attach(ctx, img, bundleJSON, b.FinishedOn, nil)
			if err != nil {
				t.Fatal(err)
			}
			again, err := Attach(ctx, img, bundleJSON, b.FinishedOn, nil)
			if err != nil || again != ref {
				t.Fatalf("attaching the same bundle again wrote %s (first %s): %v", again, ref, err)
			}
			v, _ := NewVerifier(s.PublicKeyPEM())
			p, err := Verify(ctx, img, v, nil)
			if err != nil {
				t.Fatal(err)
			}
			if p.Referrer != ref || p.InvocationID != "req-1" {
				t.Fatalf("verified %+v", p)
			}
			other, _ := NewVerifier(signers(t)["ed25519"].PublicKeyPEM())
			if _, err := Verify(ctx, img, other, nil); !errors.Is(err, ErrNotVerified) {
				t.Fatalf("verified under another key: %v", err)
			}
			// An image without provenance does not verify.
			bare := pushRandom(t, host, "acme/bare")
			if _, err := Verify(ctx, bare, v, nil); !errors.Is(err, ErrNotVerified) {
				t.Fatalf("an image without provenance: %v", err)
			}
			// A statement about another image, attached to this one.
			otherImg := pushRandom(t, host, "acme/other")
			if _, err := Attach(ctx, otherImg, bundleJSON, b.FinishedOn, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := Verify(ctx, otherImg, v, nil); !errors.Is(err, ErrNotVerified) || !strings.Contains(err.Error(), "not "+otherImg.DigestStr()) {
				t.Fatalf("a statement about another image verified for it: %v", err)
			}
			// Copied with the image to another repository, it verifies there.
			dst, _ := name.NewRepository(host+"/globex/app", name.Insecure)
			src, _ := remote.Image(img)
			if err := remote.Write(dst.Digest(img.DigestStr()), src); err != nil {
				t.Fatal(err)
			}
			if err := Copy(ctx, img.Context().Digest(ref), dst, nil, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := Verify(ctx, dst.Digest(img.DigestStr()), v, nil); err != nil {
				t.Fatalf("the copy does not verify: %v", err)
			}
		})
	}
}

// Keys as openssl writes them (PKCS#8 "PRIVATE KEY", and SEC 1 "EC
// PRIVATE KEY") load, and sign what their public halves verify.
func TestLoadSignerReadsPKCS8AndSEC1Keys(t *testing.T) {
	dir := t.TempDir()
	ec, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	_, ed, _ := ed25519.GenerateKey(rand.Reader)
	ecDER, err := x509.MarshalECPrivateKey(ec)
	if err != nil {
		t.Fatal(err)
	}
	edDER, err := x509.MarshalPKCS8PrivateKey(ed)
	if err != nil {
		t.Fatal(err)
	}
	for n, blk := range map[string]*pem.Block{"ec.pem": {Type: "EC PRIVATE KEY", Bytes: ecDER}, "ed.pem": {Type: "PRIVATE KEY", Bytes: edDER}} {
		p := filepath.Join(dir, n)
		if err := os.WriteFile(p, pem.EncodeToMemory(blk), 0o600); err != nil {
			t.Fatal(err)
		}
		s, err := LoadSigner(p)
		if err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		b, err := s.Sign([]byte(`{"x":1}`))
		if err != nil {
			t.Fatal(err)
		}
		v, err := NewVerifier(s.PublicKeyPEM())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Open(b); err != nil {
			t.Fatalf("%s: %v", n, err)
		}
	}
}

func BenchmarkStatementAndSign(b *testing.B) {
	k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	s, err := NewSigner(k)
	if err != nil {
		b.Fatal(err)
	}
	build := testBuild("sha256:" + strings.Repeat("f", 64))
	for b.Loop() {
		st, err := Statement(build)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := s.Sign(st); err != nil {
			b.Fatal(err)
		}
	}
}
