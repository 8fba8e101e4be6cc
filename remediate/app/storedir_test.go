package app

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

// TestStartRefusesStoreDirectory: the remediator checks the directory of
// its audit store as the prolog, the epilog and `gpu-orphan clean` do
// (store.MakeDir): a symbolic link, or a directory that others may write
// to, is refused with the command that fixes it, and no database is made.
func TestStartRefusesStoreDirectory(t *testing.T) {
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(dir, "real")
	if err := os.Mkdir(real, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(dir, "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	root := testenv.SimNode(t, 1)
	for _, tc := range []struct{ dir, says string }{
		{link, "is a symbolic link (to " + real + ")"},
		{open, "has mode 0777, so users other than its owner could replace the audit database: run `chmod 0700 " + open + "`"},
	} {
		o := Options{Role: RoleNode, Auth: intake.AuthConfig{TokenFile: token}, Web: webConfig(t), Interval: time.Second,
			Backend: cli.Backend{Kind: "sim", SimRoot: root, ProcFS: "/proc"}, StorePath: filepath.Join(tc.dir, "remediator.db")}
		// A remediator that took the directory would serve until the
		// deadline, and return nil.
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		err := Run(ctx, o)
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("Run with its store in %s: %v, want an error saying %q", tc.dir, err, tc.says)
		}
		if _, err := os.Lstat(filepath.Join(tc.dir, "remediator.db")); err == nil {
			t.Errorf("a database was made in %s", tc.dir)
		}
	}
}
