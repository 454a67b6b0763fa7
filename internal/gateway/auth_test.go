package gateway

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net/http"
	"testing"
	"time"
)

// testCA is a certificate authority for client certificates.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key}
}

// client issues a client certificate for subject.
func (ca *testCA) client(t *testing.T, subject pkix.Name) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: subject,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// A client certificate verified against the client CA whose subject a
// tenant lists acts as that tenant; another subject is 401; a bearer token
// over the same TLS listener still works without a certificate.
func TestClientCertificateAuthenticates(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	w := newWorld(t, worldOptions{tls: &tls.Config{ClientAuth: tls.VerifyClientCertIfGiven, ClientCAs: pool, MinVersion: tls.VersionTLS12}})
	send := func(cert *tls.Certificate, token, id string) response {
		t.Helper()
		tr := w.srv.Client().Transport.(*http.Transport).Clone()
		if cert != nil {
			tr.TLSClientConfig.Certificates = []tls.Certificate{*cert}
		}
		req, _ := http.NewRequest(http.MethodPost, w.srv.URL+"/", bytes.NewReader(mustJSON(t, requestJSON("acme", ""))))
		for k, v := range binaryEvent(token, RequestedType, "/mtls", id) {
			req.Header.Set(k, v)
		}
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return response{code: resp.StatusCode}
	}
	acme := ca.client(t, pkix.Name{CommonName: "ci.acme.example", Organization: []string{"Acme"}})
	other := ca.client(t, pkix.Name{CommonName: "ci.other.example", Organization: []string{"Other"}})
	if r := send(&acme, "", "c1"); r.code != http.StatusAccepted {
		t.Fatalf("acme's certificate: %d", r.code)
	}
	if r := send(&other, "", "c2"); r.code != http.StatusUnauthorized {
		t.Fatalf("another subject's certificate: %d", r.code)
	}
	if r := send(nil, "", "c3"); r.code != http.StatusUnauthorized {
		t.Fatalf("no certificate, no token: %d", r.code)
	}
	if r := send(nil, acmeToken, "c4"); r.code != http.StatusAccepted {
		t.Fatalf("a token over TLS: %d", r.code)
	}
	// A bad token is not rescued by a good certificate.
	if r := send(&acme, "not-a-token", "c5"); r.code != http.StatusUnauthorized {
		t.Fatalf("a bad token with acme's certificate: %d", r.code)
	}
	if got := w.stored(); len(got) != 2 {
		t.Fatalf("%d stored, want 2", len(got))
	}
}
