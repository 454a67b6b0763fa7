// Package attest says where an image buildq built came from: an in-toto
// Statement with a SLSA v1 provenance predicate, wrapped in DSSE, signed
// with the deployment's key and attached to the image as an OCI 1.1
// referrer holding a Sigstore bundle (v0.3), the form `cosign
// verify-attestation` reads. No transparency log and no network signer
// take part: whoever holds the deployment's public key can check it.
//
// The build type and every field are documented in docs/attestation.md.
package attest

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	slsa "github.com/in-toto/attestation/go/predicates/provenance/v1"
	intoto "github.com/in-toto/attestation/go/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// The predicate and build types buildq's statements carry.
const (
	PredicateSLSAProvenance = "https://slsa.dev/provenance/v1"
	// BuildType names buildq's build: its externalParameters and
	// internalParameters are documented in docs/attestation.md.
	BuildType = "https://buildq.dev/attestation/build/v1"
	// DefaultBuilderID is the builder id when a deployment names none.
	DefaultBuilderID = "https://buildq.dev/builder/v1"
)

// Masked replaces the value of a secret build argument in a statement.
const Masked = "***"

// Source is what a build was built from: an uploaded context (its
// digest) or a git commit packed into one.
type Source struct {
	// ContextDigest is "sha256:…" of the normalized context tar.
	ContextDigest string
	// Git, when the context was packed from a git commit.
	GitURL, GitRef, GitCommit, GitSubPath string
}

// Dependency is a resolved dependency of a build, pinned by digest.
type Dependency struct {
	// URI names it: an image reference (repo:tag), or the context.
	URI string
	// Digest is "sha256:…".
	Digest string
	// Name is its role ("context", "executor", "base", "platform").
	Name string
}

// Build is everything a statement says about one build. The worker fills
// it from the run it holds: never from what a request claims it is.
type Build struct {
	// Subjects are the images the statement is about (name = repository,
	// digest "sha256:…"): one image, or an image index.
	Subjects []Subject
	// BuilderID is the deployment's builder id (DefaultBuilderID when empty).
	BuilderID string
	// Key is the build key.
	Key    string
	Source Source
	// Dockerfile is its path in the context; DockerfileDigest "sha256:…"
	// of its bytes, when the worker read them.
	Dockerfile, DockerfileDigest string
	BuildArgs                    map[string]string
	// SecretBuildArgs are masked: their names stay, their values do not.
	SecretBuildArgs []string
	Target          string
	// Platforms the build made ("os/arch[/variant]").
	Platforms []string
	// Bases are the base images the build pulled, by digest; Executor is
	// the executor image (or the worker's own in-process executor).
	Bases    []Dependency
	Executor Dependency
	// Platform images of an index (Name = the platform).
	PlatformImages []Dependency
	// Worker is the worker that ran the build; InvocationID the request
	// whose build it was.
	Worker, InvocationID  string
	StartedOn, FinishedOn time.Time
}

// Subject is one image a statement is about.
type Subject struct {
	Name   string
	Digest string
}

// Statement returns the in-toto Statement (JSON) with the SLSA v1
// provenance of b. It is validated against the in-toto and SLSA rules
// before it is returned.
func Statement(b Build) ([]byte, error) {
	st, err := statement(b)
	if err != nil {
		return nil, err
	}
	return protojson.Marshal(st)
}

func statement(b Build) (*intoto.Statement, error) {
	b = maskSecrets(b)
	if len(b.Subjects) == 0 {
		return nil, errors.New("attest: a statement needs a subject")
	}
	var subjects []*intoto.ResourceDescriptor
	for _, s := range b.Subjects {
		rd, err := descriptor("", s.Digest, s.Name)
		if err != nil {
			return nil, fmt.Errorf("attest: subject %s: %w", s.Name, err)
		}
		subjects = append(subjects, rd)
	}
	ext, err := structpb.NewStruct(externalParameters(b))
	if err != nil {
		return nil, fmt.Errorf("attest: external parameters: %w", err)
	}
	internal, err := structpb.NewStruct(map[string]any{"buildKey": b.Key})
	if err != nil {
		return nil, fmt.Errorf("attest: internal parameters: %w", err)
	}
	var deps []*intoto.ResourceDescriptor
	add := func(d Dependency) error {
		if d.Digest == "" {
			return nil
		}
		rd, err := descriptor(d.URI, d.Digest, d.Name)
		if err != nil {
			return fmt.Errorf("attest: dependency %s: %w", d.URI, err)
		}
		deps = append(deps, rd)
		return nil
	}
	if b.Source.ContextDigest != "" {
		uri := "buildq:context"
		if b.Source.GitURL != "" {
			uri = "git+" + b.Source.GitURL + "@" + b.Source.GitCommit
		}
		if err := add(Dependency{URI: uri, Digest: b.Source.ContextDigest, Name: "context"}); err != nil {
			return nil, err
		}
	}
	for _, d := range b.Bases {
		if d.Name == "" {
			d.Name = "base"
		}
		if err := add(d); err != nil {
			return nil, err
		}
	}
	for _, d := range b.PlatformImages {
		if err := add(d); err != nil {
			return nil, err
		}
	}
	if b.Executor.Name == "" {
		b.Executor.Name = "executor"
	}
	if err := add(b.Executor); err != nil {
		return nil, err
	}
	builderID := b.BuilderID
	if builderID == "" {
		builderID = DefaultBuilderID
	}
	meta := &slsa.BuildMetadata{InvocationId: b.InvocationID}
	if !b.StartedOn.IsZero() {
		meta.StartedOn = timestamppb.New(b.StartedOn.UTC())
	}
	if !b.FinishedOn.IsZero() {
		meta.FinishedOn = timestamppb.New(b.FinishedOn.UTC())
	}
	builder := &slsa.Builder{Id: builderID}
	if b.Worker != "" {
		builder.Version = map[string]string{"worker": b.Worker}
	}
	prov := &slsa.Provenance{
		BuildDefinition: &slsa.BuildDefinition{
			BuildType:            BuildType,
			ExternalParameters:   ext,
			InternalParameters:   internal,
			ResolvedDependencies: deps,
		},
		RunDetails: &slsa.RunDetails{Builder: builder, Metadata: meta},
	}
	if err := prov.Validate(); err != nil {
		return nil, fmt.Errorf("attest: provenance: %w", err)
	}
	pb, err := protojson.Marshal(prov)
	if err != nil {
		return nil, err
	}
	pred := &structpb.Struct{}
	if err := protojson.Unmarshal(pb, pred); err != nil {
		return nil, err
	}
	st := &intoto.Statement{
		Type:          intoto.StatementTypeUri,
		Subject:       subjects,
		PredicateType: PredicateSLSAProvenance,
		Predicate:     pred,
	}
	if err := st.Validate(); err != nil {
		return nil, fmt.Errorf("attest: statement: %w", err)
	}
	return st, nil
}

