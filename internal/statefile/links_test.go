package statefile

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestLinksAndOthersDirectories (issue 24, item 4): a user made a
// directory in a /tmp and, in it, the state file as a link to a file
// that only root may read. Check, Load and Save refuse the user's
// directory; after `chown -R root` (which leaves the link as it is) they
// refuse the link, in one line that names it; nothing of root's file is
// in any error. Save replaces a link in a directory of our own, never
// writing through it.
func TestLinksAndOthersDirectories(t *testing.T) {
	n := testenv.NewNeighbour(t)
	const secretText = "Zsecret of root\n"
	secret := filepath.Join(n.Base, "secret")
	if err := os.WriteFile(secret, []byte(secretText), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := n.Dir(t, "u", map[string]string{"exporter.json": secret})
	path := filepath.Join(dir, "exporter.json")

	leaks := func(t *testing.T, what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s accepted the state %s", what, path)
		}
		if strings.Contains(err.Error(), "Z") || strings.Contains(err.Error(), "secret of root") {
			t.Errorf("%s: %q tells of root's file", what, err)
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %q is more than one line", what, err)
		}
	}
	check := func(t *testing.T, says ...string) {
		t.Helper()
		_, _, lerr := Load(path)
		for what, err := range map[string]error{"Check": Check(path), "Load": lerr, "Save": Save(path, []byte("{}"))} {
			leaks(t, what, err)
			for _, s := range says {
				if err != nil && !strings.Contains(err.Error(), s) {
					t.Errorf("%s: %q does not say %q", what, err, s)
				}
			}
		}
		if b, err := os.ReadFile(secret); err != nil || string(b) != secretText {
			t.Errorf("root's file after the state was saved: %q %v", b, err)
		}
	}
	t.Run("the user's directory", func(t *testing.T) {
		check(t, "the state file's directory "+dir+" belongs to ", "run `chown -R root "+dir+"`")
	})
	if out, err := exec.Command("chown", "-R", "root", dir).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	t.Run("a link in root's directory", func(t *testing.T) {
		_, _, err := Load(path)
		leaks(t, "Load", err)
		if err != nil && !strings.Contains(err.Error(), "the state file "+path+" is a symbolic link (to "+secret+")") {
			t.Errorf("Load: %q does not name the link", err)
		}
		leaks(t, "Check", Check(path))
		// Save writes a file of its own in the link's place.
		if err := Save(path, []byte("{}")); err != nil {
			t.Fatalf("Save over a link in a directory of ours: %v", err)
		}
		if fi, err := os.Lstat(path); err != nil || !fi.Mode().IsRegular() {
			t.Errorf("after Save, %s is %v %v; want the state file itself", path, fi.Mode(), err)
		}
		if b, err := os.ReadFile(secret); err != nil || string(b) != secretText {
			t.Errorf("root's file after the state was saved: %q %v", b, err)
		}
	})
}

// TestOthersWritableDirectory: a directory that its group or others may
// write to is refused, with the chmod that fixes it.
func TestOthersWritableDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "exporter.json")
	err := Check(path)
	if err == nil || !strings.Contains(err.Error(), "has mode 0777") || !strings.Contains(err.Error(), "run `chmod 0700 "+dir+"`") {
		t.Errorf("Check with the state in a 0777 directory: %v", err)
	}
	if err := Save(path, []byte("{}")); err == nil {
		t.Error("Save wrote the state in a 0777 directory")
	}
}
