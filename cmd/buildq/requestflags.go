package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"

	v1 "github.com/buildq/buildq/api/v1"
	"github.com/buildq/buildq/internal/contexttar"
	"github.com/buildq/buildq/internal/s3store"
)

// requestFlags are the flags that describe one build request; submit and
// render share them so both refuse the same bad input.
type requestFlags struct {
	image      string
	name       string
	tenant     string
	dockerfile string
	buildArgs  []string
	target     string
	platforms  []string
	tags       []string
	labels     []string
	timeout    time.Duration
	priority   string
	sbom       bool
	bucket     string
	maxContext int64

	// secretBuildArgs are build arguments NAME=VALUE whose values the
	// build's log masks (Request.SecretBuildArgs).
	secretBuildArgs []string
}

func (f *requestFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.image, "image", "", "destination repository, without tag (e.g. 127.0.0.1:5000/acme/web); empty: the worker's naming policy")
	fs.StringVar(&f.name, "name", "", "build name, a DNS-1123 label (default: the directory's name)")
	fs.StringVar(&f.tenant, "tenant", "default", "tenant, a DNS-1123 label")
	fs.StringVarP(&f.dockerfile, "file", "f", "Dockerfile", "Dockerfile path inside DIR")
	fs.StringArrayVar(&f.buildArgs, "build-arg", nil, "build argument KEY=VALUE (repeatable)")
	fs.StringArrayVar(&f.secretBuildArgs, "secret-build-arg", nil, "secret build argument NAME=VALUE (repeatable): passed like --build-arg, and its value is masked (***) in the build's log as it is captured; it still reaches the build and may end up in the image")
	fs.StringVar(&f.target, "target", "", "build stage to stop at")
	fs.StringArrayVar(&f.platforms, "platform", nil, "target platform os/arch[/variant] (repeatable: several make one OCI image index, each platform built on its own; default linux/amd64)")
	fs.StringArrayVar(&f.tags, "tag", nil, "extra tag (repeatable); the build key's first 12 hex digits is always a tag")
	fs.StringArrayVar(&f.labels, "label", nil, "image label KEY=VALUE (repeatable)")
	fs.DurationVar(&f.timeout, "timeout", 0, "build timeout (default: the worker's)")
	fs.StringVar(&f.priority, "priority", "", "high, normal or low: the order among the tenant's own queued requests (default normal)")
	fs.BoolVar(&f.sbom, "sbom", false, "also attach a signed SPDX SBOM of the image (the deployment's workers must run with --sbom-scanner)")
	fs.StringVar(&f.bucket, "s3-bucket", "buildq", "bucket of build contexts")
	fs.Int64Var(&f.maxContext, "max-context-bytes", contexttar.DefaultMaxBytes, "refuse contexts larger than this")
}

var invalidNameChars = regexp.MustCompile(`[^a-z0-9-]+`)

// defaultName derives a DNS-1123 label from a directory name.
func defaultName(dir string) string {
	abs, err := filepath.Abs(dir)
	if err != nil {
		abs = dir
	}
	n := invalidNameChars.ReplaceAllString(strings.ToLower(filepath.Base(abs)), "-")
	n = strings.Trim(n, "-")
	if len(n) > v1.MaxLabelLen {
		n = strings.Trim(n[:v1.MaxLabelLen], "-")
	}
	if n == "" {
		n = "build"
	}
	return n
}

func parseKV(flag string, items []string) (map[string]string, error) {
	if len(items) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(items))
	for _, it := range items {
		k, v, ok := strings.Cut(it, "=")
		if !ok || k == "" {
			return nil, usageErr("--%s %q: want KEY=VALUE", flag, it)
		}
		out[k] = v
	}
	return out, nil
}

