package proc

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// Maps reports whether the process has path mapped into its memory
// (/proc/PID/maps). A CUDA context maps its GPU's device node, and forked
// children inherit the mapping; tools that only query NVML keep the node
// open without mapping it.
func (fs FS) Maps(pid int, path string) (bool, error) {
	f, err := os.Open(filepath.Join(fs.root, strconv.Itoa(pid), "maps"))
	if err != nil {
		return false, fs.wrap(pid, "maps", err)
	}
	defer f.Close()
	return mapsContain(f, path)
}

// mapsContain scans maps lines ("addr perms offset dev inode   path") for
// one whose path is exactly path.
func mapsContain(r interface{ Read([]byte) (int, error) }, path string) (bool, error) {
	want := []byte(path)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		i := bytes.IndexByte(line, '/')
		if i < 0 {
			continue
		}
		if bytes.Equal(bytes.TrimSuffix(line[i:], []byte(" (deleted)")), want) {
			return true, nil
		}
	}
	if err := sc.Err(); err != nil {
		return false, fmt.Errorf("reading maps: %w", err)
	}
	return false, nil
}
