package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
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