// buildArgsOf returns the build arguments of --build-arg and
// --secret-build-arg, and the names of the secret ones, sorted. A name
// given with both flags is refused: which value, and whether it is
// secret, would be a guess. Errors never show a secret's value.
func (f *requestFlags) buildArgsOf() (map[string]string, []string, error) {
	args, err := parseKV("build-arg", f.buildArgs)
	if err != nil {
		return nil, nil, err
	}
	if len(f.secretBuildArgs) == 0 {
		return args, nil, nil
	}
	secret := map[string]string{}
	for _, it := range f.secretBuildArgs {
		k, v, ok := strings.Cut(it, "=")
		if !ok || k == "" {
			return nil, nil, usageErr("--secret-build-arg: want NAME=VALUE (the argument given is not shown)")
		}
		if _, dup := args[k]; dup {
			return nil, nil, usageErr("--secret-build-arg %s: %s is also given with --build-arg; give it once (with --secret-build-arg to mask its value)", k, k)
		}
		secret[k] = v
	}
	if args == nil {
		args = make(map[string]string, len(secret))
	}
	names := make([]string, 0, len(secret))
	for k, v := range secret {
		args[k] = v
		names = append(names, k)
	}
	slices.Sort(names)
	return args, names, nil
}

// request checks DIR and the flags and returns the request, without
// source and digest (those come from packing).
func (f *requestFlags) request(dir string) (*v1.Request, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, usageErr("context %s: %v", dir, err)
	}
	if !st.IsDir() {
		return nil, usageErr("context %s is not a directory", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, filepath.FromSlash(f.dockerfile))); err != nil {
		return nil, usageErr("no Dockerfile at %s: %v (use -f to name another)", filepath.Join(dir, f.dockerfile), err)
	}
	return f.requestFields(defaultName(dir))
}

// requestFields checks the flags and returns the request, named
// defaultName unless --name says otherwise, without a source.
func (f *requestFlags) requestFields(defaultName string) (*v1.Request, error) {
	args, secretArgs, err := f.buildArgsOf()
	if err != nil {
		return nil, err
	}
	labels, err := parseKV("label", f.labels)
	if err != nil {
		return nil, err
	}
	if _, ok := v1.PriorityOf(f.priority); !ok {
		return nil, usageErr("--priority must be high, normal or low, got %q", f.priority)
	}
	name := f.name
	if name == "" {
		name = defaultName
	}
	req := &v1.Request{
		APIVersion: v1.APIVersion,
		Tenant:     f.tenant,
		Name:       name,
		Dockerfile: filepath.ToSlash(filepath.Clean(f.dockerfile)),
		BuildArgs:  args,
		Target:     f.target,
		Platforms:  f.platforms,
		Image:      f.image,
		Tags:       f.tags,
		Timeout:    v1.Duration{Duration: f.timeout},
		Labels:     labels,
		Priority:   f.priority,
		SBOM:       f.sbom,
	}
	// The names of the secret ones; their values are in BuildArgs.
	req.SecretBuildArgs = secretArgs
	return req, nil
}

// digest computes the context digest (hash only) and fills the S3 source.
func (f *requestFlags) digest(ctx context.Context, dir string, req *v1.Request) (contexttar.Result, error) {
	res, err := contexttar.Digest(ctx, dir, contexttar.Options{Dockerfile: req.Dockerfile, MaxBytes: f.maxContext})
	if err != nil {
		return res, usageErr("pack %s: %v", dir, err)
	}
	setSource(req, f.bucket, res.Digest)
	return res, nil
}

// setSource names the context object of digest under the request's
// tenant's prefix, where the CLI uploads it (s3store.Store.ForTenant) and
// where a worker accepts it (--context-prefix).
func setSource(req *v1.Request, bucket, digest string) {
	req.ContextDigest = digest
	key := s3store.TenantContextKey(req.Tenant, digest)
	if key == "" {
		// An invalid tenant: validation reports it; keep a key to show.
		key = "contexts/" + req.Tenant + "/sha256/" + strings.TrimPrefix(digest, "sha256:") + ".tar.gz"
	}
	req.Source = v1.Source{S3: &v1.S3Source{Bucket: bucket, Key: key}}
}

// validate runs the wire validation with a placeholder request id (the real
// one is assigned at publish time) and reports problems as usage errors.
func validate(req *v1.Request) error {
	id := req.RequestID
	if id == "" {
		req.RequestID = "validate"
		defer func() { req.RequestID = "" }()
	}
	if err := req.Validate(); err != nil {
		return usageErr("%v", err)
	}
	return nil
}

var _ = fmt.Sprint
