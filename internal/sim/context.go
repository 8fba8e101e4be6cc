package sim

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// Context is the record of one simulated CUDA context, as stored in
// DIR/contexts/*.json.
//
// The file is alive while any process holds the descriptor its creator
// opened: the creator takes flock(LOCK_SH) on it, and the lock belongs to the
// open file description, which forked or exec'd children share. So the lock
// goes away exactly when the last holder closes it, as the real driver frees
// a context's memory when its last descriptor closes (docs/facts.md).
type Context struct {
	GPU int `json:"gpu"`
	// PID and StartTime (field 22 of /proc/PID/stat) name the creator, which
	// NVML keeps reporting as the owner even after it has died.
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	UsedBytes uint64 `json:"used_bytes"`
	// Path is the context's file; it is not stored in the record.
	Path string `json:"-"`
}

const maxContextBytes = 4096

// createContext writes c into the node's contexts directory and returns the
// locked descriptor that keeps it alive. The record is complete and fsynced
// before the rename makes it visible, so readers never see half of one.
// It sets c.Path.
func createContext(n *Node, c *Context) (*os.File, error) {
	var rnd [4]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	name := fmt.Sprintf("gpu%d-pid%d-%d-%s.json", c.GPU, c.PID, c.StartTime, hex.EncodeToString(rnd[:]))
	final := filepath.Join(n.contextsDir(), name)
	tmp := filepath.Join(n.contextsDir(), "."+name+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("sim: creating context: %w", err)
	}
	fail := func(err error) (*os.File, error) {
		f.Close() // drops the lock: the context was never visible
		os.Remove(tmp)
		return nil, fmt.Errorf("sim: creating context: %w", err)
	}
	if err := flock(f, unix.LOCK_SH); err != nil {
		return fail(err)
	}
	data, err := json.Marshal(c)
	if err != nil {
		return fail(err)
	}
	if _, err := f.Write(append(data, '\n')); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return fail(err)
	}
	c.Path = final
	return f, nil
}

// listContexts returns the node's live contexts, sorted by GPU then PID.
// Dead ones are deleted on the way: that is the driver freeing their memory.
func listContexts(n *Node) ([]Context, error) {
	entries, err := os.ReadDir(n.contextsDir())
	if err != nil {
		return nil, fmt.Errorf("sim: listing contexts: %w", err)
	}
	var out []Context
	for _, e := range entries {
		name := e.Name()
		// Dot files are contexts still being written, and the allocator's lock.
		if strings.HasPrefix(name, ".") || !strings.HasSuffix(name, ".json") || !e.Type().IsRegular() {
			continue
		}
		c, alive, err := probeContext(filepath.Join(n.contextsDir(), name))
		if errors.Is(err, fs.ErrNotExist) {
			continue // collected by a concurrent reader
		}
		if err != nil {
			return nil, err
		}
		if alive {
			out = append(out, c)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].GPU != out[j].GPU {
			return out[i].GPU < out[j].GPU
		}
		return out[i].PID < out[j].PID
	})
	return out, nil
}

// probeContext tells whether anyone still holds the context at path, and
// deletes it when no one does.
func probeContext(path string) (Context, bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return Context{}, false, err
	}
	defer f.Close() // also drops whatever lock we took
	err = flock(f, unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		// No holder left. Delete only if path still names this file, so a
		// context created under the same name later can never be lost.
		if st, err := os.Stat(path); err == nil {
			if fi, err := f.Stat(); err == nil && os.SameFile(st, fi) {
				os.Remove(path)
			}
		}
		return Context{}, false, nil
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		return Context{}, false, fmt.Errorf("sim: locking context %s: %w", path, err)
	}
	// Held. A workload holds LOCK_SH; a reader collecting the file holds
	// LOCK_EX, which makes LOCK_SH fail too. Telling them apart keeps two
	// concurrent readers from counting a dead context as alive.
	if err := flock(f, unix.LOCK_SH|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return Context{}, false, nil
		}
		return Context{}, false, fmt.Errorf("sim: locking context %s: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Context{}, false, fmt.Errorf("sim: %w", err)
	}
	if st.Nlink == 0 {
		return Context{}, false, nil // collected between our two locks
	}
	c, err := parseContext(io.LimitReader(f, maxContextBytes+1))
	if err != nil {
		return Context{}, false, fmt.Errorf("sim: context %s: %w", path, err)
	}
	c.Path = path
	return c, true, nil
}

func parseContext(r io.Reader) (Context, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return Context{}, err
	}
	if len(data) > maxContextBytes {
		return Context{}, fmt.Errorf("larger than %d bytes", maxContextBytes)
	}
	var c Context
	if err := decodeStrict(data, &c, "gpu", "pid", "start_time", "used_bytes"); err != nil {
		return Context{}, err
	}
	if c.PID <= 0 {
		return Context{}, fmt.Errorf("bad pid %d", c.PID)
	}
	if c.GPU < 0 {
		return Context{}, fmt.Errorf("bad gpu %d", c.GPU)
	}
	return c, nil
}

// flock retries on EINTR: Go's runtime interrupts system calls with its own
// preemption signal.
func flock(f *os.File, how int) error {
	for {
		err := unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}
