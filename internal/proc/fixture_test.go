package proc

import (
	"os"
	"path/filepath"
	"testing"
)

// Container IDs and pod UIDs of testdata/proc.
const (
	fixDocker     = "3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c"
	fixContainerd = "a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4a1b2c3d4"
	fixCRIO       = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	fixCgroupfs   = "fedcba98fedcba98fedcba98fedcba98fedcba98fedcba98fedcba98fedcba98"
	fixPod1       = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
	fixPod2       = "6d0f0a87-5d0d-4c31-a2f6-4d8e52c2a1b9"
	fixStaticPod  = "e1f2c3d4a5b6978812345678deadbeef"
	fixPIDNS      = "pid:[4026531836]"
)

// fixtureCmdlines are written by newFixture: git keeps NULs badly.
var fixtureCmdlines = map[string]string{
	"1":   "/sbin/init\x00splash\x00",
	"100": "python3\x00train.py\x00--epochs\x0010\x00",
	"200": "/usr/bin/trainer\x00",
	"300": "python3\x00-m\x00vllm.entrypoints.openai.api_server\x00",
	"400": "(sd-pam)\x00",
	"500": "/app/worker\x00--gpu\x000\x00",
	"600": "", // zombies have no argv
}

// fixtureFDs are the fd symlinks newFixture makes: /proc/PID/fd/N -> target.
var fixtureFDs = map[string]map[string]string{
	"1": {"0": "/dev/null"},
	"100": {
		"0": "/dev/null", "1": "pipe:[1001]", "2": "pipe:[1001]",
		"3": "/dev/nvidiactl", "4": "/dev/nvidia0", "5": "/dev/nvidia-uvm",
		"6": "socket:[2002]", "7": "/dev/nvidia0", "8": "/data/train.bin",
	},
	"200": {"0": "/dev/null", "3": "/dev/nvidiactl", "4": "/dev/nvidia1", "5": "anon_inode:[eventfd]"},
	"300": {"3": "/dev/nvidiactl", "4": "/dev/nvidia0 (deleted)", "9": "/var/log/vllm.log"},
	"400": {},
	"500": {"0": "/dev/null", "1": "/dev/pts/0"},
	"600": {}, // zombies hold no descriptors
	// 700 vanished: no fd directory.
}

// newFixture copies testdata/proc into a temporary directory, adds what git
// cannot keep (symlinks, NULs), and returns an FS over it.
func newFixture(t testing.TB) FS {
	t.Helper()
	root := filepath.Join(t.TempDir(), "proc")
	if err := os.CopyFS(root, os.DirFS("testdata/proc")); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for pid, cmdline := range fixtureCmdlines {
		must(os.WriteFile(filepath.Join(root, pid, "cmdline"), []byte(cmdline), 0o444))
	}
	for pid, fds := range fixtureFDs {
		dir := filepath.Join(root, pid, "fd")
		must(os.Mkdir(dir, 0o755))
		for fd, target := range fds {
			must(os.Symlink(target, filepath.Join(dir, fd)))
		}
	}
	must(os.MkdirAll(filepath.Join(root, "1", "ns"), 0o755))
	must(os.Symlink(fixPIDNS, filepath.Join(root, "1", "ns", "pid")))
	must(os.Symlink("100", filepath.Join(root, "self")))

	fs, err := NewFS(root)
	if err != nil {
		t.Fatal(err)
	}
	return fs
}
