package app

import (
	"context"
	"os"
	"os/exec"
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

// TestStartRefusesStoreLinks (issue 24, item 4): a user made a directory
// in a /tmp and, in it, the remediator's database as a link to root's
// file, or as a dangling link into root's directory. The remediator
// refuses the directory; the operator runs what its line says (`chown -R
// root DIR`, which leaves the links as they are), and the remediator then
// refuses the link in one line that names it, and `rm` it. Root's file
// keeps its mode 0644 and its bytes, and nothing is created where the
// dangling link points. (The remediator chmod-ed root's file 0600, then
// failed; or created its database where the user chose.)
func TestStartRefusesStoreLinks(t *testing.T) {
	n := testenv.NewNeighbour(t)
	token := filepath.Join(n.Base, "token")
	if err := os.WriteFile(token, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	const text = "root's file\n"
	victim := filepath.Join(n.Base, "victim")
	if err := os.WriteFile(victim, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(n.Base, "secret")
	if err := os.Mkdir(secret, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(secret, 0o700); err != nil {
		t.Fatal(err)
	}
	root := testenv.SimNode(t, 1)
	run := func(store string) error {
		o := Options{Role: RoleNode, Auth: intake.AuthConfig{TokenFile: token}, Web: webConfig(t), Interval: time.Second,
			Backend: cli.Backend{Kind: "sim", SimRoot: root, ProcFS: "/proc"}, StorePath: store}
		// A remediator that took the store would serve until the
		// deadline, and return nil.
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		return Run(ctx, o)
	}
	for _, tc := range []struct{ dir, target string }{
		{"file", victim},
		{"dangling", filepath.Join(secret, "chosen.db")},
	} {
		dir := n.Dir(t, tc.dir, map[string]string{"remediator.db": tc.target})
		link := filepath.Join(dir, "remediator.db")

		err := run(link)
		if err == nil || !strings.Contains(err.Error(), "the store directory "+dir+" belongs to ") ||
			!strings.Contains(err.Error(), "run `chown -R root "+dir+"`") {
			t.Fatalf("Run with its store in the user's %s: %v, want the directory refused with `chown -R root %s`", dir, err, dir)
		}
		if out, err := exec.Command("chown", "-R", "root", dir).CombinedOutput(); err != nil {
			t.Fatalf("chown -R root %s: %v %s", dir, err, out)
		}
		err = run(link)
		want := link + " is a symbolic link (to " + tc.target + "), which the audit record does not follow: remove it (`rm " + link + "`)"
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("Run with %s a link to %s: %v; want one line that says %q", link, tc.target, err, want)
		}
		if fi, err := os.Stat(victim); err != nil || fi.Mode().Perm() != 0o644 {
			t.Errorf("root's file %s after the remediator's start: %v %v, want 0644", victim, fi.Mode(), err)
		}
		if b, _ := os.ReadFile(victim); string(b) != text {
			t.Errorf("root's file %s was written: %q", victim, b)
		}
		if entries, _ := os.ReadDir(secret); len(entries) > 0 {
			t.Errorf("the remediator created %s in root's directory %s, where the user's link pointed", entries[0].Name(), secret)
		}
	}
}
