package dispatcher

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/exporter-toolkit/web"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func webConfig(t *testing.T) *web.FlagConfig {
	addrs, systemd, file := []string{testenv.FreeAddr(t)}, false, ""
	return &web.FlagConfig{WebListenAddresses: &addrs, WebSystemdSocket: &systemd, WebConfigFile: &file}
}

// TestStartChecksBeforeTheStore: a dispatcher whose start fails on its
// configuration (its routes, its token file, its discovery) leaves no
// audit database behind, nor the directory made for it.
func TestStartChecksBeforeTheStore(t *testing.T) {
	dir := t.TempDir()
	goodToken := filepath.Join(dir, "token")
	if err := os.WriteFile(goodToken, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	auth := intake.AuthConfig{TokenFile: goodToken}
	for _, tc := range []struct {
		name string
		d    app.Dispatch
		says string
	}{
		{"without routes", app.Dispatch{}, "--dispatch.targets-file"},
		{"with a template and no allow-list", app.Dispatch{URLTemplate: "http://{{.Node}}:10836"}, "--dispatch.targets-file"},
		{"its targets file missing", app.Dispatch{TargetsFile: filepath.Join(dir, "no-targets.json")}, "targets file"},
		{"without routes names discovery too", app.Dispatch{}, "--dispatch.kubernetes.service"},
		{"its kubeconfig missing", app.Dispatch{Kubernetes: app.Kubernetes{Service: "gpu-orphan-node",
			Namespace: "gpu-orphan", PortName: "remediator", Scheme: "http", Kubeconfig: filepath.Join(dir, "no-kubeconfig")}}, "--dispatch.kubernetes.kubeconfig"},
		{"its token file missing", app.Dispatch{URLTemplate: "http://{{.Node}}:10836", TokenFile: filepath.Join(dir, "no-token")}, "--dispatch.token-file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			storeDir := filepath.Join(t.TempDir(), "var", "lib", "gpu-orphan")
			o := app.Options{Web: webConfig(t), Auth: auth, Dispatch: tc.d, StorePath: filepath.Join(storeDir, "remediator.db")}
			err := Run(t.Context(), o, Escalate{})
			if err == nil || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Run: %v, want an error saying %q", err, tc.says)
			}
			if _, err := os.Stat(storeDir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a failed start left %s behind (stat: %v)", storeDir, err)
			}
		})
	}
}

// TestStartCreatesTheStore: once the configuration checks out, the store
// (and its directory) is created, and Run returns cleanly when its context
// ends.
func TestStartCreatesTheStore(t *testing.T) {
	storePath := filepath.Join(t.TempDir(), "var", "remediator.db")
	targets := filepath.Join(t.TempDir(), "targets.json")
	if err := os.WriteFile(targets, []byte(`{"gpu-a": ""}`), 0o600); err != nil {
		t.Fatal(err)
	}
	wc := webConfig(t)
	o := app.Options{
		Web: wc, Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node",
		StorePath: storePath, Dispatch: app.Dispatch{URLTemplate: "http://{{.Node}}:10836", TargetsFile: targets, Timeout: time.Second},
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, o, Escalate{}) }()
	// Serving means the store is open and migrated: stopping earlier
	// would interrupt its set-up (seen under -race on a loaded machine).
	testenv.Eventually(t, 30*time.Second, "the dispatcher to serve", func() bool {
		resp, err := http.Get("http://" + (*wc.WebListenAddresses)[0] + "/-/healthy")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if _, err := os.Stat(storePath); err != nil {
		t.Fatalf("the audit database was not created: %v", err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after its context ended: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}
