package store

import (
	"fmt"
	"path/filepath"

	"github.com/gpu-orphan/gpu-orphan/internal/privdir"
)

// DirMode is the mode of the store's directory when MakeDir creates it:
// the audit record holds every command line the remediator saw (the files
// themselves are FileMode, whatever the umask).
const DirMode = privdir.DirMode

// names are the words of the store's errors.
var names = privdir.Names{Dir: "the store directory", File: "the audit database", Writer: "the audit record", Flag: "--store.path"}

// MakeDir makes the directory of the audit database at path ready for
// Open: it creates it, DirMode, with any missing parents, when it does not
// exist, and checks the one it finds. Whoever writes an audit record (the
// remediator, gpu-orphan's prolog and epilog, `gpu-orphan clean
// --store.path`) calls it before Open, so that each creates the directory
// the others would; Open checks it again, through the descriptor it opens
// the database from.
//
// The directory must be one, not a symbolic link to one (whoever could
// write the link's own directory would choose where the record goes); it
// must belong to the user that runs this (anyone else could replace the
// database there); and neither its group nor others may write to it (they
// could replace the database, or plant it or its -wal or -shm as a link).
// Read access is left as it is: the files are FileMode. Its error is one
// sentence that ends with the command to run, or the flag to give.
func MakeDir(path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return fmt.Errorf("store path %q: %w", path, err)
	}
	d, err := privdir.Make(filepath.Dir(abs), names)
	if err != nil {
		return err
	}
	return d.Close()
}
