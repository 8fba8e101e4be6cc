package store

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestMakeDir: the store's directory is created 0700 with its missing
// parents, whatever the umask, and an existing one is used as it is when
// it is a directory of the user's own that no one else may write to (read
// access is left alone: the files are 0600). Anything else is refused in
// one sentence that ends with the command to run, and nothing is changed.
func TestMakeDir(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)

	base := t.TempDir()
	created := filepath.Join(base, "var", "lib", "gpu-orphan")
	if err := MakeDir(filepath.Join(created, "remediator.db")); err != nil {
		t.Fatalf("MakeDir on a missing directory: %v", err)
	}
	for _, d := range []string{created, filepath.Dir(created)} {
		if fi, err := os.Lstat(d); err != nil || !fi.IsDir() || fi.Mode().Perm() != DirMode {
			t.Errorf("%s after MakeDir: %v, %v; want a directory, %#o", d, fi.Mode(), err, DirMode)
		}
	}
	// Again, on the directory it made: nothing to do.
	if err := MakeDir(filepath.Join(created, "remediator.db")); err != nil {
		t.Errorf("MakeDir on the directory it made: %v", err)
	}
	// A relative path is the directory it names from here.
	t.Chdir(created)
	if err := MakeDir("remediator.db"); err != nil {
		t.Errorf("MakeDir(\"remediator.db\") in %s: %v", created, err)
	}

	readable := filepath.Join(base, "readable")
	mkdir(t, readable, 0o755)
	if err := MakeDir(filepath.Join(readable, "remediator.db")); err != nil {
		t.Errorf("MakeDir on a 0755 directory of our own (a kubelet's DirectoryOrCreate): %v", err)
	}

	file := filepath.Join(base, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	others := filepath.Join(base, "others")
	mkdir(t, others, 0o700)
	if err := os.Chown(others, 65534, 65534); err != nil && os.Geteuid() == 0 {
		t.Fatal(err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(created, link); err != nil {
		t.Fatal(err)
	}
	writable := filepath.Join(base, "writable")
	mkdir(t, writable, 0o777)
	groupWritable := filepath.Join(base, "group-writable")
	mkdir(t, groupWritable, 0o770)
	for _, tc := range []struct {
		name, dir string
		says      []string
		root      bool // a test that needs root (to give a directory away)
	}{
		{"a symbolic link", link, []string{"the store directory " + link + " is a symbolic link (to " + created + ")", "run `rm " + link + " && install -d -m 0700 " + link + "`"}, false},
		{"another user's", others, []string{"the store directory " + others + " belongs to ", "UID 65534), not to root (UID 0)", "run `chown -R root " + others + "`"}, true},
		{"writable by others", writable, []string{"the store directory " + writable + " has mode 0777", "run `chmod 0700 " + writable + "`"}, false},
		{"writable by its group", groupWritable, []string{"has mode 0770", "run `chmod 0700 " + groupWritable + "`"}, false},
		{"a file", file, []string{"the store directory " + file + " is not a directory"}, false},
		{"under a file", filepath.Join(file, "sub"), []string{"the store directory " + filepath.Join(file, "sub") + " cannot be created", "give --store.path elsewhere"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.root && os.Geteuid() != 0 {
				t.Skip("giving a directory to another user takes root")
			}
			before, _ := os.Lstat(tc.dir)
			err := MakeDir(filepath.Join(tc.dir, "remediator.db"))
			if err == nil {
				t.Fatalf("MakeDir accepted %s", tc.dir)
			}
			for _, want := range tc.says {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("MakeDir: %q\ndoes not say %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("MakeDir's error is more than one line: %q", err)
			}
			if after, _ := os.Lstat(tc.dir); before != nil && (after == nil || after.Mode() != before.Mode()) {
				t.Errorf("MakeDir changed %s: %v, then %v", tc.dir, before.Mode(), after.Mode())
			}
			if _, err := os.Lstat(filepath.Join(tc.dir, "remediator.db")); err == nil {
				t.Errorf("a database was created in %s", tc.dir)
			}
		})
	}
}

func mkdir(t *testing.T, dir string, mode os.FileMode) {
	t.Helper()
	if err := os.Mkdir(dir, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, mode); err != nil { // whatever the umask
		t.Fatal(err)
	}
}
