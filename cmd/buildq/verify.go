package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/spf13/cobra"

	"github.com/buildq/buildq/internal/attest"
	"github.com/buildq/buildq/internal/registry"
)

func newVerifyCmd() *cobra.Command {
	var (
		key            string
		output         string
		registryConfig string
		insecure       []string
	)
	cmd := &cobra.Command{
		Use:   "verify IMAGE --key PUB",
		Short: "Check the signed provenance of an image buildq built",
		Long: `Check the signed provenance of an image buildq built, and print it.

buildq attaches to every image it builds (each platform's image, and the
image index of a multi-platform build) an in-toto statement with SLSA v1
provenance, in a DSSE envelope signed with the deployment's key, as an OCI
1.1 referrer holding a Sigstore bundle (on registries without the referrers
API, under the referrers tag sha256-<hex>). verify finds it, checks the
signature against --key (the deployment's PEM public key; buildq dev keeps
its own at <data dir>/signing.pub), checks that the statement is about
IMAGE's digest, and prints what it says: the source, the Dockerfile, the
base images and executor by digest, the request, the builder. When the
build was asked for an SBOM (submit --sbom), the SPDX SBOM attached beside
the provenance is checked under the same key and named with its package
count (-o json: the document itself).

The same attestations verify with cosign:
  cosign verify-attestation --key PUB --type slsaprovenance1 --insecure-ignore-tlog IMAGE
  cosign verify-attestation --key PUB --type spdxjson --insecure-ignore-tlog IMAGE

The image is named repo:tag or repo@sha256:...; a tag is resolved to its digest
first. Registries on loopback and private addresses are reached over plain
HTTP, as are those named by --insecure-registry.

Exit codes:
  0    the provenance verifies
  1    it does not (no attestation, another key, a changed statement, a
       statement about another image), or the registry could not be read:
       stderr says which
  2    invalid input or usage`,
		Example: `  buildq verify 127.0.0.1:5000/dev/hello:3f2a9c1d5b7e --key ~/.buildq/signing.pub
  buildq verify registry.example.com/acme/app@sha256:... --key buildq.pub -o json | jq .`,
		Args: exactArgs(1, "IMAGE"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if key == "" {
				return usageErr("--key is required: the PEM public key of the deployment that built the image")
			}
			if output != "text" && output != "json" {
				return usageErr("-o must be text or json, got %q", output)
			}
			v, err := attest.LoadVerifier(key)
			if err != nil {
				return usageErr("--key: %v", err)
			}
			reg, err := registry.New(registry.Options{DockerConfig: registryConfig, Insecure: insecure})
			if err != nil {
				return usageErr("%v", err)
			}
			ref, err := name.ParseReference(args[0])
			if err != nil {
				return usageErr("%q is not an image reference: %v", args[0], err)
			}
			ref, err = reg.ParseReference(ref.Name())
			if err != nil {
				return usageErr("%v", err)
			}
			ctx := cmd.Context()
			d, ok := ref.(name.Digest)
			if !ok {
				digest, err := reg.Head(ctx, ref.Name())
				if err != nil {
					return failed(fmt.Errorf("resolve %s: %w", ref.Name(), err))
				}
				d = ref.Context().Digest(digest)
			}
			p, err := attest.Verify(ctx, d, v, reg.RemoteOptions(ctx))
			if err != nil {
				if errors.Is(err, attest.ErrNotVerified) {
					return failed(fmt.Errorf("%s: NOT verified: %w", d, err))
				}
				return failed(err)
			}
			// An SBOM, when the build was asked for one: the same key
			// signs it. Not finding one is not a failure of the
			// provenance.
			sb, err := attest.FindSBOM(ctx, d, v, reg.RemoteOptions(ctx))
			if err != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: looking for an SBOM: %v\n", err)
			}
			if output == "json" {
				return printVerifiedJSON(cmd.OutOrStdout(), d, p, sb)
			}
			printVerified(cmd.OutOrStdout(), d, p)
			if sb != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "  %-12s %s (%s, %d packages, signature checked)\n", "sbom", sb.Referrer, sb.SPDXVersion, len(sb.Packages))
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&key, "key", "", "PEM public key of the deployment that built the image (required)")
	fs.StringVarP(&output, "output", "o", "text", "text, or json: the verified in-toto statement with the referrer's digest")
	fs.StringVar(&registryConfig, "registry-config", "", "docker config.json with credentials to read the image (empty: anonymous)")
	fs.StringSliceVar(&insecure, "insecure-registry", nil, "registry (host:port) reached over plain HTTP (repeatable)")
	return cmd
}

