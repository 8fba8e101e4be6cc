package store

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// hostile is the scene of issue 24, item 4 (testenv.Neighbour): a
// user's directory in a /tmp, holding links that the user made to root's
// files.
type hostile struct {
	*testenv.Neighbour
	victim string // root's file, 0644
	secret string // root's directory, 0700, where no database belongs
}

const victimText = "root's file\n"

func newHostile(t *testing.T) *hostile {
	t.Helper()
	h := &hostile{Neighbour: testenv.NewNeighbour(t)}
	h.victim = filepath.Join(h.Base, "victim")
	if err := os.WriteFile(h.victim, []byte(victimText), 0o644); err != nil {
		t.Fatal(err)
	}
	chmod(t, h.victim, 0o644)
	h.secret = filepath.Join(h.Base, "secret")
	mkdir(t, h.secret, 0o700)
	return h
}

// untouched fails the test if root's file or directory changed.
func (h *hostile) untouched(t *testing.T) {
	t.Helper()
	fi, err := os.Stat(h.victim)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("root's file %s was made %#o", h.victim, fi.Mode().Perm())
	}
	if b, _ := os.ReadFile(h.victim); !bytes.Equal(b, []byte(victimText)) {
		t.Errorf("root's file %s was written: %q", h.victim, b)
	}
	if entries, _ := os.ReadDir(h.secret); len(entries) > 0 {
		t.Errorf("root's directory %s holds %s, which the user chose", h.secret, entries[0].Name())
	}
}

// TestOpenRefusesLinks: a user made a directory in /tmp and, in it, the
// audit database (or its -wal) as a link to root's file, or a dangling
// link into root's directory. The remediator (MakeDir, then Open)
// refuses the user's directory; Open alone refuses it too. The operator
// runs what the line says (`chown -R root DIR`, which does not follow
// the links): the directory is root's now, and Open refuses the link, in
// one line that names it and what to run. Root's file keeps its mode and
// its bytes, and nothing is created where the link pointed. (Root chmod-ed
// the file 0600, or created the database where the user chose.)
func TestOpenRefusesLinks(t *testing.T) {
	h := newHostile(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name, dir, link, target string
	}{
		{"database to root's file", "db", "r.db", h.victim},
		{"dangling database", "dangling", "r.db", filepath.Join(h.secret, "chosen.db")},
		{"-wal to root's file", "wal", "r.db-wal", h.victim},
		{"-shm to root's file", "shm", "r.db-shm", h.victim},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := h.Dir(t, tc.dir, map[string]string{tc.link: tc.target})
			path := filepath.Join(dir, "r.db")

			if s, err := Open(ctx, path); err == nil {
				s.Close()
				t.Errorf("Open took the store in %s, the user's directory", dir)
			} else if !strings.Contains(err.Error(), "the store directory "+dir+" belongs to ") {
				t.Errorf("Open in the user's directory: %v", err)
			}
			h.untouched(t)

			err := MakeDir(path)
			if err == nil {
				t.Fatalf("MakeDir accepted %s, the user's directory", dir)
			}
			fix := command(t, err)
			if !strings.HasPrefix(fix, "chown -R root ") {
				t.Fatalf("MakeDir: %v; want it to say `chown -R root %s`", err, dir)
			}
			if out, err := exec.Command("sh", "-c", fix).CombinedOutput(); err != nil {
				t.Fatalf("%s: %v %s", fix, err, out)
			}
			if err := MakeDir(path); err != nil {
				t.Fatalf("MakeDir after `%s`: %v", fix, err)
			}

			s, err := Open(ctx, path)
			if err == nil {
				s.Close()
				t.Fatalf("Open followed %s -> %s", filepath.Join(dir, tc.link), tc.target)
			}
			link := filepath.Join(dir, tc.link)
			for _, says := range []string{link + " is a symbolic link (to " + tc.target + ")", "`rm " + link + "`"} {
				if !strings.Contains(err.Error(), says) {
					t.Errorf("Open: %q\ndoes not say %q", err, says)
				}
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("Open's error is more than one line: %q", err)
			}
			h.untouched(t)

			// What the line says to run makes the store usable.
			if out, err := exec.Command("sh", "-c", command(t, err)).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			s, err = Open(ctx, path)
			if err != nil {
				t.Fatalf("Open after removing the link: %v", err)
			}
			s.Close()
			h.untouched(t)
		})
	}
}

// TestOpenReadOnlyRefusesLinks: `gpu-orphan report`, `ps` and `clean`
// read the store (clean and ps read the proof of descent there): a link
// is not followed, and a directory that a user owns is not read from.
func TestOpenReadOnlyRefusesLinks(t *testing.T) {
	h := newHostile(t)
	ctx := context.Background()
	real := filepath.Join(t.TempDir(), "real.db")
	openTest(t, real).Close()

	dir := h.Dir(t, "report", map[string]string{"r.db": real})
	if s, err := OpenReadOnly(ctx, filepath.Join(dir, "r.db")); err == nil {
		s.Close()
		t.Errorf("OpenReadOnly read a database in %s, the user's directory", dir)
	} else if !strings.Contains(err.Error(), "the store directory "+dir+" belongs to ") {
		t.Errorf("OpenReadOnly in the user's directory: %v", err)
	}
	if out, err := exec.Command("chown", "-R", "root", dir).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	if s, err := OpenReadOnly(ctx, filepath.Join(dir, "r.db")); err == nil {
		s.Close()
		t.Errorf("OpenReadOnly followed %s -> %s", filepath.Join(dir, "r.db"), real)
	} else if !strings.Contains(err.Error(), "is a symbolic link (to "+real+")") {
		t.Errorf("OpenReadOnly of a link: %v", err)
	}
	// The real one reads.
	s, err := OpenReadOnly(ctx, real)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
}

// command is the command that err says to run, between its last
// backquotes.
func command(t *testing.T, err error) string {
	t.Helper()
	msg := err.Error()
	end := strings.LastIndex(msg, "`")
	start := strings.LastIndex(msg[:max(end, 0)], "`")
	if start < 0 || end <= start {
		t.Fatalf("%q names no command to run", msg)
	}
	return msg[start+1 : end]
}

func chmod(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}