// externalParameters are the inputs a requester controls, as the build
// used them: the source, the Dockerfile, the arguments (secret values
// masked), target and platforms.
func externalParameters(b Build) map[string]any {
	src := map[string]any{}
	if b.Source.GitURL != "" {
		src["git"] = map[string]any{"url": b.Source.GitURL, "ref": b.Source.GitRef, "commit": b.Source.GitCommit, "subPath": b.Source.GitSubPath}
	}
	if b.Source.ContextDigest != "" {
		src["contextDigest"] = b.Source.ContextDigest
	}
	df := map[string]any{"path": b.Dockerfile}
	if b.DockerfileDigest != "" {
		df["digest"] = b.DockerfileDigest
	}
	p := map[string]any{"source": src, "dockerfile": df}
	if len(b.BuildArgs) > 0 {
		secret := map[string]bool{}
		for _, n := range b.SecretBuildArgs {
			secret[n] = true
		}
		args := map[string]any{}
		for _, k := range slices.Sorted(maps.Keys(b.BuildArgs)) {
			v := b.BuildArgs[k]
			if secret[k] {
				v = Masked
			}
			args[k] = v
		}
		p["buildArgs"] = args
	}
	if b.Target != "" {
		p["target"] = b.Target
	}
	if len(b.Platforms) > 0 {
		ps := make([]any, len(b.Platforms))
		for i, pl := range b.Platforms {
			ps[i] = pl
		}
		p["platforms"] = ps
	}
	return p
}

// descriptor is an in-toto ResourceDescriptor of uri at digest.
func descriptor(uri, digest, name string) (*intoto.ResourceDescriptor, error) {
	alg, hex, ok := strings.Cut(digest, ":")
	if !ok || alg == "" || hex == "" {
		return nil, fmt.Errorf("digest %q is not algorithm:hex", digest)
	}
	rd := &intoto.ResourceDescriptor{Uri: uri, Name: name, Digest: map[string]string{alg: hex}}
	if err := rd.Validate(); err != nil {
		return nil, err
	}
	return rd, nil
}

// maskSecrets replaces the value of every secret build argument wherever
// it appears in b's strings (a base reference expanded from it, a target,
// a path), not only as that argument's value.
func maskSecrets(b Build) Build {
	var vals []string
	for _, n := range b.SecretBuildArgs {
		if v := b.BuildArgs[n]; v != "" {
			vals = append(vals, v)
		}
	}
	if len(vals) == 0 {
		return b
	}
	// Longest first: a secret that contains another is masked whole.
	slices.SortFunc(vals, func(x, y string) int { return len(y) - len(x) })
	pairs := make([]string, 0, 2*len(vals))
	for _, v := range vals {
		pairs = append(pairs, v, Masked)
	}
	r := strings.NewReplacer(pairs...)
	m := r.Replace
	b.Subjects = slices.Clone(b.Subjects)
	for i := range b.Subjects {
		b.Subjects[i].Name = m(b.Subjects[i].Name)
	}
	b.Dockerfile, b.Target = m(b.Dockerfile), m(b.Target)
	b.Source.GitURL, b.Source.GitRef, b.Source.GitSubPath = m(b.Source.GitURL), m(b.Source.GitRef), m(b.Source.GitSubPath)
	for _, deps := range []*[]Dependency{&b.Bases, &b.PlatformImages} {
		*deps = slices.Clone(*deps)
		for i := range *deps {
			(*deps)[i].URI = m((*deps)[i].URI)
		}
	}
	b.Executor.URI = m(b.Executor.URI)
	args := map[string]string{}
	secret := map[string]bool{}
	for _, n := range b.SecretBuildArgs {
		secret[n] = true
	}
	for k, v := range b.BuildArgs {
		if !secret[k] {
			v = m(v)
		}
		args[k] = v
	}
	b.BuildArgs = args
	return b
}
