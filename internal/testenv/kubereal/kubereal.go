// Package kubereal starts a real Kubernetes control plane for tests, as
// controller-runtime's envtest does: etcd (its embed package, built by
// scripts/kube-tools.sh into .tools/kubernetes-VERSION/etcd) and
// kube-apiserver from the k8s.io/kubernetes module of the release whose
// client-go gpu-orphan links, with a service-account signing key,
// --authorization-mode=Node,RBAC, a static token for the test's admin
// (group system:masters) and the secure port on 127.0.0.1. There is no
// kube-controller-manager, scheduler or kubelet: a test creates what their
// controllers would (EndpointSlices, Pods bound to a node).
//
// One control plane serves a test process: Get starts it the first time
// (a few seconds) and Main stops it after the tests. Each test works in
// namespaces of its own. A test that needs kube-apiserver flags of its
// own, or restarts it, gets a control plane of its own from Own. When the binaries are not built, Get skips the
// test and says how to build them (make e2e-kubernetes).
package kubereal

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"

	dto "github.com/prometheus/client_model/go"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/freeport"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// ToolsEnv names the directory of kube-apiserver and etcd, instead of
// .tools/kubernetes-VERSION under the repository's root.
const ToolsEnv = "GPU_ORPHAN_KUBE_TOOLS"

// HowToBuild is what a skipped test says.
const HowToBuild = "the real Kubernetes control plane is not built: `make e2e-kubernetes` builds it into .tools/ (once, 8 to 24 minutes on 2 cores) and runs these tests"

// ControlPlane is a running etcd and kube-apiserver.
type ControlPlane struct {
	// URL is kube-apiserver's https URL on 127.0.0.1.
	URL string
	// Version is the Kubernetes release that kube-apiserver reports
	// (/version), v1.MM.P: client-go's, or the one that ToolsEnv names
	// (make oldest: the oldest the chart supports).
	Version string
	// StartedIn is how long the start took, etcd's and kube-apiserver's.
	StartedIn time.Duration

	dir, caFile, adminToken string
	// bin is the binaries' directory; apiArgs kube-apiserver's arguments,
	// for a restart.
	bin, etcdURL    string
	apiArgs         []string
	etcd, apiserver *exec.Cmd
	// etcdDone and apiDone are closed when the process has exited.
	etcdDone, apiDone chan struct{}
	port              *freeport.Port
}

var (
	mu      sync.Mutex
	shared  *ControlPlane
	started error
	tried   bool
)

// Dir is the directory of the control plane's binaries: the one that
// ToolsEnv names, or .tools/kubernetes-VERSION of the release of the
// client-go that the test links.
func Dir() (string, error) {
	dir := os.Getenv(ToolsEnv)
	if dir == "" {
		version, err := clientRelease()
		if err != nil {
			return "", err
		}
		root, err := testenv.ModuleRoot()
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, ".tools", "kubernetes-"+version)
	}
	for _, b := range []string{"kube-apiserver", "etcd"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("%s: %w", HowToBuild, err)
		}
	}
	return dir, nil
}

// clientRelease is the Kubernetes release of the client-go that the test
// links: client-go v0.MM.P is Kubernetes v1.MM.P.
func clientRelease() (string, error) {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "k8s.io/client-go" {
				v := d.Version
				if d.Replace != nil {
					v = d.Replace.Version
				}
				return "v1." + strings.TrimPrefix(strings.SplitN(v, "-", 2)[0], "v0."), nil
			}
		}
	}
	// A test binary's build info lists no modules: ask the module of the
	// test, as scripts/kube-tools.sh does.
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Version}}", "k8s.io/client-go").Output()
	if err != nil {
		return "", fmt.Errorf("kubereal: go list -m k8s.io/client-go, whose version names the release: %w", err)
	}
	return "v1." + strings.TrimPrefix(strings.SplitN(strings.TrimSpace(string(out)), "-", 2)[0], "v0."), nil
}

// Get returns the test process's control plane, started the first time;
// it skips t when the binaries are not built, and fails it when they do
// not start.
func Get(t testing.TB) *ControlPlane {
	t.Helper()
	mu.Lock()
	defer mu.Unlock()
	if !tried {
		tried = true
		dir, err := Dir()
		if err != nil {
			started = errSkip{err}
		} else {
			shared, started = start(dir, nil)
		}
	}
	var skip errSkip
	if errors.As(started, &skip) {
		t.Skip(skip.err.Error())
	}
	if started != nil {
		t.Fatal(started)
	}
	return shared
}

