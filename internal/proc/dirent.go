package proc

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"
)

// direntBufSize holds the fd table of a typical process in one getdents call.
const direntBufSize = 16 << 10

// eachDirent calls fn with the name of every linux_dirent64 record in buf.
// The name aliases buf. Parsing the records in place spares os.ReadDir's
// allocation of a string and a DirEntry per name, which matters on the
// Holders path: ~50,000 fd entries per scan.
func eachDirent(buf []byte, fn func(name []byte)) {
	// struct linux_dirent64 { u64 d_ino; s64 d_off; u16 d_reclen; u8 d_type; char d_name[]; }
	const nameOff = 19
	for len(buf) >= nameOff {
		reclen := int(binary.NativeEndian.Uint16(buf[16:18]))
		if reclen < nameOff || reclen > len(buf) {
			return
		}
		name := buf[nameOff:reclen]
		for i, c := range name {
			if c == 0 {
				name = name[:i]
				break
			}
		}
		fn(name)
		buf = buf[reclen:]
	}
}

// atoi parses a decimal PID or fd number; ok is false for anything else
// ("self", "net", ".", overflow).
func atoi(b []byte) (n int, ok bool) {
	if len(b) == 0 || len(b) > 9 {
		return 0, false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

// readPIDs appends the numeric entries of the open procfs root dirfd to pids.
func readPIDs(dirfd int, pids []int) ([]int, error) {
	buf := make([]byte, direntBufSize)
	for {
		n, err := unix.Getdents(dirfd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return pids, fmt.Errorf("getdents: %w", err)
		}
		if n <= 0 {
			return pids, nil
		}
		eachDirent(buf[:n], func(name []byte) {
			if pid, ok := atoi(name); ok {
				pids = append(pids, pid)
			}
		})
	}
}
