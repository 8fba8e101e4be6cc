//go:build e2e

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

var (
	binDirMu sync.Mutex
	binDir   string
)

// bin is testenv.Bin, remembering the temp dir it builds into so that
// TestMain can remove it: testenv leaves its ~80 MB behind otherwise.
func bin(t *testing.T, name string) string {
	t.Helper()
	p := testenv.Bin(t, name)
	binDirMu.Lock()
	binDir = filepath.Dir(p)
	binDirMu.Unlock()
	return p
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" && strings.HasPrefix(filepath.Base(binDir), "gpu-orphan-bin-") {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}
