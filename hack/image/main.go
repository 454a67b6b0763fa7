// Command image builds buildq's container image without a Docker engine
// and pushes it: the static binary cross-compiled for each platform, one
// layer each (internal/image), a multi-platform index, written to the
// registry with go-containerregistry. It prints the pushed reference by
// digest, the one to pin in deploy/ (make image IMAGE=repo).
//
//	go run ./hack/image --repo registry.example.com/buildq/buildq [--tag v1] [--platform linux/amd64,linux/arm64] [--insecure] [--with-syft]
//
// --with-syft adds syft, the SBOM scanner workers run with
// --sbom-scanner /usr/local/bin/syft (deploy/components/sbom), built for
// each platform from its pinned module (integration/tools/syft), as a
// layer of its own.
//
// Registry credentials come from the docker config ($DOCKER_CONFIG or
// ~/.docker/config.json), as for docker and crane.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/buildq/buildq/internal/image"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run() error {
	repo := flag.String("repo", "", "repository to push to, e.g. registry.example.com/buildq/buildq (required)")
	tag := flag.String("tag", "", "tag to push (default: the git commit, short)")
	platforms := flag.String("platform", "linux/amd64,linux/arm64", "platforms, comma-separated os/arch[/variant]")
	insecure := flag.Bool("insecure", false, "the registry speaks plain HTTP")
	withSyft := flag.Bool("with-syft", false, "add syft (the SBOM scanner, integration/tools/syft's pinned version) at /usr/local/bin/syft")
	flag.Parse()
	if *repo == "" {
		return fmt.Errorf("--repo is required (the repository to push to)")
	}
	var opts []name.Option
	if *insecure {
		opts = append(opts, name.Insecure)
	}
	if *tag == "" {
		out, err := exec.Command("git", "rev-parse", "--short=12", "HEAD").Output()
		if err != nil {
			return fmt.Errorf("no --tag and no git commit to name the image: %w", err)
		}
		*tag = strings.TrimSpace(string(out))
	}
	ref, err := name.NewTag(*repo+":"+*tag, opts...)
	if err != nil {
		return fmt.Errorf("--repo/--tag: %w", err)
	}
	// The commit's time, so the same commit builds the same image.
	created := time.Unix(0, 0).UTC()
	if out, err := exec.Command("git", "log", "-1", "--format=%ct").Output(); err == nil {
		if s, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64); err == nil {
			created = time.Unix(s, 0).UTC()
		}
	}
	revision := ""
	if out, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
		revision = strings.TrimSpace(string(out))
	}
	dir, err := os.MkdirTemp("", "buildq-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var imgs []ggcrv1.Image
	for _, p := range strings.Split(*platforms, ",") {
		plat, err := ggcrv1.ParsePlatform(strings.TrimSpace(p))
		if err != nil || plat.OS == "" || plat.Architecture == "" {
			return fmt.Errorf("--platform %q: want os/arch[/variant]", p)
		}
		bin := filepath.Join(dir, "buildq-"+plat.OS+"-"+plat.Architecture+plat.Variant)
		fmt.Fprintf(os.Stderr, "building buildq for %s\n", plat)
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w -buildid=", "-o", bin, "./cmd/buildq")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+plat.OS, "GOARCH="+plat.Architecture)
		if plat.Architecture == "arm" && strings.HasPrefix(plat.Variant, "v") {
			cmd.Env = append(cmd.Env, "GOARM="+plat.Variant[1:])
		}
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("go build for %s: %w", plat, err)
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			return err
		}
		var tools map[string][]byte
		if *withSyft {
			syft := filepath.Join(dir, "syft-"+plat.OS+"-"+plat.Architecture+plat.Variant)
			fmt.Fprintf(os.Stderr, "building syft for %s\n", plat)
			version, err := syftVersion()
			if err != nil {
				return err
			}
			cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w -buildid= -X main.version="+version, "-o", syft, "github.com/anchore/syft/cmd/syft")
			cmd.Dir = filepath.Join("integration", "tools", "syft")
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+plat.OS, "GOARCH="+plat.Architecture)
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("go build syft for %s: %w", plat, err)
			}
			sb, err := os.ReadFile(syft)
			if err != nil {
				return err
			}
			tools = map[string][]byte{"syft": sb}
		}
		img, err := image.Build(b, image.Options{Platform: *plat, Created: created, Tools: tools, Labels: map[string]string{
			"org.opencontainers.image.source":   "https://github.com/buildq/buildq",
			"org.opencontainers.image.revision": revision,
			"org.opencontainers.image.title":    "buildq",
		}})
		if err != nil {
			return err
		}
		imgs = append(imgs, img)
	}
	idx, err := image.Index(imgs)
	if err != nil {
		return err
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "pushing %s\n", ref)
	if err := remote.WriteIndex(ref, idx, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return fmt.Errorf("push %s: %w", ref, err)
	}
	fmt.Println(ref.Context().Digest(digest.String()).String())
	return nil
}

// syftVersion is the syft version integration/tools/syft pins.
func syftVersion() (string, error) {
	b, err := os.ReadFile(filepath.Join("integration", "tools", "syft", "go.mod"))
	if err != nil {
		return "", fmt.Errorf("--with-syft: %w (run from the repository's root)", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "github.com/anchore/syft" {
			return f[1], nil
		}
	}
	return "", fmt.Errorf("--with-syft: integration/tools/syft/go.mod does not require github.com/anchore/syft")
}