func printVerifiedJSON(w io.Writer, d name.Digest, p *attest.Provenance, sb *attest.SBOM) error {
	type sbomOut struct {
		Referrer    string          `json:"referrer"`
		SPDXVersion string          `json:"spdxVersion"`
		Packages    []string        `json:"packages"`
		Document    json.RawMessage `json:"document"`
	}
	out := struct {
		Image       string          `json:"image"`
		Verified    bool            `json:"verified"`
		Attestation string          `json:"attestation"`
		Statement   json.RawMessage `json:"statement"`
		SBOM        *sbomOut        `json:"sbom,omitempty"`
	}{Image: d.String(), Verified: true, Attestation: p.Referrer, Statement: p.Statement}
	if sb != nil {
		out.SBOM = &sbomOut{Referrer: sb.Referrer, SPDXVersion: sb.SPDXVersion, Packages: sb.Packages, Document: sb.Document}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func printVerified(w io.Writer, d name.Digest, p *attest.Provenance) {
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(w, "  %-12s %s\n", k, v)
		}
	}
	fmt.Fprintf(w, "Verified: %s\n", d)
	row("attestation", p.Referrer+" (SLSA provenance v1, signature checked)")
	builder := p.BuilderID
	if p.Worker != "" {
		builder += " (worker " + p.Worker + ")"
	}
	row("builder", builder)
	row("request", p.InvocationID)
	row("build key", p.BuildKey)
	src, _ := p.External["source"].(map[string]any)
	if git, ok := src["git"].(map[string]any); ok {
		s := fmt.Sprintf("git %v @ %v", git["url"], git["commit"])
		if ref, _ := git["ref"].(string); ref != "" {
			s += " (" + ref + ")"
		}
		if sub, _ := git["subPath"].(string); sub != "" {
			s += " subPath " + sub
		}
		row("source", s)
	}
	if cd, _ := src["contextDigest"].(string); cd != "" {
		row("context", cd)
	}
	if df, ok := p.External["dockerfile"].(map[string]any); ok {
		s, _ := df["path"].(string)
		if dg, _ := df["digest"].(string); dg != "" {
			s += " (" + dg + ")"
		}
		row("dockerfile", s)
	}
	if t, _ := p.External["target"].(string); t != "" {
		row("target", t)
	}
	if ps, ok := p.External["platforms"].([]any); ok {
		var names []string
		for _, x := range ps {
			names = append(names, fmt.Sprint(x))
		}
		row("platforms", strings.Join(names, ", "))
	}
	if args, ok := p.External["buildArgs"].(map[string]any); ok && len(args) > 0 {
		var kv []string
		for k, v := range args {
			kv = append(kv, fmt.Sprintf("%s=%v", k, v))
		}
		slices.Sort(kv)
		row("build args", strings.Join(kv, " "))
	}
	for _, dep := range p.Dependencies {
		switch dep.Name {
		case "context":
		case "executor":
			row("executor", dep.URI+"@"+dep.Digest)
		case "base":
			row("base image", dep.URI+" @ "+dep.Digest)
		default:
			row("platform", dep.Name+" "+dep.Digest)
		}
	}
	if !p.StartedOn.IsZero() {
		row("built", p.StartedOn.UTC().Format(time.RFC3339)+" → "+p.FinishedOn.UTC().Format(time.RFC3339))
	}
}
