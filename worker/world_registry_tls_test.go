//go:build benchscale

package worker

// The test world's registry over TLS, for the scale benchmark (whose
// worker processes reach it as a production registry, by a name of its
// own).

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/buildq/buildq/internal/registry"
)

// newTLSRegistry serves a registry over TLS with a certificate for name,
// written (PEM) to caFile; image references name it name:port.
func newTLSRegistry(t *testing.T, name, caFile string) *testRegistry {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: name},
		DNSNames:     []string{name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	tr := &testRegistry{}
	srv := httptest.NewUnstartedServer(tr.handler())
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	tr.srv = srv
	tr.addr = srv.Listener.Addr().String()
	tr.host = fmt.Sprintf("%s:%d", name, srv.Listener.Addr().(*net.TCPAddr).Port)
	tr.client = tlsRegistryClient(t, tr.host, tr.addr, caFile)
	return tr
}

// tlsRegistryClient is a client of a TLS registry known as host (in image
// references) that listens on addr, trusting the certificate in caFile.
func tlsRegistryClient(t *testing.T, host, addr, caFile string) *registry.Client {
	t.Helper()
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("registry certificate: no PEM")
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool}
	tr.MaxIdleConnsPerHost = 64
	var d net.Dialer
	tr.DialContext = func(ctx context.Context, network, a string) (net.Conn, error) {
		if a == host {
			a = addr
		}
		return d.DialContext(ctx, network, a)
	}
	c, err := registry.New(registry.Options{Transport: tr})
	if err != nil {
		t.Fatal(err)
	}
	return c
}
