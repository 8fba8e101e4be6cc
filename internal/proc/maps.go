package proc

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// Maps reports whether the holding process maps the device it holds
// (/proc/PID/maps). A CUDA context maps its GPU's device node, and forked
// children inherit the mapping; tools that only query NVML keep the node
// open without mapping it. A maps line matches by its "dev inode" pair,
// never by the path it prints: the pair is that of one of the files the
// process's descriptors hold (devtmpfs's, 00:06 on the H200, not the
// GPU's).
func (fs FS) Maps(h Holding) (bool, error) {
	path := filepath.Join(fs.root, strconv.Itoa(h.PID), "maps")
	if h.Via != 0 && h.Via != h.PID {
		path = filepath.Join(fs.root, strconv.Itoa(h.PID), "task", strconv.Itoa(h.Via), "maps")
	}
	f, err := os.Open(path)
	if err != nil {
		return false, fs.wrap(h.PID, "maps", err)
	}
	defer f.Close()
	return mapsFile(f, h.Files)
}

// mapsFile scans maps lines ("addr perms offset dev inode   path") for one
// whose dev and inode are one of files.
func mapsFile(r io.Reader, files []FileID) (bool, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		id, ok := parseMapsFile(sc.Bytes())
		if ok && id.Ino != 0 && slices.Contains(files, id) {
			return true, nil
		}
	}
	if err := sc.Err(); err != nil {
		return false, fmt.Errorf("reading maps: %w", err)
	}
	return false, nil
}

// parseMapsFile reads fields 4 (dev, "major:minor" in hex) and 5 (inode,
// decimal) of one maps line.
func parseMapsFile(line []byte) (FileID, bool) {
	var f [5][]byte
	rest := line
	for k := range f {
		rest = bytes.TrimLeft(rest, " ")
		end := bytes.IndexByte(rest, ' ')
		if end < 0 {
			end = len(rest)
		}
		f[k], rest = rest[:end], rest[end:]
	}
	major, minor, ok := bytes.Cut(f[3], []byte{':'})
	if !ok {
		return FileID{}, false
	}
	maj, err1 := strconv.ParseUint(string(major), 16, 32)
	mnr, err2 := strconv.ParseUint(string(minor), 16, 32)
	ino, err3 := strconv.ParseUint(string(f[4]), 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return FileID{}, false
	}
	return FileID{Dev: unix.Mkdev(uint32(maj), uint32(mnr)), Ino: ino}, true
}
