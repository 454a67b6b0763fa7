package attest

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	slsa "github.com/in-toto/attestation/go/predicates/provenance/v1"
	intoto "github.com/in-toto/attestation/go/v1"
	"google.golang.org/protobuf/encoding/protojson"
)

// Provenance is what a verified statement says, in the terms `buildq
// verify` prints.
type Provenance struct {
	// Referrer is the digest of the referrer manifest the bundle came from.
	Referrer  string
	Subjects  []Subject
	BuilderID string
	Worker    string
	// InvocationID is the request whose build it was.
	InvocationID string
	BuildKey     string
	// External are the build's externalParameters as JSON values.
	External              map[string]any
	Dependencies          []Dependency
	StartedOn, FinishedOn time.Time
	// Statement is the verified statement as it was signed.
	Statement []byte
}

// ParseStatement reads an in-toto statement carrying SLSA v1 provenance
// and checks it against the in-toto and SLSA rules.
func ParseStatement(statement []byte) (*Provenance, error) {
	var st intoto.Statement
	if err := protojson.Unmarshal(statement, &st); err != nil {
		return nil, fmt.Errorf("not an in-toto statement: %w", err)
	}
	if err := st.Validate(); err != nil {
		return nil, fmt.Errorf("in-toto statement: %w", err)
	}
	if st.GetPredicateType() != PredicateSLSAProvenance {
		return nil, fmt.Errorf("predicate type %q, want %q", st.GetPredicateType(), PredicateSLSAProvenance)
	}
	pb, err := protojson.Marshal(st.GetPredicate())
	if err != nil {
		return nil, err
	}
	var prov slsa.Provenance
	if err := protojson.Unmarshal(pb, &prov); err != nil {
		return nil, fmt.Errorf("not SLSA v1 provenance: %w", err)
	}
	if err := prov.Validate(); err != nil {
		return nil, fmt.Errorf("SLSA provenance: %w", err)
	}
	p := &Provenance{Statement: statement, BuilderID: prov.GetRunDetails().GetBuilder().GetId()}
	for _, s := range st.GetSubject() {
		p.Subjects = append(p.Subjects, Subject{Name: s.GetName(), Digest: digestOf(s.GetDigest())})
	}
	p.Worker = prov.GetRunDetails().GetBuilder().GetVersion()["worker"]
	meta := prov.GetRunDetails().GetMetadata()
	p.InvocationID = meta.GetInvocationId()
	if meta.GetStartedOn() != nil {
		p.StartedOn = meta.GetStartedOn().AsTime()
	}
	if meta.GetFinishedOn() != nil {
		p.FinishedOn = meta.GetFinishedOn().AsTime()
	}
	p.External = prov.GetBuildDefinition().GetExternalParameters().AsMap()
	if k, ok := prov.GetBuildDefinition().GetInternalParameters().AsMap()["buildKey"].(string); ok {
		p.BuildKey = k
	}
	for _, d := range prov.GetBuildDefinition().GetResolvedDependencies() {
		p.Dependencies = append(p.Dependencies, Dependency{URI: d.GetUri(), Name: d.GetName(), Digest: digestOf(d.GetDigest())})
	}
	return p, nil
}

func digestOf(m map[string]string) string {
	if h, ok := m["sha256"]; ok {
		return "sha256:" + h
	}
	for alg, h := range m {
		return alg + ":" + h
	}
	return ""
}

// Verify finds the provenance attached to subject and checks it: the
// bundle's signature under v, the statement's form, and that the
// statement is about subject's digest. The newest bundle that verifies
// is returned; when none does, the error (wrapping ErrNotVerified) says
// why each failed.
func Verify(ctx context.Context, subject name.Digest, v *Verifier, opts []remote.Option) (*Provenance, error) {
	var (
		why   []string
		found *Provenance
	)
	err := walk(ctx, subject, opts, PredicateSLSAProvenance, func(a Attached) bool {
		if a.Err != nil {
			why = append(why, a.Digest+": "+a.Err.Error())
			return false
		}
		p, err := verifyBundle(a.Bundle, subject.DigestStr(), v)
		if err != nil {
			why = append(why, a.Digest+": "+err.Error())
			return false
		}
		p.Referrer = a.Digest
		found = p
		return true
	})
	switch {
	case err != nil:
		return nil, err
	case found != nil:
		return found, nil
	case len(why) == 0:
		return nil, fmt.Errorf("%w: %s has no attached provenance", ErrNotVerified, subject)
	}
	return nil, fmt.Errorf("%w: %s", ErrNotVerified, strings.Join(why, "; "))
}

func verifyBundle(b []byte, digest string, v *Verifier) (*Provenance, error) {
	statement, err := v.Open(b)
	if err != nil {
		return nil, err
	}
	p, err := ParseStatement(statement)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotVerified, err)
	}
	for _, s := range p.Subjects {
		if s.Digest == digest {
			return p, nil
		}
	}
	return nil, fmt.Errorf("%w: the statement is about %v, not %s", ErrNotVerified, p.Subjects, digest)
}
