// Package store is the remediator's durable audit log and work queue: every
// notification, every alert's fate, every action with its plan, evidence
// and result, and the circuit breaker's state. It is one SQLite file in WAL
// mode with synchronous=FULL, so a decision is on disk before the webhook
// is acknowledged or a signal is sent.
package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/privdir"
	_ "modernc.org/sqlite" // registers the "sqlite" driver
)

// BusyTimeout is how long a write waits for another connection (the CLI on
// the same file) to release the lock before it fails.
const BusyTimeout = 5 * time.Second

// ErrNotFound is returned when an action does not exist.
var ErrNotFound = errors.New("no such action")

// ErrNoRoom is returned by Ping when the store could not grow to record the
// next decisions.
var ErrNoRoom = errors.New("store has no room for new records")

// Store is the audit log and work queue. It is safe for concurrent use.
type Store struct {
	db    *sql.DB
	path  string
	ids   idSource
	retry RetryPolicy
}

// Open opens (creating if needed) the store at path and migrates its
// schema. The path's directory must exist, be writable, and pass
// MakeDir's checks; the database and its -wal, -shm and -journal are
// opened there without following links (a link is refused, in one line
// that says what to run).
func Open(ctx context.Context, path string) (*Store, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("store path %q: %w", path, err)
	}
	dir, err := privdir.Open(filepath.Dir(abs), names)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	if err := checkWritable(dir); err != nil {
		return nil, err
	}
	file, err := privateFiles(dir, filepath.Base(abs))
	if err != nil {
		return nil, err
	}
	defer file.Close()

	// Pragmas go in the DSN so that a connection the pool replaces gets
	// them too. _txlock=immediate takes the write lock at BEGIN: a
	// deferred transaction that upgrades later can fail with SQLITE_BUSY
	// without waiting on busy_timeout.
	q := url.Values{}
	q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", BusyTimeout.Milliseconds()))
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(FULL)")
	q.Add("_pragma", "foreign_keys(1)")
	q.Set("_txlock", "immediate")
	dsn := "file:" + (&url.URL{Path: abs}).EscapedPath() + "?" + q.Encode()

	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("opening store %s: %w", abs, err)
	}
	// SQLite has one writer at a time anyway; one connection makes the
	// per-connection pragmas (and test-only limits) apply to every call.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)

	s := &Store{db: db, path: abs, retry: RetryPolicy{MaxAttempts: DefaultMaxAttempts}}
	if err := s.sameFile(ctx, file); err != nil {
		db.Close()
		return nil, err
	}
	if err := s.init(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("opening store %s: %w", abs, err)
	}
	return s, nil
}

// sameFile checks that the file SQLite opened is the one checked through
// the directory's descriptor: SQLite opens by path, and follows links.
func (s *Store) sameFile(ctx context.Context, checked *os.File) error {
	var seq int
	var name, opened string
	if err := s.db.QueryRowContext(ctx, "PRAGMA database_list").Scan(&seq, &name, &opened); err != nil {
		return fmt.Errorf("opening store %s: %w", s.path, err)
	}
	if !privdir.SameFile(checked, opened) {
		return fmt.Errorf("the audit database %s changed while it was opened (SQLite opened %s): is another user renaming directories above it? Give --store.path a directory whose parents only root can write", s.path, opened)
	}
	return nil
}

// OpenReadOnly opens an existing store to read it (gpu-orphan report,
// and the lineage that ps and clean read), never writing to it: no
// migration, no probe file. Its directory is checked as Open checks it,
// except that it may also be root's, and the database is not a link. A
// store of an older schema is refused with what to do; a newer one is
// read, since migrations only add.
func OpenReadOnly(ctx context.Context, path string) (*Store, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("store path %q: %w", path, err)
	}
	dir, err := privdir.OpenToRead(filepath.Dir(abs), names)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no audit database at %s: %w", abs, os.ErrNotExist)
	}
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	file, err := dir.OpenFile(filepath.Base(abs), os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no audit database at %s: %w", abs, os.ErrNotExist)
	}
	if err != nil {
		return nil, err
	}
	defer file.Close()
	q := url.Values{}
	q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", BusyTimeout.Milliseconds()))
	q.Add("_pragma", "query_only(1)")
	q.Set("mode", "ro")
	dsn := "file:" + (&url.URL{Path: abs}).EscapedPath() + "?" + q.Encode()
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("opening store %s: %w", abs, err)
	}
	db.SetMaxOpenConns(1)
	s := &Store{db: db, path: abs}
	if err := s.sameFile(ctx, file); err != nil {
		db.Close()
		return nil, err
	}
	var v int
	if err := db.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
		db.Close()
		return nil, fmt.Errorf("reading the audit database %s: %w", abs, err)
	}
	if v < SchemaVersion {
		db.Close()
		if v == 0 {
			return nil, fmt.Errorf("%s is not a gpu-orphan audit database (schema version 0)", abs)
		}
		return nil, fmt.Errorf("the audit database %s has schema version %d, older than this binary's %d: start this version's gpu-orphan-remediator on it once to migrate it", abs, v, SchemaVersion)
	}
	return s, nil
}

