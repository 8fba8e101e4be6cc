package proc

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMapsFile(t *testing.T) {
	// The H200's maps of a PyTorch process: devtmpfs is 00:06, nvidia0's
	// inode 143. The path a line prints never counts.
	maps := `55d0c0a00000-55d0c0a02000 r--p 00000000 fd:01 1234   /usr/bin/python3.11
7f1c00000000-7f1c00200000 rw-s 00000000 00:06 143    /dev/nvidia0
7f1c00400000-7f1c00600000 rw-s 00000000 00:06 142    /dev/nvidiactl
7f1c00800000-7f1c00a00000 rw-s 00000000 00:06 150    /dev/nvidia1 (deleted)
7f1c00c00000-7f1c00e00000 rw-s 00000000 fe:00 143    /dev/nvidia0
7ffd8b5fe000-7ffd8b61f000 rw-p 00000000 00:00 0      [stack]
`
	devtmpfs := unix.Mkdev(0, 6)
	for _, tc := range []struct {
		name  string
		files []FileID
		want  bool
	}{
		{"nvidia0", []FileID{{devtmpfs, 143}}, true},
		{"nvidia1, deleted since", []FileID{{devtmpfs, 150}}, true},
		{"another inode", []FileID{{devtmpfs, 144}}, false},
		{"same inode, another file system", []FileID{{unix.Mkdev(0, 5), 143}}, false},
		{"ext4 fe:00", []FileID{{unix.Mkdev(0xfe, 0), 143}}, true},
		{"anonymous mappings have inode 0", []FileID{{0, 0}}, false},
		{"none", nil, false},
	} {
		got, err := mapsFile(strings.NewReader(maps), tc.files)
		if err != nil || got != tc.want {
			t.Errorf("%s: mapsFile = %v, %v; want %v", tc.name, got, err, tc.want)
		}
	}
}

func TestMapsOwnProcess(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(exe, &st); err != nil {
		t.Fatal(err)
	}
	self := Holding{PID: os.Getpid(), Via: os.Getpid(), Files: []FileID{{st.Dev, st.Ino}}}
	if ok, err := fs.Maps(self); err != nil || !ok {
		t.Errorf("our own binary %s is not in our maps: %v %v", exe, ok, err)
	}
	self.Files = []FileID{{st.Dev, st.Ino + 1}}
	if ok, _ := fs.Maps(self); ok {
		t.Error("a file we do not map is in our maps")
	}
}
