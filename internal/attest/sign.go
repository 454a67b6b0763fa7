package attest

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/dsse"
)

// Media and payload types of what is attached.
const (
	// BundleMediaType is a Sigstore bundle v0.3: the referrer's
	// artifactType and its one layer's media type.
	BundleMediaType = "application/vnd.dev.sigstore.bundle.v0.3+json"
	// PayloadType is the DSSE payload type of an in-toto statement.
	PayloadType = "application/vnd.in-toto+json"
)

// Signer signs statements with the deployment's key: ECDSA P-256 (with
// SHA-256) or Ed25519. It is safe for concurrent use.
type Signer struct {
	dsse   signature.Signer
	pub    crypto.PublicKey
	pubPEM []byte
	hint   string
}

// LoadSigner reads an unencrypted PEM private key (PKCS#8 "PRIVATE KEY",
// or "EC PRIVATE KEY") from path.
func LoadSigner(path string) (*Signer, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("signing key: %w", err)
	}
	priv, err := cryptoutils.UnmarshalPEMToPrivateKey(data, cryptoutils.SkipPassword)
	if err != nil {
		return nil, fmt.Errorf("signing key %s: not an unencrypted PEM private key: %w", path, err)
	}
	s, err := NewSigner(priv)
	if err != nil {
		return nil, fmt.Errorf("signing key %s: %w", path, err)
	}
	return s, nil
}

// NewSigner signs with priv: an ECDSA P-256 or an Ed25519 key.
func NewSigner(priv crypto.PrivateKey) (*Signer, error) {
	var (
		sv  signature.Signer
		pub crypto.PublicKey
		err error
	)
	switch k := priv.(type) {
	case *ecdsa.PrivateKey:
		if k.Curve != elliptic.P256() {
			return nil, fmt.Errorf("an ECDSA key must be on P-256, not %s", k.Curve.Params().Name)
		}
		pub = k.Public()
		sv, err = signature.LoadECDSASignerVerifier(k, crypto.SHA256)
	case ed25519.PrivateKey:
		pub = k.Public()
		sv, err = signature.LoadED25519SignerVerifier(k)
	default:
		return nil, fmt.Errorf("a %T key is not supported: use ECDSA P-256 or Ed25519", priv)
	}
	if err != nil {
		return nil, err
	}
	pubPEM, err := cryptoutils.MarshalPublicKeyToPEM(pub)
	if err != nil {
		return nil, err
	}
	return &Signer{dsse: dsse.WrapSigner(sv, PayloadType), pub: pub, pubPEM: pubPEM, hint: keyHint(pub)}, nil
}

// PublicKeyPEM is the public key that verifies this signer's statements.
func (s *Signer) PublicKeyPEM() []byte { return bytes.Clone(s.pubPEM) }

// keyHint names a public key: hex sha256 of its PKIX DER form.
func keyHint(pub crypto.PublicKey) string {
	der, err := cryptoutils.MarshalPublicKeyToDER(pub)
	if err != nil {
		return ""
	}
	sum := sha256.Sum256(der)
	return hex.EncodeToString(sum[:])
}

// Sign wraps statement in a DSSE envelope, signs it and returns it as a
// Sigstore bundle (v0.3) whose verification material is the public key.
func (s *Signer) Sign(statement []byte) ([]byte, error) {
	raw, err := s.dsse.SignMessage(bytes.NewReader(statement))
	if err != nil {
		return nil, fmt.Errorf("attest: sign: %w", err)
	}
	var env envelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return nil, fmt.Errorf("attest: sign: %w", err)
	}
	b := bundle{MediaType: BundleMediaType, DSSEEnvelope: env}
	b.VerificationMaterial.PublicKey = &publicKeyHint{Hint: s.hint}
	return json.Marshal(b)
}

// The Sigstore bundle's JSON form (protobuf-specs' Bundle in its
// protojson encoding: lowerCamelCase names, bytes in base64).
type bundle struct {
	MediaType            string `json:"mediaType"`
	VerificationMaterial struct {
		PublicKey   *publicKeyHint `json:"publicKey,omitempty"`
		TlogEntries []any          `json:"tlogEntries"`
	} `json:"verificationMaterial"`
	DSSEEnvelope envelope `json:"dsseEnvelope"`
}

type publicKeyHint struct {
	Hint string `json:"hint"`
}