// checkWritable tries to create a file in dir: the only test that holds
// for root, read-only mounts and ACLs alike; SQLite also needs to create
// -wal and -shm there.
func checkWritable(dir *privdir.Dir) error {
	name := fmt.Sprintf(".gpu-orphan-store-probe-%d-%d", os.Getpid(), time.Now().UnixNano())
	f, err := dir.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("store directory %s is not writable: %w", dir.Path(), err)
	}
	f.Close()
	if err := dir.Remove(name); err != nil {
		return fmt.Errorf("store directory %s: removing probe file: %w", dir.Path(), err)
	}
	return nil
}

// FileMode is the mode of the audit database and of its -wal and -shm
// files: they hold every command line of every process that was signalled
// or excluded, which other users of the node must not read.
const FileMode os.FileMode = 0o600

// privateFiles creates the database file with FileMode, or brings an
// existing one (and its -wal, -shm and -journal) to it, before SQLite
// opens it; none of them is followed if it is a link: a link is refused.
// SQLite creates a new database with 0644 less the umask, but it creates
// -wal and -shm with the database's own mode, whatever the umask: so a
// 0600 database gives 0600 companions. The database stays open, for
// Open to check that SQLite opened the same file.
func privateFiles(dir *privdir.Dir, base string) (*os.File, error) {
	abs := filepath.Join(dir.Path(), base)
	f, err := dir.OpenFile(base, os.O_RDWR|os.O_CREATE, FileMode)
	if err != nil {
		return nil, err
	}
	if err := private(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("the audit database %s: %w", abs, err)
	}
	for _, suffix := range []string{"-wal", "-shm", "-journal"} {
		side, err := dir.OpenFile(base+suffix, os.O_RDWR, 0)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			f.Close()
			return nil, err
		}
		err = private(side)
		side.Close()
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("the audit database's %s: %w", abs+suffix, err)
		}
	}
	return f, nil
}

// private brings f to FileMode.
func private(f *os.File) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Mode().Perm() != FileMode {
		if err := f.Chmod(FileMode); err != nil {
			return fmt.Errorf("it has mode %#o, which lets other users read it, and could not be made %#o: %w", fi.Mode().Perm(), FileMode, err)
		}
	}
	return nil
}

// init checks that the pragmas took effect and migrates the schema.
func (s *Store) init(ctx context.Context) error {
	var mode string
	if err := s.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return fmt.Errorf("reading journal_mode: %w", err)
	}
	if mode != "wal" {
		// WAL needs shared memory; some network file systems refuse it.
		return fmt.Errorf("journal_mode is %q, not wal: is the store on a local file system?", mode)
	}
	var sync int
	if err := s.db.QueryRowContext(ctx, "PRAGMA synchronous").Scan(&sync); err != nil {
		return fmt.Errorf("reading synchronous: %w", err)
	}
	if sync != 2 {
		return fmt.Errorf("synchronous is %d, want 2 (FULL)", sync)
	}
	return s.migrate(ctx)
}

// Path is the absolute path of the database file.
func (s *Store) Path() string { return s.path }

// Close closes the database. WAL contents are checkpointed by SQLite when
// the last connection closes.
func (s *Store) Close() error {
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("closing store %s: %w", s.path, err)
	}
	return nil
}