type errSkip struct{ err error }

func (e errSkip) Error() string { return e.err.Error() }

// Main runs the tests (testenv.Main: the binaries that testenv.Bin built
// go after them), then stops the control plane if one started. Call it
// from TestMain: os.Exit(kubereal.Main(m)).
func Main(m *testing.M) int {
	code := testenv.Main(m)
	mu.Lock()
	defer mu.Unlock()
	if shared != nil {
		fmt.Fprintf(os.Stderr, "kubereal: Kubernetes %s (kube-apiserver and etcd) started in %s\n", shared.Version, shared.StartedIn.Round(time.Millisecond))
		shared.Stop()
		shared = nil
	}
	return code
}

// Own starts a control plane for t alone, stopped at its cleanup, with
// extra kube-apiserver flags after the usual ones (a later flag wins); it
// skips t as Get does.
func Own(t testing.TB, apiserverFlags ...string) *ControlPlane {
	t.Helper()
	dir, err := Dir()
	if err != nil {
		t.Skip(err.Error())
	}
	c, err := start(dir, apiserverFlags)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	return c
}

// start starts etcd, then kube-apiserver, and waits for /readyz.
func start(bin string, extra []string) (_ *ControlPlane, err error) {
	begin := time.Now()
	dir, err := os.MkdirTemp("", "gpu-orphan-kube-")
	if err != nil {
		return nil, err
	}
	c := &ControlPlane{dir: dir, bin: bin}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w%s", err, c.logs())
			c.Stop()
		}
	}()
	etcdURL, err := c.startEtcd(bin)
	if err != nil {
		return nil, err
	}
	c.etcdURL = etcdURL
	if err := c.writeCredentials(); err != nil {
		return nil, err
	}
	c.port, err = freeport.Reserve("127.0.0.1")
	if err != nil {
		return nil, err
	}
	_, port, _ := net.SplitHostPort(c.port.Addr)
	c.URL = "https://" + c.port.Addr
	c.apiArgs = append([]string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port=" + port,
		"--tls-cert-file=" + filepath.Join(dir, "serving.crt"), "--tls-private-key-file=" + filepath.Join(dir, "serving.key"),
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + filepath.Join(dir, "sa.pub"),
		"--service-account-signing-key-file=" + filepath.Join(dir, "sa.key"),
		"--authorization-mode=Node,RBAC",
		"--token-auth-file=" + filepath.Join(dir, "tokens.csv"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--allow-privileged=true",
		// The "kubernetes" Service's endpoints would name 127.0.0.1, which
		// Endpoints may not: no reconciler.
		"--endpoint-reconciler-type=none",
		"--enable-priority-and-fairness=true",
		"--v=1",
	}, extra...)
	if err := c.startAPIServer(); err != nil {
		return nil, err
	}
	c.StartedIn = time.Since(begin)
	client, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		return nil, err
	}
	v, err := client.Discovery().ServerVersion()
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver's /version: %w", err)
	}
	c.Version = v.GitVersion
	return c, nil
}

// startAPIServer starts kube-apiserver, its log appended to, and waits
// for /readyz.
func (c *ControlPlane) startAPIServer() (err error) {
	c.apiserver = exec.Command(filepath.Join(c.bin, "kube-apiserver"), c.apiArgs...)
	if c.apiserver.Stdout, err = os.OpenFile(filepath.Join(c.dir, "kube-apiserver.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600); err != nil {
		return err
	}
	c.apiserver.Stderr = c.apiserver.Stdout
	c.apiserver.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.apiserver.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	c.apiDone = make(chan struct{})
	go func() {
		exited <- c.apiserver.Wait()
		close(c.apiDone)
	}()
	client, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		return err
	}
	deadline := time.Now().Add(testenv.Scale(60 * time.Second))
	for {
		body, err := client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		if err == nil && string(body) == "ok" {
			break
		}
		select {
		case werr := <-exited:
			return fmt.Errorf("kube-apiserver exited: %v", werr)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kube-apiserver not ready within %s: %v", testenv.Scale(60*time.Second), err)
		}
	}
	return nil
}

