package app

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/exporter-toolkit/web"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func webConfig(t *testing.T) *web.FlagConfig {
	addrs, systemd, file := []string{testenv.FreeAddr(t)}, false, ""
	return &web.FlagConfig{WebListenAddresses: &addrs, WebSystemdSocket: &systemd, WebConfigFile: &file}
}

// TestStartChecksBeforeTheStore: a start that fails on its configuration
// (authentication, a token file, the backend; the dispatcher's are
// checked in package dispatcher)
// leaves no audit database behind, nor the directory made for it.
func TestStartChecksBeforeTheStore(t *testing.T) {
	dir := t.TempDir()
	shortToken := filepath.Join(dir, "short-token")
	goodToken := filepath.Join(dir, "token")
	if err := os.WriteFile(shortToken, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(goodToken, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	auth := intake.AuthConfig{TokenFile: goodToken}
	for _, tc := range []struct {
		name string
		o    Options
		says string
	}{
		{"no authentication", Options{Role: RoleNode}, "authentication is required"},
		{"token file missing", Options{Role: RoleNode, Auth: intake.AuthConfig{TokenFile: filepath.Join(dir, "no-token")}}, "--auth.token-file"},
		{"token too short", Options{Role: RoleNode, Auth: intake.AuthConfig{TokenFile: shortToken}}, "use at least 16"},
		{"simulated backend without its root", Options{Role: RoleNode, Auth: auth, Backend: cli.Backend{Kind: "sim", ProcFS: "/proc"}}, "--sim.root"},
		{"simulated node missing", Options{Role: RoleNode, Auth: auth, Backend: cli.Backend{Kind: "sim", SimRoot: filepath.Join(dir, "no-node"), ProcFS: "/proc"}}, "opening the simulated node"},
		{"dispatcher without its wiring", Options{Role: RoleDispatcher, Auth: auth}, "gpu-orphan-dispatcher"},
		{"unknown role", Options{Role: "everything", Auth: auth}, "unknown role"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.o.Web = webConfig(t)
			storeDir := filepath.Join(t.TempDir(), "var", "lib", "gpu-orphan")
			tc.o.StorePath = filepath.Join(storeDir, "remediator.db")
			err := Run(t.Context(), tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Run: %v, want an error saying %q", err, tc.says)
			}
			if _, err := os.Stat(storeDir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a failed start left %s behind (stat: %v)", storeDir, err)
			}
		})
	}
}
