package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// UnprivilegedUser makes a system user of its own for the test (useradd,
// no home, no shell), removed when the test ends, and returns its
// credential: the "hostile neighbour" of a test, a user that owns nothing
// of the test's. It skips the test where that takes root it does not have.
func UnprivilegedUser(t testing.TB) *syscall.Credential {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("making a user takes root")
	}
	if _, err := exec.LookPath("useradd"); err != nil {
		t.Skipf("no useradd: %v", err)
	}
	name := fmt.Sprintf("gpuo-%x", time.Now().UnixNano()&0xffffffffff)
	// useradd takes /etc/passwd's lock: another test doing the same waits.
	var out []byte
	var err error
	for range 50 {
		out, err = exec.Command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "lock") {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("useradd %s: %v %s", name, err, out)
	}
	t.Cleanup(func() {
		for range 50 {
			out, err := exec.Command("userdel", name).CombinedOutput()
			if err == nil || !strings.Contains(string(out), "lock") {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	u, err := user.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// AsUser runs argv as the user of cred (a real process of that user) and
// fails the test when it fails.
func AsUser(t testing.TB, cred *syscall.Credential, argv ...string) {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	cmd.Dir = "/"
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v as UID %d: %v %s", argv, cred.Uid, err, out)
	}
}

// Neighbour is the scene of issue 24, item 4: a user of the test's own
// (UnprivilegedUser), and a /tmp (1777) in a directory of root's that the
// user may cross, where the test keeps root's own files too.
type Neighbour struct {
	User *syscall.Credential
	Base string // root's directory, 0755 as is its parent: the user crosses them
	Tmp  string // Base/tmp, 1777
}

// NewNeighbour makes the scene; it skips the test as UnprivilegedUser does.
func NewNeighbour(t testing.TB) *Neighbour {
	t.Helper()
	n := &Neighbour{User: UnprivilegedUser(t), Base: t.TempDir()}
	n.Tmp = filepath.Join(n.Base, "tmp")
	if err := os.Mkdir(n.Tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	for d, mode := range map[string]os.FileMode{filepath.Dir(n.Base): 0o755, n.Base: 0o755, n.Tmp: 0o777 | os.ModeSticky} {
		if err := os.Chmod(d, mode); err != nil { // whatever the umask
			t.Fatal(err)
		}
	}
	return n
}

// Dir is a directory that the user makes in Tmp, 0755, with the symbolic
// links that the user makes in it: name -> target.
func (n *Neighbour) Dir(t testing.TB, name string, links map[string]string) string {
	t.Helper()
	dir := filepath.Join(n.Tmp, name)
	AsUser(t, n.User, "mkdir", "-m", "0755", dir)
	for link, target := range links {
		AsUser(t, n.User, "ln", "-s", target, filepath.Join(dir, link))
	}
	return dir
}