// envelope is a DSSE envelope; encoding/json writes []byte as standard
// base64, as DSSE and protojson both read.
type envelope struct {
	Payload     []byte         `json:"payload"`
	PayloadType string         `json:"payloadType"`
	Signatures  []envSignature `json:"signatures"`
}

type envSignature struct {
	Sig   []byte `json:"sig"`
	KeyID string `json:"keyid,omitempty"`
}

// Verifier checks statements against a public key.
type Verifier struct {
	key signature.Verifier
}

// LoadVerifier reads a PEM public key (PKIX "PUBLIC KEY").
func LoadVerifier(path string) (*Verifier, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("public key: %w", err)
	}
	v, err := NewVerifier(data)
	if err != nil {
		return nil, fmt.Errorf("public key %s: %w", path, err)
	}
	return v, nil
}

// NewVerifier verifies with the PEM public key pemBytes.
func NewVerifier(pemBytes []byte) (*Verifier, error) {
	pub, err := cryptoutils.UnmarshalPEMToPublicKey(pemBytes)
	if err != nil {
		return nil, fmt.Errorf("not a PEM public key: %w", err)
	}
	var v signature.Verifier
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		v, err = signature.LoadECDSAVerifier(k, crypto.SHA256)
	case ed25519.PublicKey:
		v, err = signature.LoadED25519Verifier(k)
	default:
		return nil, fmt.Errorf("a %T key is not supported: use ECDSA P-256 or Ed25519", pub)
	}
	if err != nil {
		return nil, err
	}
	return &Verifier{key: v}, nil
}

// ErrNotVerified wraps every reason a bundle does not verify.
var ErrNotVerified = errors.New("attestation does not verify")

// Open checks a bundle's signature and returns the statement it signs.
func (v *Verifier) Open(bundleJSON []byte) ([]byte, error) {
	var b bundle
	if err := json.Unmarshal(bundleJSON, &b); err != nil {
		return nil, fmt.Errorf("%w: not a Sigstore bundle: %w", ErrNotVerified, err)
	}
	if b.MediaType != BundleMediaType {
		return nil, fmt.Errorf("%w: bundle media type %q, want %q", ErrNotVerified, b.MediaType, BundleMediaType)
	}
	env, err := json.Marshal(struct {
		PayloadType string         `json:"payloadType"`
		Payload     []byte         `json:"payload"`
		Signatures  []envSignature `json:"signatures"`
	}{b.DSSEEnvelope.PayloadType, b.DSSEEnvelope.Payload, b.DSSEEnvelope.Signatures})
	if err != nil {
		return nil, err
	}
	var payload []byte
	verifier := dsse.WrapVerifier(v.key, dsse.WithExpectedPayloadType(PayloadType), dsse.WithDecodedPayload(&payload))
	if err := verifier.VerifySignature(bytes.NewReader(env), nil); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotVerified, err)
	}
	return payload, nil
}

// KeyFiles are the names GenerateKeyPair keeps a key pair under.
const (
	PrivateKeyFile = "signing.key"
	PublicKeyFile  = "signing.pub"
)

// EnsureKeyPair returns the signer of dir's key pair, making an ECDSA
// P-256 pair first when dir has none (signing.key, mode 0600, and
// signing.pub). created says whether it was made now.
func EnsureKeyPair(dir string) (s *Signer, created bool, err error) {
	priv := filepath.Join(dir, PrivateKeyFile)
	if _, err := os.Stat(priv); err == nil {
		s, err := LoadSigner(priv)
		if err != nil {
			return nil, false, err
		}
		// The public key is rewritten from the private one, so a
		// deleted or edited signing.pub is mended.
		if err := writeFileAtomic(filepath.Join(dir, PublicKeyFile), s.pubPEM, 0o644); err != nil {
			return nil, false, err
		}
		return s, false, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, false, fmt.Errorf("signing key: %w", err)
	}
	privPEM, pubPEM, err := cryptoutils.GeneratePEMEncodedECDSAKeyPair(elliptic.P256(), cryptoutils.SkipPassword)
	if err != nil {
		return nil, false, fmt.Errorf("signing key: generate: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, false, fmt.Errorf("signing key: %w", err)
	}
	if err := writeFileAtomic(priv, privPEM, 0o600); err != nil {
		return nil, false, err
	}
	if err := writeFileAtomic(filepath.Join(dir, PublicKeyFile), pubPEM, 0o644); err != nil {
		return nil, false, err
	}
	s, err = LoadSigner(priv)
	return s, err == nil, err
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return fmt.Errorf("signing key: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("signing key: %w", err)
	}
	return nil
}
