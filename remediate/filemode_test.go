package remediate_test

import (
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestStoreFilesPrivate (issue 16, §5): the remediator started with umask
// 000, as some container runtimes start it, creates its store's directory
// 0700 and the audit database, its -wal and its -shm 0600: they hold every
// command line it saw. (They were 0750 and 0644: another user read them.)
func TestStoreFilesPrivate(t *testing.T) {
	skipShort(t)
	// Not parallel: the umask below is the whole test process's, and the
	// directories other tests make meanwhile (t.TempDir) would be 0777,
	// which the store refuses.
	root := testenv.SimNode(t, 2)
	base := t.TempDir()
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "lib", "gpu-orphan") // created by the remediator
	storePath := filepath.Join(dir, "remediator.db")

	old := syscall.Umask(0) // the daemon inherits it
	url, _ := startAgent(t, root, storePath)
	syscall.Umask(old)
	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(500), time.Now()))
	if code, resp := post(t, url, token, body); code != http.StatusOK {
		t.Fatalf("post: %d %s", code, resp)
	}
	for _, d := range []string{filepath.Dir(dir), dir} {
		fi, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: mode %#o under umask 000, want 0700", d, fi.Mode().Perm())
		}
	}
	for _, p := range []string{storePath, storePath + "-wal", storePath + "-shm"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %#o under umask 000, want 0600", filepath.Base(p), fi.Mode().Perm())
		}
	}
}
