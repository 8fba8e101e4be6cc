// Package privdir keeps a daemon's files in a directory that no other user
// can change, and opens them there without following symbolic links.
//
// A daemon that runs as root and writes where a user can create files
// works for that user: a link named like the daemon's file makes root
// change the mode of, or read, or create, the file the user chose. So the
// directory must be a directory (not a link to one), belong to the user
// that runs the daemon, and be writable by no one else; it is checked
// through the descriptor that the files are then opened from, with
// O_NOFOLLOW. Its errors are one line that names the path and ends with
// what to run.
package privdir

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// DirMode is the mode of a directory that Make creates.
const DirMode os.FileMode = 0o700

// Names are the words of a kind of file in the errors: for the audit
// store, {"the store directory", "the audit database", "the audit
// record", "--store.path"}.
type Names struct {
	// Dir names the directory: "the store directory".
	Dir string
	// File names what is kept there: "the audit database".
	File string
	// Writer is what writes there: "the audit record".
	Writer string
	// Flag is the flag that chooses the path: "--store.path".
	Flag string
}

// Make makes the directory dir ready to keep files in: it creates it,
// DirMode, with any missing parents, when it does not exist, then opens
// and checks it as Open does.
func Make(dir string, n Names) (*Dir, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", n.Dir, dir, err)
	}
	if _, err := os.Lstat(abs); errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		if err := os.MkdirAll(abs, DirMode); err != nil {
			return nil, fmt.Errorf("%s %s cannot be created: %w; %s", n.Dir, abs, err, createAdvice(abs, err, n))
		}
	}
	return Open(abs, n)
}

// Open opens the directory dir without following a link, and checks it
// through the descriptor: it must be a directory, belong to the user that
// runs this, and be writable by neither its group nor others. Read
// access is left as it is: the files in it have their own modes.
func Open(dir string, n Names) (*Dir, error) { return open(dir, n, false) }

// OpenToRead is Open for a reader: the directory may also be root's (an
// unprivileged user reading the daemon's files that it may read).
func OpenToRead(dir string, n Names) (*Dir, error) { return open(dir, n, true) }

func open(dir string, n Names, rootToo bool) (*Dir, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", n.Dir, dir, err)
	}
	d, err := openNoFollow(abs, n)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s %s does not exist: %w", n.Dir, abs, err)
		}
		// A link, or not a directory: say which from what stands there.
		if fi, lerr := os.Lstat(abs); lerr == nil {
			if cerr := check(abs, fi, n, rootToo); cerr != nil {
				return nil, cerr
			}
		}
		return nil, fmt.Errorf("%s %s: %w", n.Dir, abs, err)
	}
	fi, err := d.stat()
	if err == nil {
		err = check(abs, fi, n, rootToo)
	}
	if err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// check checks what stands at dir.
func check(dir string, fi os.FileInfo, n Names, rootToo bool) error {
	if fi.Mode()&os.ModeSymlink != 0 {
		to, _ := os.Readlink(dir)
		return fmt.Errorf("%s %s is a symbolic link (to %s), which %s does not follow: "+
			"give %s a directory itself, or run `rm %s && install -d -m 0700 %s`", n.Dir, dir, to, n.Writer, n.Flag, ShellQuote(dir), ShellQuote(dir))
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s %s is not a directory: move it away, or give %s elsewhere", n.Dir, dir, n.Flag)
	}
	euid := os.Geteuid()
	if uid, ok := fileOwner(fi); !ok {
		return fmt.Errorf("%s %s: its owner cannot be read", n.Dir, dir)
	} else if uid != euid && (!rootToo || uid != 0) {
		return fmt.Errorf("%s %s belongs to %s, not to %s that writes %s there: run `chown -R %s %s`",
			n.Dir, dir, userName(uid), userName(euid), n.Writer, ownerArg(euid), ShellQuote(dir))
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		if fi.Mode()&os.ModeSticky != 0 {
			// /tmp: chmod would break it for everyone.
			return fmt.Errorf("%s %s has mode %#o, so users other than its owner could create %s there: "+
				"give %s a directory of its own (`install -d -m 0700 %s`)",
				n.Dir, dir, uint32(perm)|0o1000, n.File, n.Flag, ShellQuote(filepath.Join(dir, "gpu-orphan")))
		}
		return fmt.Errorf("%s %s has mode %#o, so users other than its owner could replace %s: run `chmod 0700 %s`",
			n.Dir, dir, perm, n.File, ShellQuote(dir))
	}
	return nil
}

// Path is the directory's absolute path.
func (d *Dir) Path() string { return d.path }

// SameFile reports whether path names, now, the file f: the one that was
// opened through the directory.
func SameFile(f *os.File, path string) bool {
	a, err := f.Stat()
	if err != nil {
		return false
	}
	b, err := os.Stat(path)
	return err == nil && os.SameFile(a, b)
}

// LinkError is the error for a symbolic link that stands where a file of
// the directory should be: it is not followed, and the line says so.
func LinkError(path string, n Names) error {
	to, _ := os.Readlink(path)
	return fmt.Errorf("%s %s is a symbolic link (to %s), which %s does not follow: remove it (`rm %s`), or give %s a file of its own",
		n.File, path, to, n.Writer, ShellQuote(path), n.Flag)
}

// createAdvice says what to run when dir could not be created.
func createAdvice(dir string, err error, n Names) string {
	if errors.Is(err, syscall.ENOTDIR) {
		return "a file stands in its path: give " + n.Flag + " elsewhere"
	}
	if errors.Is(err, os.ErrPermission) && os.Geteuid() != 0 {
		return fmt.Sprintf("run `sudo install -d -m 0700 -o %s %s`, or give %s a directory of your own", ownerArg(os.Geteuid()), ShellQuote(dir), n.Flag)
	}
	return fmt.Sprintf("run `install -d -m 0700 %s`, or give %s a writable directory", ShellQuote(dir), n.Flag)
}

// userName names a UID for a person: "root (UID 0)", or the UID alone.
func userName(uid int) string {
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil && u.Username != "" {
		return fmt.Sprintf("%s (UID %d)", u.Username, uid)
	}
	return fmt.Sprintf("UID %d", uid)
}

// ownerArg is a UID as chown and install -o take it: the name when the
// user database has one, else the number.
func ownerArg(uid int) string {
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil && u.Username != "" {
		return ShellQuote(u.Username)
	}
	return strconv.Itoa(uid)
}

// ShellQuote quotes s for a shell when it needs it.
func ShellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("/._-+:,@%=", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
