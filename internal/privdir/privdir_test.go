package privdir

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"/var/lib/gpu-orphan": "/var/lib/gpu-orphan",
		"/tmp/a b":            "'/tmp/a b'",
		"/tmp/it's":           `'/tmp/it'\''s'`,
		"":                    "''",
	} {
		if got := ShellQuote(in); got != want {
			t.Errorf("ShellQuote(%q) = %s, want %s", in, got, want)
		}
	}
}

// TestStickyDirectory: a /tmp (1777) is refused, and the line does not
// tell to chmod it, which would break it for every user: it says to
// make a directory of one's own in it.
func TestStickyDirectory(t *testing.T) {
	tmp := filepath.Join(t.TempDir(), "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(tmp, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	n := Names{Dir: "the store directory", File: "the audit database", Writer: "the audit record", Flag: "--store.path"}
	_, err := Open(tmp, n)
	if err == nil {
		t.Fatalf("Open accepted %s, mode 1777", tmp)
	}
	for _, want := range []string{"has mode 01777", "give --store.path a directory of its own (`install -d -m 0700 " + filepath.Join(tmp, "gpu-orphan") + "`)"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Open: %q does not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "chmod") {
		t.Errorf("Open: %q tells to chmod a /tmp", err)
	}
	d, err := Make(filepath.Join(tmp, "gpu-orphan"), n)
	if err != nil {
		t.Fatalf("Make of a directory of its own in %s: %v", tmp, err)
	}
	d.Close()
}
