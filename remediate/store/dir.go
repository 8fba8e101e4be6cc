package store

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

// DirMode is the mode of the store's directory when MakeDir creates it:
// the audit record holds every command line the remediator saw (the files
// themselves are FileMode, whatever the umask).
const DirMode os.FileMode = 0o700

// MakeDir makes the directory of the audit database at path ready for
// Open: it creates it, DirMode, with any missing parents, when it does not
// exist, and checks the one it finds. Whoever writes an audit record (the
// remediator, gpu-orphan's prolog and epilog, `gpu-orphan clean
// --store.path`) calls it before Open, so that each creates the directory
// the others would and trusts only the directory the others would.
//
// The directory must be one, not a symbolic link to one (whoever could
// write the link's own directory would choose where the record goes); it
// must belong to the user that runs this (anyone else could replace the
// database there); and neither its group nor others may write to it (they
// could replace the database, or plant its -wal or -shm as a link). Read
// access is left as it is: the files are FileMode. Its error is one
// sentence that ends with the command to run, or the flag to give.
func MakeDir(path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return fmt.Errorf("store path %q: %w", path, err)
	}
	dir := filepath.Dir(abs)
	fi, err := os.Lstat(dir)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		if err := os.MkdirAll(dir, DirMode); err != nil {
			return fmt.Errorf("the store directory %s cannot be created: %w; %s", dir, err, createAdvice(dir, err))
		}
		fi, err = os.Lstat(dir)
	}
	if err != nil {
		return fmt.Errorf("the store directory %s: %w", dir, err)
	}
	return checkOwnDir(dir, fi)
}

// checkOwnDir checks what MakeDir found at dir.
func checkOwnDir(dir string, fi os.FileInfo) error {
	if fi.Mode()&os.ModeSymlink != 0 {
		to, _ := os.Readlink(dir)
		return fmt.Errorf("the store directory %s is a symbolic link (to %s), which the audit record does not follow: "+
			"give --store.path a directory itself, or run `rm %s && install -d -m 0700 %s`", dir, to, shellQuote(dir), shellQuote(dir))
	}
	if !fi.IsDir() {
		return fmt.Errorf("the store directory %s is not a directory: move it away, or give --store.path elsewhere", dir)
	}
	if uid, ok := fileOwner(fi); !ok {
		return fmt.Errorf("the store directory %s: its owner cannot be read", dir)
	} else if euid := os.Geteuid(); uid != euid {
		return fmt.Errorf("the store directory %s belongs to %s, not to %s that writes the audit record there: run `chown -R %s %s`",
			dir, userName(uid), userName(euid), ownerArg(euid), shellQuote(dir))
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("the store directory %s has mode %#o, so users other than its owner could replace the audit database: run `chmod 0700 %s`",
			dir, perm, shellQuote(dir))
	}
	return nil
}

// createAdvice says what to run when dir could not be created.
func createAdvice(dir string, err error) string {
	if errors.Is(err, syscall.ENOTDIR) {
		return "a file stands in its path: give --store.path elsewhere"
	}
	if errors.Is(err, os.ErrPermission) && os.Geteuid() != 0 {
		return fmt.Sprintf("run `sudo install -d -m 0700 -o %s %s`, or give --store.path a directory of your own", ownerArg(os.Geteuid()), shellQuote(dir))
	}
	return fmt.Sprintf("run `install -d -m 0700 %s`, or give --store.path a writable directory", shellQuote(dir))
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
		return shellQuote(u.Username)
	}
	return strconv.Itoa(uid)
}

// shellQuote quotes s for a shell when it needs it.
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("/._-+:,@%=", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
