package proc

import (
	"os"
	"strings"
	"testing"
)

func TestMapsContain(t *testing.T) {
	maps := `55d0c0a00000-55d0c0a02000 r--p 00000000 fd:01 1234   /usr/bin/python3.11
7f1c00000000-7f1c00200000 rw-s 00000000 00:05 1038   /dev/nvidia0
7f1c00400000-7f1c00600000 rw-s 00000000 00:05 1039   /dev/nvidiactl
7f1c00800000-7f1c00a00000 rw-s 00000000 00:05 1040   /dev/nvidia-uvm (deleted)
7ffd8b5fe000-7ffd8b61f000 rw-p 00000000 00:00 0      [stack]
`
	for _, tc := range []struct {
		path string
		want bool
	}{
		{"/dev/nvidia0", true},
		{"/dev/nvidia1", false},
		{"/dev/nvidia", false},
		{"/dev/nvidia-uvm", true},
		{"[stack]", false},
	} {
		got, err := mapsContain(strings.NewReader(maps), tc.path)
		if err != nil || got != tc.want {
			t.Errorf("mapsContain(%q) = %v, %v; want %v", tc.path, got, err, tc.want)
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
	if ok, err := fs.Maps(os.Getpid(), exe); err != nil || !ok {
		t.Errorf("our own binary %s is not in our maps: %v %v", exe, ok, err)
	}
	if ok, _ := fs.Maps(os.Getpid(), "/dev/nvidia0"); ok {
		t.Error("this test process maps no GPU")
	}
}
