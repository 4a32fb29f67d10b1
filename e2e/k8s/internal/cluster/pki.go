// Package cluster holds what `make up` and the e2e tests share: PKI and kubeconfigs for the local
// control plane, applying manifests through the real API server, and reading back what the scheduler,
// the plugin and the kubelet stand-in did for each pod.
package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Identity is one token in the API server's token file. Without Groups an identity is in
// system:masters: the stand-in harness tests the driver's behaviour, not RBAC. The real node's kubelet is
// in system:nodes only, so the Node authorizer and NodeRestriction judge it as they would a real kubelet.
type Identity struct {
	Name   string // kubeconfig file name (<dir>/<Name>.kubeconfig)
	User   string
	Groups []string // nil: system:masters
}

// WritePKI creates a CA (ca.crt, ca.key: SignCert signs the real node's kubelet serving certificate with
// it once that node's address is known), a serving certificate for 127.0.0.1, the API server's client
// certificate for kubelets (kubelet-client.crt, CN kube-apiserver-kubelet-client, which up.sh binds to
// system:kubelet-api-admin so `kubectl logs`/`exec` pass the kubelet's webhook authorization), its
// front-proxy client certificate (front-proxy-client.crt: the aggregation layer's identity towards
// extension API servers such as KEDA's metrics adapter, which trust it by the request-header CA), the
// service-account key pair, a token file and one kubeconfig per identity under dir. rustls (the Rust
// clients) rejects a self-signed end-entity certificate, hence the separate CA.
func WritePKI(dir, server string, identities []Identity) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("failed to create %s: %w", dir, err)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("failed to generate CA key: %w", err)
	}
	now := time.Now().Add(-time.Hour)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "tessera-e2e-ca"},
		NotBefore:             now,
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("failed to create CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return fmt.Errorf("failed to parse CA certificate: %w", err)
	}
	servingKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("failed to generate serving key: %w", err)
	}
	servingTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")},
		DNSNames:     []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
	}
	servingDER, err := x509.CreateCertificate(rand.Reader, servingTmpl, ca, &servingKey.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("failed to create serving certificate: %w", err)
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("failed to generate service-account key: %w", err)
	}
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	if err != nil {
		return fmt.Errorf("failed to encode CA key: %w", err)
	}
	clientCert, clientKey, err := signCert(ca, caKey, 3, "kube-apiserver-kubelet-client", nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return err
	}
	proxyCert, proxyKey, err := signCert(ca, caKey, 4, "front-proxy-client", nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"front-proxy-client.crt": proxyCert,
		"front-proxy-client.key": proxyKey,
		"ca.key":                 pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: caKeyDER}),
		"kubelet-client.crt":     clientCert,
		"kubelet-client.key":     clientKey,
		"ca.crt":                 caPEM,
		"serving.crt":            pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: servingDER}),
		"sa.key":                 pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(saKey)}),
	}
	servingKeyDER, err := x509.MarshalECPrivateKey(servingKey)
	if err != nil {
		return fmt.Errorf("failed to encode serving key: %w", err)
	}
	files["serving.key"] = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: servingKeyDER})
	saPub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return fmt.Errorf("failed to encode service-account public key: %w", err)
	}
	files["sa.pub"] = pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub})

	var tokens strings.Builder
	for i, id := range identities {
		raw := make([]byte, 16)
		if _, err := rand.Read(raw); err != nil {
			return fmt.Errorf("failed to generate token: %w", err)
		}
		token := hex.EncodeToString(raw)
		groups := id.Groups
		if groups == nil {
			groups = []string{"system:masters"}
		}
		if len(groups) == 0 {
			// An empty fourth column would be read as one group named "".
			fmt.Fprintf(&tokens, "%s,%s,%d\n", token, id.User, 1000+i)
		} else {
			fmt.Fprintf(&tokens, "%s,%s,%d,\"%s\"\n", token, id.User, 1000+i, strings.Join(groups, ","))
		}
		cfg := clientcmdapi.NewConfig()
		cfg.Clusters["local"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caPEM}
		cfg.AuthInfos[id.User] = &clientcmdapi.AuthInfo{Token: token}
		cfg.Contexts["local"] = &clientcmdapi.Context{Cluster: "local", AuthInfo: id.User}
		cfg.CurrentContext = "local"
		if err := clientcmd.WriteToFile(*cfg, filepath.Join(dir, id.Name+".kubeconfig")); err != nil {
			return fmt.Errorf("failed to write kubeconfig for %s: %w", id.Name, err)
		}
	}
	files["tokens.csv"] = []byte(tokens.String())
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return fmt.Errorf("failed to write %s: %w", name, err)
		}
	}
	return nil
}

// SignCert writes <out>.crt and <out>.key: a serving certificate for ips and dnsNames signed by the CA
// WritePKI left in dir (the real node's kubelet, whose address the API server dials and verifies). With
// client the certificate is also good for client authentication: KEDA's operator and metrics adapter
// talk mutual TLS with one key pair each side.
func SignCert(dir, out, commonName string, ips []net.IP, dnsNames []string, client bool) error {
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return fmt.Errorf("the CA certificate (clusterctl pki writes it): %w", err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, "ca.key"))
	if err != nil {
		return fmt.Errorf("the CA key (clusterctl pki writes it): %w", err)
	}
	caBlock, _ := pem.Decode(caPEM)
	keyBlock, _ := pem.Decode(keyPEM)
	if caBlock == nil || keyBlock == nil {
		return fmt.Errorf("%s/ca.crt or ca.key is not PEM", dir)
	}
	ca, err := x509.ParseCertificate(caBlock.Bytes)
	if err != nil {
		return fmt.Errorf("parse %s/ca.crt: %w", dir, err)
	}
	caKey, err := x509.ParseECPrivateKey(keyBlock.Bytes)
	if err != nil {
		return fmt.Errorf("parse %s/ca.key: %w", dir, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return fmt.Errorf("failed to draw a serial number: %w", err)
	}
	usages := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	if client {
		usages = append(usages, x509.ExtKeyUsageClientAuth)
	}
	crt, key, err := signCert(ca, caKey, serial.Int64()+16, commonName, ips, dnsNames, usages...)
	if err != nil {
		return err
	}
	if err := os.WriteFile(out+".crt", crt, 0o600); err != nil {
		return fmt.Errorf("failed to write %s.crt: %w", out, err)
	}
	if err := os.WriteFile(out+".key", key, 0o600); err != nil {
		return fmt.Errorf("failed to write %s.key: %w", out, err)
	}
	return nil
}

func signCert(ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, commonName string, ips []net.IP, dnsNames []string, usages ...x509.ExtKeyUsage) (crtPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to generate a key for %s: %w", commonName, err)
	}
	now := time.Now().Add(-time.Hour)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: commonName},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  usages,
		IPAddresses:  ips,
		DNSNames:     dnsNames,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to create the certificate for %s: %w", commonName, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to encode the key for %s: %w", commonName, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}