// RestartAPIServer stops kube-apiserver (SIGTERM: its watches end), calls
// whileDown (when not nil), and starts it again with the same flags, on
// the same port, over the same etcd; it returns once /readyz answers.
// The log goes on in the same file.
func (c *ControlPlane) RestartAPIServer(t testing.TB, whileDown func()) {
	t.Helper()
	_ = c.apiserver.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.apiDone:
	case <-time.After(testenv.Scale(30 * time.Second)):
		_ = c.apiserver.Process.Kill()
		<-c.apiDone
	}
	if whileDown != nil {
		whileDown()
	}
	if err := c.startAPIServer(); err != nil {
		t.Fatalf("restarting kube-apiserver: %v%s", err, c.logs())
	}
}

// CompactEtcd writes a key of its own twice and compacts etcd's history
// up to the second write's revision, which it returns: every
// resourceVersion read before the call is then older than the compaction
// by two, and a watch from it (which starts at the next revision) fails
// with 410 Gone where kube-apiserver reads it from etcd
// (--watch-cache=false). It speaks etcd's gRPC (KV.Put, KV.Compact) over
// cleartext HTTP/2 with hand-written protobuf: etcd's JSON gateway dials
// the configured client URL, 127.0.0.1:0, and the module has no etcd
// client.
func (c *ControlPlane) CompactEtcd(t testing.TB) int64 {
	t.Helper()
	// PutRequest{key: 1, value: 2}
	key, value := "/gpu-orphan-test/compact", "x"
	put := append(append([]byte{0x0a, byte(len(key))}, key...), append([]byte{0x12, byte(len(value))}, value...)...)
	c.etcdCall(t, "Put", put)
	// PutResponse{header: 1 ResponseHeader{revision: 3}}
	rev := protoVarint(t, protoField(t, c.etcdCall(t, "Put", put), 1), 3)
	// CompactionRequest{revision: 1, physical: 2}
	c.etcdCall(t, "Compact", append(binary.AppendUvarint([]byte{0x08}, uint64(rev)), 0x10, 1))
	return int64(rev)
}

// etcdCall calls etcdserverpb.KV/method with the request's protobuf
// bytes, and returns the reply's.
func (c *ControlPlane) etcdCall(t testing.TB, method string, msg []byte) []byte {
	t.Helper()
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	// A gRPC message: not compressed (0), its length, the bytes.
	body := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(msg)))
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.etcdURL+"/etcdserverpb.KV/"+method, bytes.NewReader(append(body, msg...)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("TE", "trailers")
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("etcd %s: %v", method, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("etcd %s: %v", method, err)
	}
	status := resp.Trailer.Get("Grpc-Status")
	if status == "" {
		status = resp.Header.Get("Grpc-Status")
	}
	if resp.StatusCode != http.StatusOK || status != "0" || len(b) < 5 {
		t.Fatalf("etcd %s: %s, grpc-status %q %q", method, resp.Status, status, resp.Trailer.Get("Grpc-Message")+resp.Header.Get("Grpc-Message"))
	}
	return b[5:]
}

// protoField is the bytes of the length-delimited field num of msg.
func protoField(t testing.TB, msg []byte, num uint64) []byte {
	t.Helper()
	for len(msg) > 0 {
		tag, n := binary.Uvarint(msg)
		if n <= 0 {
			break
		}
		msg = msg[n:]
		switch tag & 7 {
		case 0:
			_, n = binary.Uvarint(msg)
			msg = msg[n:]
		case 2:
			l, n := binary.Uvarint(msg)
			if n <= 0 || uint64(len(msg)-n) < l {
				t.Fatalf("etcd's reply: a field runs past its end")
			}
			if tag>>3 == num {
				return msg[n : n+int(l)]
			}
			msg = msg[n+int(l):]
		default:
			t.Fatalf("etcd's reply: wire type %d", tag&7)
		}
	}
	t.Fatalf("etcd's reply has no field %d", num)
	return nil
}

// protoVarint is the varint field num of msg.
func protoVarint(t testing.TB, msg []byte, num uint64) uint64 {
	t.Helper()
	for len(msg) > 0 {
		tag, n := binary.Uvarint(msg)
		if n <= 0 {
			break
		}
		msg = msg[n:]
		switch tag & 7 {
		case 0:
			v, n := binary.Uvarint(msg)
			if tag>>3 == num {
				return v
			}
			msg = msg[n:]
		case 2:
			l, n := binary.Uvarint(msg)
			msg = msg[n+int(l):]
		default:
			t.Fatalf("etcd's reply: wire type %d", tag&7)
		}
	}
	t.Fatalf("etcd's reply has no field %d", num)
	return 0
}

