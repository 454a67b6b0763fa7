//go:build integration

package integration

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/attest"
)

// checkRealNodeProvenance verifies the attestation of the image d names
// under pub, and that it names base as the one base image, by the digest
// whose layers begin the built image's.
func checkRealNodeProvenance(t *testing.T, s *suite, d v1.ResultData, pub, base string) {
	t.Helper()
	ctx := context.Background()
	v, err := attest.LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := name.NewDigest(strings.SplitN(d.ImageRef, "@", 2)[0]+"@"+d.Digest, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	opts := s.regClient.RemoteOptions(ctx)
	p, err := attest.Verify(ctx, ref, v, opts)
	if err != nil {
		t.Fatalf("the built image's provenance: %v", err)
	}
	if p.Referrer != d.Attestation || p.InvocationID != d.RequestID {
		t.Fatalf("provenance %s for %s, the result names %s for %s", p.Referrer, p.InvocationID, d.Attestation, d.RequestID)
	}
	var bases []attest.Dependency
	for _, dep := range p.Dependencies {
		if dep.Name == "base" {
			bases = append(bases, dep)
		}
	}
	if len(bases) != 1 || bases[0].URI != base {
		t.Fatalf("base images %+v, want %s once", bases, base)
	}
	built, err := remote.Image(ref, opts...)
	if err != nil {
		t.Fatal(err)
	}
	br, err := name.ParseReference(base, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	baseRef := br.Context().Digest(bases[0].Digest)
	baseImg, err := remote.Image(baseRef, opts...)
	if err != nil {
		t.Fatalf("the base image the provenance names (%s): %v", baseRef, err)
	}
	bl, err := baseImg.Layers()
	if err != nil {
		t.Fatal(err)
	}
	il, err := built.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(bl) == 0 || len(bl) > len(il) {
		t.Fatalf("base %s has %d layers, the built image %d", baseRef, len(bl), len(il))
	}
	for i := range bl {
		bd, _ := bl[i].Digest()
		id, _ := il[i].Digest()
		if bd != id {
			t.Fatalf("layer %d of the built image is %s, of the base the provenance names %s", i, id, bd)
		}
	}
	if df, _ := p.External["dockerfile"].(map[string]any); df["digest"] == nil {
		t.Fatalf("the provenance names no Dockerfile digest: %v", p.External)
	}
	if ex := func() string {
		for _, dep := range p.Dependencies {
			if dep.Name == "executor" {
				return dep.URI + "@" + dep.Digest
			}
		}
		return ""
	}(); ex != s.executorImage {
		t.Fatalf("executor %q, want %s", ex, s.executorImage)
	}
}
