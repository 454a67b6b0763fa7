package attest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	intoto "github.com/in-toto/attestation/go/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"
)

// PredicateSPDX is the predicate type of an SPDX (JSON) SBOM statement:
// the type `cosign verify-attestation --type spdxjson` asks for.
const PredicateSPDX = "https://spdx.dev/Document"

// MaxSBOMBytes bounds an SBOM document: its statement is signed and
// attached as one bundle, which readers take up to MaxBundleBytes of, and
// the bundle holds the statement base64-encoded (4/3 of it) with the
// envelope and signature around it.
const MaxSBOMBytes = maxSBOMBytes

const maxSBOMBytes = maxBundleBytes*3/4 - 64<<10

// SBOMStatement returns the in-toto Statement (JSON) whose predicate is
// the SPDX JSON document doc, about subject. doc must be one JSON object
// that names an SPDX version.
func SBOMStatement(subject Subject, doc []byte) ([]byte, error) {
	if len(doc) > maxSBOMBytes {
		return nil, fmt.Errorf("attest: the SBOM is %d bytes, more than the %d an attachment holds", len(doc), maxSBOMBytes)
	}
	var pred map[string]any
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	if err := dec.Decode(&pred); err != nil {
		return nil, fmt.Errorf("attest: the SBOM is not a JSON object: %w", err)
	}
	if v, _ := pred["spdxVersion"].(string); !strings.HasPrefix(v, "SPDX-") {
		return nil, errors.New("attest: the SBOM is not an SPDX document (no spdxVersion)")
	}
	rd, err := descriptor("", subject.Digest, subject.Name)
	if err != nil {
		return nil, fmt.Errorf("attest: subject %s: %w", subject.Name, err)
	}
	// structpb takes float64s, not json.Numbers: SPDX holds no number
	// that float64 would change (versions and checksums are strings).
	var plain map[string]any
	if err := json.Unmarshal(doc, &plain); err != nil {
		return nil, err
	}
	p, err := structpb.NewStruct(plain)
	if err != nil {
		return nil, fmt.Errorf("attest: the SBOM: %w", err)
	}
	st := &intoto.Statement{
		Type:          intoto.StatementTypeUri,
		Subject:       []*intoto.ResourceDescriptor{rd},
		PredicateType: PredicateSPDX,
		Predicate:     p,
	}
	if err := st.Validate(); err != nil {
		return nil, fmt.Errorf("attest: in-toto statement: %w", err)
	}
	return protojson.Marshal(st)
}

// SBOM is what a verified SBOM statement says, in the terms `buildq
// verify` prints.
type SBOM struct {
	// Referrer is the digest of the referrer manifest the bundle came from.
	Referrer string
	Subjects []Subject
	// SPDXVersion and Name are the document's.
	SPDXVersion, Name string
	// Packages are the packages the document lists, as name@version.
	Packages []string
	// Document is the SPDX document as it was signed.
	Document []byte
}

// ParseSBOMStatement reads an in-toto statement carrying an SPDX document.
func ParseSBOMStatement(statement []byte) (*SBOM, error) {
	var st intoto.Statement
	if err := protojson.Unmarshal(statement, &st); err != nil {
		return nil, fmt.Errorf("not an in-toto statement: %w", err)
	}
	if err := st.Validate(); err != nil {
		return nil, fmt.Errorf("in-toto statement: %w", err)
	}
	if st.GetPredicateType() != PredicateSPDX {
		return nil, fmt.Errorf("predicate type %q, want %q", st.GetPredicateType(), PredicateSPDX)
	}
	doc, err := protojson.Marshal(st.GetPredicate())
	if err != nil {
		return nil, err
	}
	var d struct {
		SPDXVersion string `json:"spdxVersion"`
		Name        string `json:"name"`
		Packages    []struct {
			Name    string `json:"name"`
			Version string `json:"versionInfo"`
		} `json:"packages"`
	}
	if err := json.Unmarshal(doc, &d); err != nil {
		return nil, fmt.Errorf("not an SPDX document: %w", err)
	}
	if !strings.HasPrefix(d.SPDXVersion, "SPDX-") {
		return nil, errors.New("not an SPDX document (no spdxVersion)")
	}
	s := &SBOM{SPDXVersion: d.SPDXVersion, Name: d.Name, Document: doc}
	for _, sub := range st.GetSubject() {
		s.Subjects = append(s.Subjects, Subject{Name: sub.GetName(), Digest: digestOf(sub.GetDigest())})
	}
	for _, p := range d.Packages {
		s.Packages = append(s.Packages, p.Name+"@"+p.Version)
	}
	return s, nil
}

// FindSBOM returns the newest SBOM attached to subject that verifies
// under v and is about subject's digest; nil when none does (other
// attachments, provenance among them, are passed over). It reads the
// referrers one at a time and stops at the first that answers.
func FindSBOM(ctx context.Context, subject name.Digest, v *Verifier, opts []remote.Option) (*SBOM, error) {
	var found *SBOM
	err := walk(ctx, subject, opts, PredicateSPDX, func(a Attached) bool {
		if a.Err != nil {
			return false
		}
		statement, err := v.Open(a.Bundle)
		if err != nil {
			return false
		}
		s, err := ParseSBOMStatement(statement)
		if err != nil {
			return false
		}
		for _, sub := range s.Subjects {
			if sub.Digest == subject.DigestStr() {
				s.Referrer = a.Digest
				found = s
				return true
			}
		}
		return false
	})
	return found, err
}