// APIServerLog is kube-apiserver's log so far, across restarts.
func (c *ControlPlane) APIServerLog(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.dir, "kube-apiserver.log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// startEtcd starts etcd and reads the client URL it prints once ready.
func (c *ControlPlane) startEtcd(bin string) (string, error) {
	c.etcd = exec.Command(filepath.Join(bin, "etcd"), "--data-dir="+filepath.Join(c.dir, "etcd"))
	logf, err := os.Create(filepath.Join(c.dir, "etcd.log"))
	if err != nil {
		return "", err
	}
	c.etcd.Stderr = logf
	c.etcd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := c.etcd.StdoutPipe()
	if err != nil {
		return "", err
	}
	if err := c.etcd.Start(); err != nil {
		return "", err
	}
	line := make(chan string, 1)
	c.etcdDone = make(chan struct{})
	go func() {
		r := bufio.NewReader(out)
		if l, err := r.ReadString('\n'); err == nil {
			line <- strings.TrimSpace(l)
		}
		close(line)
		_, _ = r.WriteTo(logf)
		_ = c.etcd.Wait()
		close(c.etcdDone)
	}()
	select {
	case u, ok := <-line:
		if !ok || !strings.HasPrefix(u, "http://127.0.0.1:") {
			return "", fmt.Errorf("etcd did not start (its first line: %q)", u)
		}
		return u, nil
	case <-time.After(testenv.Scale(30 * time.Second)):
		return "", errors.New("etcd not ready within 30s")
	}
}

// writeCredentials writes the serving certificate, the service-account
// key pair and the admin's token.
func (c *ControlPlane) writeCredentials() error {
	if err := os.MkdirAll(filepath.Join(c.dir, "certs"), 0o700); err != nil {
		return err
	}
	// Serving: a self-signed certificate for 127.0.0.1, its own CA.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "gpu-orphan-test-apiserver"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true,
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	c.caFile = filepath.Join(c.dir, "serving.crt")
	if err := writePEM(c.caFile, "CERTIFICATE", der); err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.dir, "serving.key"), "EC PRIVATE KEY", kder); err != nil {
		return err
	}
	// Service accounts' tokens are signed with this key.
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.dir, "sa.key"), "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(sa)); err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.dir, "sa.pub"), "PUBLIC KEY", pub); err != nil {
		return err
	}
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return err
	}
	c.adminToken = fmt.Sprintf("%x", b)
	return os.WriteFile(filepath.Join(c.dir, "tokens.csv"), []byte(c.adminToken+`,gpu-orphan-test-admin,gpu-orphan-test-admin,"system:masters"`+"\n"), 0o600)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// logs is the tail of both logs, for an error.
func (c *ControlPlane) logs() string {
	var b strings.Builder
	for _, f := range []string{"etcd.log", "kube-apiserver.log"} {
		data, err := os.ReadFile(filepath.Join(c.dir, f))
		if err != nil {
			continue
		}
		if len(data) > 4000 {
			data = data[len(data)-4000:]
		}
		fmt.Fprintf(&b, "\n--- %s (tail) ---\n%s", f, data)
	}
	return b.String()
}

// Stop stops kube-apiserver, then etcd, and removes their files.
func (c *ControlPlane) Stop() {
	for i, cmd := range []*exec.Cmd{c.apiserver, c.etcd} {
		done := []chan struct{}{c.apiDone, c.etcdDone}[i]
		if cmd == nil || cmd.Process == nil || done == nil {
			continue
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
		}
	}
	if c.port != nil {
		c.port.Release()
	}
	os.RemoveAll(c.dir)
}

// AdminConfig is the admin's client configuration (system:masters).
func (c *ControlPlane) AdminConfig() *rest.Config {
	return c.TokenConfig(c.adminToken)
}

// TokenConfig is a client configuration that presents token.
func (c *ControlPlane) TokenConfig(token string) *rest.Config {
	return &rest.Config{Host: c.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: c.caFile},
		QPS: 100, Burst: 200, Timeout: 30 * time.Second}
}