// withTx runs fn in one write transaction and commits it. After an error
// the transaction is rolled back; SQLite may already have done so itself
// (SQLITE_FULL), which makes the rollback's own error meaningless.
func (s *Store) withTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("beginning transaction: %w", err)
	}
	if err := fn(tx); err != nil {
		tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("committing: %w", err)
	}
	return nil
}

// Ping proves the store accepts durable writes: it updates a heartbeat row
// (a real, fsynced commit) and checks there is room to grow. The remediator
// refuses to act while Ping fails, because it could not record what it did.
func (s *Store) Ping(ctx context.Context) error {
	now := formatTime(time.Now())
	err := s.withTx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO heartbeat(id, at, beats) VALUES (1, ?, 1)
			ON CONFLICT(id) DO UPDATE SET at = excluded.at, beats = beats + 1`, now)
		return err
	})
	if err != nil {
		return fmt.Errorf("store %s does not accept writes: %w", s.path, err)
	}
	return s.checkRoom(ctx)
}

// minFreePages is the headroom Ping wants inside the database's size limit:
// an update in place fits in existing pages, but new actions do not.
const minFreePages = 64

// minFreeBytes is the free space Ping wants on the file system, for the WAL
// to grow before a checkpoint.
const minFreeBytes = 1 << 20

// CheckRoom reports, without writing, whether the store has the room that
// Ping wants for new records (ErrNoRoom if not). The webhook intake refuses
// new notifications while it fails, so that they do not use up the reserve
// that running actions need to record their results.
func (s *Store) CheckRoom(ctx context.Context) error { return s.checkRoom(ctx) }

func (s *Store) checkRoom(ctx context.Context) error {
	var pages, free, maxPages int64
	err := s.db.QueryRowContext(ctx,
		`SELECT p.page_count, f.freelist_count, m.max_page_count
		 FROM pragma_page_count() p, pragma_freelist_count() f, pragma_max_page_count() m`).Scan(&pages, &free, &maxPages)
	if err != nil {
		return fmt.Errorf("store %s: reading its size: %w", s.path, err)
	}
	if room := maxPages - pages + free; room < minFreePages {
		return fmt.Errorf("store %s: %w: %d free pages below its limit of %d", s.path, ErrNoRoom, room, maxPages)
	}
	avail, err := freeBytes(filepath.Dir(s.path))
	if err != nil {
		return fmt.Errorf("store %s: %w", s.path, err)
	}
	if avail < minFreeBytes {
		return fmt.Errorf("store %s: %w: %d bytes free on its file system", s.path, ErrNoRoom, avail)
	}
	return nil
}

// SetBreaker records the circuit breaker's state so that it survives a
// restart: an open breaker stays open until a human resets it.
func (s *Store) SetBreaker(ctx context.Context, open bool, reason string, at time.Time) error {
	err := s.withTx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO breaker(id, open, reason, at) VALUES (1, ?, ?, ?)
			ON CONFLICT(id) DO UPDATE SET open = excluded.open, reason = excluded.reason, at = excluded.at`,
			open, reason, formatTime(at))
		return err
	})
	if err != nil {
		return fmt.Errorf("recording breaker state: %w", err)
	}
	return nil
}

// Breaker returns the recorded breaker state; closed with a zero time when
// none was ever recorded.
func (s *Store) Breaker(ctx context.Context) (open bool, reason string, at time.Time, err error) {
	var ts string
	err = s.db.QueryRowContext(ctx, `SELECT open, reason, at FROM breaker WHERE id = 1`).Scan(&open, &reason, &ts)
	if errors.Is(err, sql.ErrNoRows) {
		return false, "", time.Time{}, nil
	}
	if err != nil {
		return false, "", time.Time{}, fmt.Errorf("reading breaker state: %w", err)
	}
	if at, err = parseTime(ts); err != nil {
		return false, "", time.Time{}, fmt.Errorf("reading breaker state: %w", err)
	}
	return open, reason, at, nil
}

// Duplicates is how many alert deliveries were duplicates of one already
// recorded (HA replicas, retries), since the store was created.
func (s *Store) Duplicates(ctx context.Context) (int64, error) {
	var n int64
	err := s.db.QueryRowContext(ctx, `SELECT value FROM counters WHERE name = 'duplicates'`).Scan(&n)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading duplicates counter: %w", err)
	}
	return n, nil
}
