package remediate_test

import (
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
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

var serial int64

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func newCA(t *testing.T, name string) *testCA {
	t.Helper()
	key := newKey(t)
	serial++
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue signs a leaf certificate for a server (with IP SANs) or a client,
// and returns it as PEM, with its key.
func (ca *testCA) issue(t *testing.T, cn string, usage x509.ExtKeyUsage, ips ...net.IP) (certPEM, keyPEM []byte) {
	t.Helper()
	key := newKey(t)
	serial++
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
}

func writeFile(t *testing.T, dir, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// tlsClient trusts ca and, when certPEM is given, presents that client
// certificate whatever CAs the server asks for (Go's client would otherwise
// leave out a certificate the server's CA list does not name, as an
// attacker's client would not). Each client has its own connections.
func tlsClient(t *testing.T, ca *testCA, certPEM, keyPEM []byte) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	cfg := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if certPEM != nil {
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &pair, nil }
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 10 * time.Second}
}

// TestTLSClientCertificates: the remediator serves TLS through
// --web.config.file with client_auth_type VerifyClientCertIfGiven. A client
// certificate from the configured CA authenticates by itself; without one,
// the bearer token is still required; a certificate from another CA fails
// the TLS handshake.
func TestTLSClientCertificates(t *testing.T) {
	skipShort(t)
	t.Parallel()
	dir := t.TempDir()
	ca, otherCA := newCA(t, "gpu-orphan test CA"), newCA(t, "somebody else's CA")
	srvCert, srvKey := ca.issue(t, "remediator", x509.ExtKeyUsageServerAuth, net.ParseIP("127.0.0.1"))
	cliCert, cliKey := ca.issue(t, "alertmanager", x509.ExtKeyUsageClientAuth)
	badCert, badKey := otherCA.issue(t, "alertmanager", x509.ExtKeyUsageClientAuth)
	webConfig := writeFile(t, dir, "web.yml", fmt.Appendf(nil, `tls_server_config:
  cert_file: %s
  key_file: %s
  client_auth_type: VerifyClientCertIfGiven
  client_ca_file: %s
`, writeFile(t, dir, "server.crt", srvCert), writeFile(t, dir, "server.key", srvKey), writeFile(t, dir, "ca.crt", ca.pem)))

	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	w.KillParent(t)
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+root,
		"--store.path="+filepath.Join(dir, "r.db"), "--auth.token-file="+tokenFile(t), "--web.config.file="+webConfig,
		"--node.name=node-a", "--web.listen-address="+addr, "--collector.interval=200ms", "--remediate.min-age=0s",
		"--log.level=debug")
	base := "https://" + addr

	withCert, noCert, wrongCA := tlsClient(t, ca, cliCert, cliKey), tlsClient(t, ca, nil, nil), tlsClient(t, ca, badCert, badKey)
	waitReady(t, noCert, base)
	startsAt := time.Now().Add(-time.Minute)

	// The client certificate alone authenticates: no token is sent.
	r := deliver(withCert, base, "", payload(alert("firing", "node-a", uuid, fp(60), startsAt)))
	if r.err != nil || r.code != http.StatusOK || results(t, string(r.body))["accepted"] != 1 {
		t.Fatalf("client certificate, no token: %d %v %s", r.code, r.err, r.body)
	}
	var as []remediate.Action
	if code := getJSON(t, withCert, base+"/api/v1/actions", "", &as); code != http.StatusOK || len(as) != 1 || as[0].AlertFingerprint != fp(60) {
		t.Fatalf("GET actions with the client certificate: %d %+v", code, as)
	}

	// No certificate and no token: 401.
	r = deliver(noCert, base, "", payload(alert("firing", "node-a", uuid, fp(61), startsAt)))
	if r.err != nil || r.code != http.StatusUnauthorized {
		t.Errorf("no certificate, no token: %d %v %s", r.code, r.err, r.body)
	}
	// No certificate, but the token: the token still works over TLS.
	r = deliver(noCert, base, token, payload(alert("firing", "node-a", uuid, fp(62), startsAt)))
	if r.err != nil || r.code != http.StatusOK {
		t.Errorf("no certificate, correct token: %d %v %s", r.code, r.err, r.body)
	}

	// A certificate from another CA: the server refuses the handshake,
	// with or without a token.
	for _, tok := range []string{"", token} {
		code, body, err := postOnce(wrongCA, base, tok, payload(alert("firing", "node-a", uuid, fp(63), startsAt)))
		switch {
		case err == nil:
			t.Errorf("certificate from another CA (token %t): answered %d %s, want a failed handshake", tok != "", code, body)
		case !strings.Contains(err.Error(), "tls"):
			t.Errorf("certificate from another CA: %v, want a TLS error", err)
		default:
			t.Logf("certificate from another CA: %v", err)
		}
	}
	// Plain HTTP is not served.
	if code, body, err := postOnce(http.DefaultClient, "http://"+addr, token, payload(alert("firing", "node-a", uuid, fp(64), startsAt))); err == nil && code != http.StatusBadRequest {
		t.Errorf("plain HTTP: %d %s", code, body)
	}

	// Only the certificate's and the token's notifications were recorded.
	if code := getJSON(t, withCert, base+"/api/v1/actions", "", &as); code != http.StatusOK || len(as) != 2 {
		t.Errorf("actions after all attempts: %d %+v", code, as)
	}
	for _, a := range as {
		if a.AlertFingerprint != fp(60) && a.AlertFingerprint != fp(62) {
			t.Errorf("an unauthenticated alert made an action: %+v", a)
		}
	}
	resp, err := noCert.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_auth_failures_total", nil); v != 1 {
		t.Errorf("auth_failures_total = %v, want 1 (the request without certificate or token)", v)
	}
}
