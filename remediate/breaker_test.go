package remediate_test

// Issue 16, §3: one user cannot switch remediation off. Memory that no
// visible process holds is an escalation, counted per dead owner's user;
// only a target that survived counts toward the node's breaker.

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// hideEnv makes this test binary the helper of hideContext instead of
// running tests.
const hideEnv = "GPU_ORPHAN_TEST_HIDE_CONTEXT_OF"

func init() {
	if pid := os.Getenv(hideEnv); pid != "" {
		os.Exit(hideContextMain(pid))
	}
}

// childContextFD is the descriptor of a simulated worker that keeps its
// context alive (the context's locked file, as a CUDA context's device
// descriptors keep real GPU memory).
const childContextFD = 4

// hideContextMain plays the trick of issue 16, §3, as any user can on
// their own processes: copy the worker's context descriptor with
// pidfd_getfd, send it over a socketpair in an SCM_RIGHTS message, close
// the copy and the sending end, and never receive it. The context then
// lives on in the socket's queue, where no /proc/PID/fd shows it.
func hideContextMain(pidArg string) int {
	pid, err := strconv.Atoi(pidArg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pidfd_open:", err)
		return 1
	}
	fd, err := unix.PidfdGetfd(pidfd, childContextFD, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pidfd_getfd:", err)
		return 1
	}
	sv, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "socketpair:", err)
		return 1
	}
	if err := unix.Sendmsg(sv[0], []byte{0}, unix.UnixRights(fd), nil, 0); err != nil {
		fmt.Fprintln(os.Stderr, "sendmsg:", err)
		return 1
	}
	unix.Close(fd)
	unix.Close(sv[0])
	unix.Close(pidfd)
	fmt.Println("hidden")
	// sv[1] is never read. Wait for the test to end us.
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// sharedBin is a directory any user can read, with copies (hard links
// where possible) of gpu-orphan-sim and of this test binary, as helper
// and as slurmstepd (a protected name, root's file).
func sharedBin(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpu-orphan-shared-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, src := range map[string]string{"gpu-orphan-sim": simBin(t), "helper": os.Args[0], "slurmstepd": os.Args[0]} {
		dst := filepath.Join(dir, name)
		if err := os.Link(src, dst); err != nil {
			testenv.CopyExecutable(t, src, dst, 0o755)
		}
		if err := os.Chmod(dst, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// openNodeToUsers lets other users run workloads on the simulated node:
// its path, its device files and its contexts directory.
func openNodeToUsers(t *testing.T, root string) {
	t.Helper()
	for dir := root; dir != "/" && dir != os.TempDir(); dir = filepath.Dir(dir) {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	err := filepath.WalkDir(filepath.Join(root, "dev"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		return os.Chmod(p, 0o666)
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(root, "contexts"), 0o1777); err != nil {
		t.Fatal(err)
	}
}

var nobody = &syscall.Credential{Uid: 65534, Gid: 65534}

// startWorkloadAs is testenv.StartWorkload run as another user.
func startWorkloadAs(t *testing.T, bin string, cred *syscall.Credential, root string, gpu, mib, children int) *testenv.Workload {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "gpu-orphan-sim"), "run", "--root", root, "--gpu", strconv.Itoa(gpu),
		"--mib", strconv.Itoa(mib), "--children", strconv.Itoa(children))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	return testenv.StartWorkloadCmd(t, cmd)
}

// hideContext runs hideContextMain as cred on the worker pid and returns
// the helper's PID once the descriptor is in flight.
func hideContext(t *testing.T, bin string, cred *syscall.Credential, pid int) int {
	t.Helper()
	return startHelper(t, filepath.Join(bin, "helper"), cred, []string{hideEnv + "=" + strconv.Itoa(pid)}, "hidden",
		fmt.Sprintf("hiding the context of %d as uid %d", pid, cred.Uid))
}

// startHelper runs exe, a link to this test binary (sharedBin), as cred,
// in a session of its own, with env added to ours, and returns its PID
// once it has printed ready. It is ended at cleanup, when its stdin
// closes. what says what it does, for a failure.
func startHelper(t *testing.T, exe string, cred *syscall.Credential, env []string, ready, what string) int {
	t.Helper()
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: cred}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); cmd.Process.Kill(); cmd.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != ready+"\n" {
		t.Fatalf("%s: %q %v", what, line, err)
	}
	return cmd.Process.Pid
}

// TestBreakerIgnoresHiddenHolders: an unprivileged user (nobody) hides a
// forked worker's context in an SCM_RIGHTS message nobody receives and
// kills the trainer, three times, on three GPUs. Each cleanup kills the
// worker, and the memory stays: failed, escalated as hidden_holder with
// the user named and counted, and the breaker (3 failures in an hour, the
// default) stays closed. Another user's 16 GiB orphan is then cleaned.
// Alertmanager's re-sent notification of a hidden orphan gets one more
// attempt, which finds nothing it may signal. (The old code opened the
// breaker on the third failure and held the 16 GiB back.)
func TestBreakerIgnoresHiddenHolders(t *testing.T) {
	skipShort(t)
	t.Parallel()
	if os.Getuid() != 0 {
		t.Skip("running processes as another user needs root")
	}
	root := testenv.SimNode(t, 4)
	openNodeToUsers(t, root)
	bin := sharedBin(t)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.verify-timeout=2s",
		"--limit.cooldown=0s", "--limit.rate=100", "--limit.burst=10")
	// The jobs start while the agent watches, so that it knows whose they
	// are when they die.
	var jobs []*testenv.Workload
	for gpu := 1; gpu <= 3; gpu++ {
		jobs = append(jobs, startWorkloadAs(t, bin, nobody, root, gpu, 1024, 1))
	}
	victim := testenv.StartWorkload(t, root, 0, 16384, 2)
	waitRecorded(t, url, 5)

	var helpers []int
	for i, w := range jobs {
		gpu := i + 1
		helpers = append(helpers, hideContext(t, bin, nobody, w.Children[0]))
		w.KillParent(t)
		a := alertAndWait(t, url, root, gpu, fp(400+i))
		if a.State != remediate.StateFailed {
			t.Fatalf("GPU %d: action %s (%s), want failed", gpu, a.State, a.Reason)
		}
		if a.Escalation != remediate.EscalationHiddenHolder {
			t.Errorf("GPU %d: escalation %q, want hidden_holder", gpu, a.Escalation)
		}
		wantTargets(t, a, w.Children...)
		if a.Targets[0].Outcome != "exited_after_sigterm" {
			t.Errorf("GPU %d: target outcome %s", gpu, a.Targets[0].Outcome)
		}
		if len(a.DeadOwners) != 1 || a.DeadOwners[0].User != "nobody" {
			t.Errorf("GPU %d: dead owners %+v, want nobody's trainer", gpu, a.DeadOwners)
		}
		if len(a.Leftover) != 1 || a.Leftover[0].Kind != "driver" || !strings.Contains(a.NextStep, "nobody") || !strings.Contains(a.NextStep, "not counted toward the circuit breaker") {
			t.Errorf("GPU %d: leftover %+v, next step %q", gpu, a.Leftover, a.NextStep)
		}
		if got := usedMiB(t, root, gpu); got < 1024 {
			t.Errorf("GPU %d uses %d MiB: the hidden context was freed, not the case under test", gpu, got)
		}
	}
	// The agent counts an action's end after recording it.
	testenv.Eventually(t, 5*time.Second, "three failed actions to be counted", func() bool {
		return metricValue(t, url, "gpu_orphan_remediator_actions_total", map[string]string{"state": "failed"}) == 3
	})
	_, mfs := testenv.Scrape(t, url+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_escalations_total", map[string]string{"user": "nobody", "kind": "hidden_holder"}); v != 3 {
		t.Errorf("escalations_total{user=nobody,kind=hidden_holder} = %v, want 3", v)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); v != 0 {
		t.Errorf("breaker_open = %v after three escalations", v)
	}

	victim.KillParent(t)
	a := alertAndWait(t, url, root, 0, fp(410))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("another user's orphan: %s (%s)", a.State, a.Reason)
	}
	wantTargets(t, a, victim.Children...)
	wantDead(t, "the 16 GiB orphan's worker", victim.Children...)
	wantUsedMiB(t, root, 0, 0)
	if v := metricValue(t, url, "gpu_orphan_remediator_limited_total", map[string]string{"limit": "breaker"}); v != 0 {
		t.Errorf("limited_total{limit=breaker} = %v", v)
	}
	wantAlive(t, "the user's helper holding the hidden descriptor (it holds no GPU)", helpers...)

	// Alertmanager re-sends the first hidden orphan's alert: one more
	// attempt, from a fresh snapshot, finds nothing it may signal.
	first := attempts(t, url, fp(400))[0]
	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(400), first.AlertStartsAt))
	code, resp := post(t, url, token, body)
	if code != http.StatusOK || results(t, resp)["accepted"] != 1 {
		t.Fatalf("re-sent notification after an escalation: %d %s, want accepted", code, resp)
	}
	var as []remediate.Action
	testenv.Eventually(t, 20*time.Second, "attempt 2 to finish", func() bool {
		as = attempts(t, url, fp(400))
		return len(as) == 2 && as[1].State.Final()
	})
	if as[1].State != remediate.StateSkipped || !strings.HasPrefix(as[1].Reason, "no_targets") || as[1].RetryOf != as[0].ID {
		t.Errorf("attempt 2: %s %q retry_of %q", as[1].State, as[1].Reason, as[1].RetryOf)
	}
	if code, resp := post(t, url, token, body); code != http.StatusOK || results(t, resp)["duplicate"] != 1 {
		t.Errorf("re-sent notification after a skipped attempt: %d %s, want a duplicate", code, resp)
	}
}
