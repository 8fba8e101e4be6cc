package store

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestFileModesUnderPermissiveUmask: with umask 000 (a container's
// default in some runtimes), the database, its -wal and its -shm are 0600;
// a database that an older version left 0644 is brought to 0600 when
// opened.
func TestFileModesUnderPermissiveUmask(t *testing.T) {
	dir := t.TempDir() // 0700: MakeDir would make it so; the files are this test's
	old := syscall.Umask(0)
	defer syscall.Umask(old)

	path := filepath.Join(dir, "store.db")
	s := openTest(t, path)
	record(t, s, firing("01", t0)) // the WAL and its index exist now
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %#o under umask 000, want 0600", filepath.Base(p), fi.Mode().Perm())
		}
	}

	// An older version's files, readable by every user, while it runs.
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		if err := os.Chmod(p, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	again := openTest(t, path)
	if _, err := again.Actions(context.Background(), Filter{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s of an older version: mode %#o after Open, want 0600", filepath.Base(p), fi.Mode().Perm())
		}
	}
}

// TestRoomIncludesRootReserve: an unprivileged user fills an ext4 file
// system; the blocks ext4 keeps for root remain. The remediator runs as
// root and may write into them, so its store still has room: its
// heartbeat and CheckRoom pass, and notifications are recorded. (It used
// to count only the unprivileged user's space, and answered 503.)
func TestRoomIncludesRootReserve(t *testing.T) {
	if testing.Short() {
		t.Skip("makes and mounts a file system")
	}
	if !hostRoot() {
		t.Skip("needs root: mounts a file system and writes into root's reserve")
	}
	img := filepath.Join(t.TempDir(), "ext4.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 32<<20); err != nil {
		t.Fatal(err)
	}
	// 5% reserved for root (1.6 MiB), more than the 1 MiB the store wants.
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "5", img).CombinedOutput(); err != nil {
		t.Skipf("mkfs.ext4: %v %s", err, out)
	}
	// Not under t.TempDir, whose 0700 parent the user could not cross.
	mnt, err := os.MkdirTemp("", "gpu-orphan-ext4-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(mnt) })
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a loop device here: %v %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount: %v %s", err, out)
		}
	})
	storeDir := filepath.Join(mnt, "gpu-orphan")
	if err := os.Mkdir(storeDir, 0o700); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	s, err := Open(ctx, filepath.Join(storeDir, "remediator.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}

	// User nobody fills the disk until ext4 refuses it.
	if err := os.Chmod(mnt, 0o777); err != nil {
		t.Fatal(err)
	}
	fill := exec.Command("dd", "if=/dev/zero", "of="+filepath.Join(mnt, "fill"), "bs=64k")
	fill.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := fill.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "No space left") {
		t.Fatalf("dd as nobody: %v %s, want No space left on device", err, out)
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(storeDir, &st); err != nil {
		t.Fatal(err)
	}
	avail, free := st.Bavail*uint64(st.Bsize), st.Bfree*uint64(st.Bsize)
	t.Logf("after the user filled the disk: %d bytes available to users, %d free (root's reserve)", avail, free)
	if avail >= minFreeBytes || free < 2*minFreeBytes {
		t.Fatalf("the fill left %d bytes to users and %d free: not the case under test", avail, free)
	}
	if got := usableBytes(st, false); got != avail {
		t.Errorf("an unprivileged writer's room = %d, want Bavail %d", got, avail)
	}

	if err := s.CheckRoom(ctx); err != nil {
		t.Errorf("CheckRoom as root with %d bytes of root's reserve free: %v", free, err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Errorf("Ping as root with %d bytes of root's reserve free: %v", free, err)
	}
	if o := record(t, s, firing("01", t0)); o[0].Result != ResultAccepted {
		t.Errorf("notification: %+v", o)
	}
	a, err := s.Action(ctx, record(t, s, firing("02", t0))[0].ActionID)
	if err != nil || a.State != remediate.StateQueued {
		t.Errorf("action: %+v, %v", a, err)
	}
}

// TestUsableBytes: Bfree only for root on an ext file system.
func TestUsableBytes(t *testing.T) {
	ext := syscall.Statfs_t{Type: extSuperMagic, Bsize: 4096, Bfree: 100, Bavail: 10}
	xfs := syscall.Statfs_t{Type: 0x58465342, Bsize: 4096, Bfree: 100, Bavail: 10}
	for _, c := range []struct {
		st   syscall.Statfs_t
		root bool
		want uint64
	}{
		{ext, true, 100 * 4096},
		{ext, false, 10 * 4096},
		{xfs, true, 10 * 4096},
		{xfs, false, 10 * 4096},
	} {
		if got := usableBytes(c.st, c.root); got != c.want {
			t.Errorf("usableBytes(type %#x, root %v) = %d, want %d", c.st.Type, c.root, got, c.want)
		}
	}
}