// Admin is a clientset of the admin.
func (c *ControlPlane) Admin(t testing.TB) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(c.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// Kubeconfig writes a kubeconfig file that presents token, in t's temp
// dir, and returns its path.
func (c *ControlPlane) Kubeconfig(t testing.TB, token string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: c.URL, CertificateAuthority: c.caFile}
	cfg.AuthInfos["test"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
	cfg.CurrentContext = "test"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// AdminKubeconfig is Kubeconfig with the admin's token.
func (c *ControlPlane) AdminKubeconfig(t testing.TB) string { return c.Kubeconfig(t, c.adminToken) }

// ServiceAccountToken is a token of the ServiceAccount namespace/name,
// from the TokenRequest API, as the kubelet mounts one into a pod: what
// the API server authenticates as system:serviceaccount:namespace:name.
func (c *ControlPlane) ServiceAccountToken(t testing.TB, namespace, name string) string {
	t.Helper()
	tr, err := c.Admin(t).CoreV1().ServiceAccounts(namespace).CreateToken(t.Context(), name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("a token of ServiceAccount %s/%s: %v", namespace, name, err)
	}
	return tr.Status.Token
}

// Healthy reports whether kube-apiserver answers /readyz now.
func (c *ControlPlane) Healthy() bool {
	rt, err := rest.TransportFor(c.AdminConfig())
	if err != nil {
		return false
	}
	resp, err := (&http.Client{Transport: rt, Timeout: 5 * time.Second}).Get(c.URL + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// WaitAccess waits until kube-apiserver's authorizer says that the
// ServiceAccount namespace/name may (allowed) or may not do each of attrs,
// as a SubjectAccessReview made by the admin asks it. The RBAC authorizer
// reads Roles and bindings from an informer cache: one created, changed
// or deleted takes effect a moment later, not at once. The review goes
// through the same authorizer as the ServiceAccount's own requests, so
// once it answers, they are answered alike.
func (c *ControlPlane) WaitAccess(t testing.TB, namespace, name string, allowed bool, attrs ...authorizationv1.ResourceAttributes) {
	t.Helper()
	admin := c.Admin(t)
	spec := authorizationv1.SubjectAccessReviewSpec{
		User:   "system:serviceaccount:" + namespace + ":" + name,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
	}
	var what []string
	for _, a := range attrs {
		what = append(what, strings.TrimSpace(a.Verb+" "+a.Resource+" "+a.Name))
	}
	want := map[bool]string{true: "allowed", false: "denied"}[allowed]
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("%s to be %s %s", spec.User, want, strings.Join(what, ", ")), func() bool {
		for _, a := range attrs {
			review := &authorizationv1.SubjectAccessReview{Spec: spec}
			review.Spec.ResourceAttributes = &a
			r, err := admin.AuthorizationV1().SubjectAccessReviews().Create(t.Context(), review, metav1.CreateOptions{})
			if err != nil {
				t.Fatalf("SubjectAccessReview of %s %s for %s: %v", a.Verb, a.Resource, spec.User, err)
			}
			if r.Status.Allowed != allowed {
				return false
			}
		}
		return true
	})
}

// Requests is how many requests kube-apiserver has answered whose labels
// in apiserver_request_total include want (verb GET, LIST, ...; resource
// pods, endpointslices, ...; code 403, ...), from its /metrics. A request
// is counted once its answer has been written: right after a client got
// one, the count may lag it by a moment.
func (c *ControlPlane) Requests(t testing.TB, want map[string]string) float64 {
	t.Helper()
	n := 0.0
	for _, m := range testenv.Series(c.metrics(t), "apiserver_request_total", want) {
		n += m.GetCounter().GetValue()
	}
	return n
}

// FeatureGate reports whether kube-apiserver's feature gate name is on,
// by its own kubernetes_feature_enabled series (the release's default, or
// a --feature-gates flag), and whether the server knows the gate at all.
// Releases differ: WatchList (streaming lists) is alpha, off, in v1.30
// (the oldest that the chart supports), on in v1.32, off in v1.33, on
// since v1.34 (k8s.io/apiserver/pkg/features).
func (c *ControlPlane) FeatureGate(t testing.TB, name string) (on, known bool) {
	t.Helper()
	for _, m := range testenv.Series(c.metrics(t), "kubernetes_feature_enabled", map[string]string{"name": name}) {
		return m.GetGauge().GetValue() == 1, true
	}
	return false, false
}

// metrics is kube-apiserver's /metrics, parsed.
func (c *ControlPlane) metrics(t testing.TB) map[string]*dto.MetricFamily {
	t.Helper()
	body, err := c.Admin(t).Discovery().RESTClient().Get().AbsPath("/metrics").DoRaw(t.Context())
	if err != nil {
		t.Fatalf("kube-apiserver's /metrics: %v", err)
	}
	mfs, err := testenv.ParseMetrics(string(body))
	if err != nil {
		t.Fatalf("kube-apiserver's /metrics: %v", err)
	}
	return mfs
}
