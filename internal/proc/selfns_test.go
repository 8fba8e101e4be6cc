package proc

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

func TestParseNSpid(t *testing.T) {
	for _, tc := range []struct {
		name, status string
		want         []int
		err          string
	}{
		{"host", "Name:\tbash\nTgid:\t42\nNSpid:\t42\nNSpgid:\t42\n", []int{42}, ""},
		{"nested twice", "NSpid:\t13256\t3\t1\n", []int{13256, 3, 1}, ""},
		{"no line", "Name:\tbash\nPid:\t42\n", nil, "no NSpid line"},
		{"empty line", "NSpid:\t\n", nil, "empty NSpid line"},
		{"not a number", "NSpid:\t42\tx\n", nil, "bad NSpid line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseNSpid(strings.NewReader(tc.status))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("parseNSpid: %v, %v; want an error saying %q", got, err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Errorf("parseNSpid = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

// fakeProcfs makes a procfs whose self links to selfPID, with a status of
// that NSpid line (none when nspid is empty). selfPID 0: no self at all.
func fakeProcfs(t *testing.T, selfPID int, nspid string) string {
	t.Helper()
	root := t.TempDir()
	if selfPID == 0 {
		return root
	}
	dir := filepath.Join(root, strconv.Itoa(selfPID))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	status := "Name:\tgpu-orphan\n"
	if nspid != "" {
		status += "NSpid:\t" + nspid + "\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "status"), []byte(status), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(strconv.Itoa(selfPID), filepath.Join(root, "self")); err != nil {
		t.Fatal(err)
	}
	return root
}

// TestCheckOwnPIDNamespaceFixtures: what each procfs layout proves.
func TestCheckOwnPIDNamespaceFixtures(t *testing.T) {
	for _, tc := range []struct {
		name    string
		selfPID int
		nspid   string
		foreign bool   // ErrForeignPIDNamespace
		says    string // "" when the check passes
	}{
		{"same namespace", 42, "42", false, ""},
		{"procfs of an ancestor namespace", 13256, "13256\t42", true, "is PID 13256, but this process is PID 42"},
		// PIDs may coincide across namespaces: NSpid still tells.
		{"ancestor namespace, same PID by chance", 42, "42\t42", true, "sits 1 PID namespaces below"},
		{"procfs of a namespace we are not in", 0, "", true, "is not visible in the PID namespace"},
		{"no NSpid line", 42, "", false, "cannot be checked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkOwnPIDNamespace(fakeProcfs(t, tc.selfPID, tc.nspid), 42)
			if tc.says == "" {
				if err != nil {
					t.Errorf("check: %v, want none", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("check: %v, want an error saying %q", err, tc.says)
			}
			if got := errors.Is(err, ErrForeignPIDNamespace); got != tc.foreign {
				t.Errorf("errors.Is(err, ErrForeignPIDNamespace) = %v, want %v: %v", got, tc.foreign, err)
			}
			if tc.foreign && !strings.Contains(err.Error(), "hostPID: true") {
				t.Errorf("the error does not say what to do: %v", err)
			}
		})
	}
}

// TestCheckOwnPIDNamespaceHere: the test runs where /proc is its own.
func TestCheckOwnPIDNamespaceHere(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	if err := fs.CheckOwnPIDNamespace(); err != nil {
		t.Errorf("/proc of our own namespace: %v", err)
	}
}

// selfNSChildEnv makes TestCheckOwnPIDNamespaceChild run the check and
// print its result: the test binary re-executed under unshare.
const selfNSChildEnv = "GPU_ORPHAN_SELFNS_CHILD"

func TestCheckOwnPIDNamespaceChild(t *testing.T) {
	if os.Getenv(selfNSChildEnv) == "" {
		t.Skip("run by TestCheckOwnPIDNamespaceUnshared")
	}
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	err = fs.CheckOwnPIDNamespace()
	fmt.Printf("pid %d foreign %t\n", os.Getpid(), errors.Is(err, ErrForeignPIDNamespace))
}

func needUnshare(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("unshare (util-linux) is not installed")
	}
	if os.Geteuid() != 0 {
		t.Skip("unshare --pid needs root")
	}
	return path
}

// TestCheckOwnPIDNamespaceUnshared: real namespaces. The test binary run in
// a new PID namespace (unshare --pid --fork) still sees the host's /proc,
// where it is not the PID it is to itself: the check fails. And the procfs
// of a child namespace (another process's, mounted by unshare
// --mount-proc) has no self for us.
func TestCheckOwnPIDNamespaceUnshared(t *testing.T) {
	unshare := needUnshare(t)
	cmd := exec.Command(unshare, "--pid", "--fork", os.Args[0], "-test.run=^TestCheckOwnPIDNamespaceChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), selfNSChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the test binary under unshare: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "pid 1 foreign true\n") {
		t.Errorf("in a new PID namespace with the host's /proc, want PID 1 and ErrForeignPIDNamespace:\n%s", out)
	}

	child := exec.Command(unshare, "--pid", "--fork", "--mount-proc", "sleep", "60")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	// unshare forks sleep, PID 1 of the new namespace.
	var sleepPID string
	deadline := time.Now().Add(slowness.Scale(10*time.Second, slowness.Factor()))
	for {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(child.Process.Pid) + "/task/" + strconv.Itoa(child.Process.Pid) + "/children")
		if f := strings.Fields(string(b)); len(f) == 1 {
			if comm, _ := os.ReadFile("/proc/" + f[0] + "/comm"); string(comm) == "sleep\n" {
				sleepPID = f[0]
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("unshare --mount-proc sleep never started sleep")
		}
		time.Sleep(20 * time.Millisecond)
	}
	root := "/proc/" + sleepPID + "/root/proc"
	fs, err := NewFS(root)
	if err != nil {
		t.Fatal(err)
	}
	err = fs.CheckOwnPIDNamespace()
	if !errors.Is(err, ErrForeignPIDNamespace) || !strings.Contains(err.Error(), "not visible") {
		t.Errorf("the procfs of a child namespace (%s): %v, want ErrForeignPIDNamespace, not visible", root, err)
	}
}
