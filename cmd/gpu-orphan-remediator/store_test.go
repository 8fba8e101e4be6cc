package main

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
)

// TestStorePathSaidAtStartup: started without --store.path, the real
// remediator says at start-up that its audit database is the default, and
// where; with --store.path it does not. A token file that does not exist
// stops it before the store is created, so nothing is written under
// /var/lib.
func TestStorePathSaidAtStartup(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-token")
	for _, tc := range []struct {
		args []string
		said bool
	}{
		{nil, true},
		{[]string{"--store.path=" + filepath.Join(t.TempDir(), "r.db")}, false},
	} {
		args := append([]string{"--auth.token-file=" + missing, "--web.listen-address=" + testenv.FreeAddr(t)}, tc.args...)
		out, err := exec.Command(testenv.Bin(t, "gpu-orphan-remediator"), args...).CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), missing) {
			t.Fatalf("%v: %v, want exit 1 naming %s:\n%s", tc.args, err, missing, out)
		}
		said := strings.Contains(string(out), `level=INFO`) &&
			strings.Contains(string(out), `msg="No --store.path given: the audit database is the default" store=`+remediateflag.DefaultStorePath+"\n")
		if said != tc.said {
			t.Errorf("%v: the start-up log says the default store: %v, want %v:\n%s", tc.args, said, tc.said, out)
		}
	}
}
