package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// ServingCert is a CA and a serving certificate it signed, as files a webhook server reads.
type ServingCert struct {
	CAPEM    []byte // the caBundle of a webhook configuration
	CertFile string
	KeyFile  string
}

// WriteServingCert writes a fresh CA's certificate (ca.crt) and a serving certificate for ip signed by
// it (tls.crt, tls.key) under dir. A webhook gets a CA of its own, which the API server trusts through the
// webhook configuration's caBundle alone.
func WriteServingCert(dir, ip string) (ServingCert, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return ServingCert{}, fmt.Errorf("failed to create %s: %w", dir, err)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return ServingCert{}, fmt.Errorf("failed to generate CA key: %w", err)
	}
	now := time.Now().Add(-time.Hour)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "tessera-e2e-webhook-ca"},
		NotBefore:             now,
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return ServingCert{}, fmt.Errorf("failed to create CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return ServingCert{}, fmt.Errorf("failed to parse CA certificate: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return ServingCert{}, fmt.Errorf("failed to generate serving key: %w", err)
	}
	addr := net.ParseIP(ip)
	if addr == nil {
		return ServingCert{}, fmt.Errorf("%q is not an IP address", ip)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "tessera-webhook"},
		NotBefore:    now,
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{addr},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return ServingCert{}, fmt.Errorf("failed to create serving certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return ServingCert{}, fmt.Errorf("failed to encode serving key: %w", err)
	}
	sc := ServingCert{
		CAPEM:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		CertFile: filepath.Join(dir, "tls.crt"),
		KeyFile:  filepath.Join(dir, "tls.key"),
	}
	files := map[string][]byte{
		filepath.Join(dir, "ca.crt"): sc.CAPEM,
		sc.CertFile:                  pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		sc.KeyFile:                   pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	}
	for path, data := range files {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return ServingCert{}, fmt.Errorf("failed to write %s: %w", path, err)
		}
	}
	return sc, nil
}
