package remediate_test

// The safety matrix of docs/safety.md: each scenario is a job shape that a
// naive cleanup gets wrong, run with real processes through the real
// webhook with --act on a simulated node, asserting exactly which PIDs
// survive and which memory comes back.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// cleanGPU starts a node agent with flags, sends one firing alert for GPU
// gpu, and returns the finished action.
func cleanGPU(t *testing.T, root string, gpu int, flags ...string) (remediate.Action, string) {
	t.Helper()
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), flags...)
	return alertAndWait(t, url, root, gpu, fp(100+gpu)), url
}

// cleanGPUAfter is cleanGPU with the agent started before kill runs: it
// sees the jobs alive, as an agent that runs on the node all along does,
// and only then are their owners killed.
func cleanGPUAfter(t *testing.T, root string, gpu int, kill func(), flags ...string) (remediate.Action, string) {
	t.Helper()
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), flags...)
	kill()
	return alertAndWait(t, url, root, gpu, fp(100+gpu)), url
}

// alertAndWait sends one firing alert and waits for its action to finish.
func alertAndWait(t *testing.T, url, root string, gpu int, fingerprint string) remediate.Action {
	t.Helper()
	body := payload(alert("firing", "node-a", gpuUUID(t, root, gpu), fingerprint, time.Now().Add(-time.Minute)))
	if code, resp := post(t, url, token, body); code != http.StatusOK {
		t.Fatalf("post: %d %s", code, resp)
	}
	var got remediate.Action
	testenv.Eventually(t, 40*time.Second, "the action of alert "+fingerprint+" to finish", func() bool {
		for _, a := range actions(t, url) {
			if a.AlertFingerprint == fingerprint && a.State != remediate.StateQueued && a.State != remediate.StateRunning {
				got = a
				return true
			}
		}
		return false
	})
	t.Logf("action %s: %s %s; targets %v", fingerprint, got.State, got.Reason, targetPIDs(got))
	return got
}

func targetPIDs(a remediate.Action) []int {
	var pids []int
	for _, tg := range a.Targets {
		pids = append(pids, tg.PID)
	}
	slices.Sort(pids)
	return pids
}

// wantTargets checks that the action signalled exactly pids.
func wantTargets(t *testing.T, a remediate.Action, pids ...int) {
	t.Helper()
	want := slices.Sorted(slices.Values(pids))
	if got := targetPIDs(a); !slices.Equal(got, want) {
		t.Errorf("targets %v, want exactly %v (action %s: %s)", got, want, a.State, a.Reason)
	}
}

// wantAlive checks that every pid is alive: it exists and some thread of
// it has not exited.
func wantAlive(t *testing.T, what string, pids ...int) {
	t.Helper()
	fs := procFS(t)
	for _, pid := range pids {
		if _, ok := fs.Alive(pid); !ok {
			t.Errorf("%s (PID %d) was killed", what, pid)
		}
	}
}

func wantDead(t *testing.T, what string, pids ...int) {
	t.Helper()
	for _, pid := range pids {
		if testenv.Alive(pid) {
			t.Errorf("%s (PID %d) survived", what, pid)
		}
	}
}

func wantUsedMiB(t *testing.T, root string, gpu int, want uint64) {
	t.Helper()
	testenv.Eventually(t, 5*time.Second, fmt.Sprintf("GPU %d to use %d MiB", gpu, want), func() bool {
		return usedMiB(t, root, gpu) == want
	})
}

func procFS(t *testing.T) proc.FS {
	t.Helper()
	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

func simBin(t *testing.T) string { return testenv.Bin(t, "gpu-orphan-sim") }

// TestSafetyLiveJobOnAnotherGPU: a healthy job has its context on GPU 0
// and forked workers and, as a multi-GPU CUDA process may, has GPU 1's node
// open and mapped. An orphan sits on GPU 1. Only the orphan's holders go.
func TestSafetyLiveJobOnAnotherGPU(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	healthy := testenv.StartWorkload(t, root, 0, 2048, 2, "--visible", "all")
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, orphan.Children...)
	wantAlive(t, "the healthy job on GPU 0", healthy.PID)
	wantAlive(t, "a worker of the healthy job", healthy.Children...)
	wantDead(t, "the orphan's holder", orphan.Children...)
	wantUsedMiB(t, root, 1, 0)
	wantUsedMiB(t, root, 0, 2048+8)
}

// TestSafetyDeviceIdentityNotPath: in mount namespaces of their own, one
// process sees a regular file bind-mounted where GPU 1's node should be,
// another sees GPU 0's node under GPU 1's name. Holders are told by what
// the kernel says the file is, not by its name.
func TestSafetyDeviceIdentityNotPath(t *testing.T) {
	skipShort(t)
	t.Parallel()
	if os.Getuid() != 0 {
		t.Skip("bind mounts in a mount namespace need root")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("unshare (util-linux) not installed")
	}
	root := testenv.SimNode(t, 2)
	n, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	dev0, dev1 := n.DevicePath(0), n.DevicePath(1)
	orphan := testenv.StartWorkload(t, root, 1, 1024, 1)
	orphan.KillParent(t)
	decoy := filepath.Join(t.TempDir(), "decoy")
	if err := os.WriteFile(decoy, make([]byte, sim.DeviceMapBytes), 0o644); err != nil {
		t.Fatal(err)
	}
	// Each maps what it opened as "nvidia1", as a CUDA context would.
	inNamespace := func(bindFrom string) int {
		s := testenv.StartScript(t, fmt.Sprintf(
			`exec unshare -m --propagation private sh -c 'mount --bind %s %s && echo ready $$ && exec %s 3<%s'`,
			bindFrom, dev1, os.Args[0], dev1), testenv.MapperEnv+"=1")
		pid := s.Ready(t).PID
		testenv.Eventually(t, 5*time.Second, "the process to map its device", func() bool {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
			return bytes.Contains(b, []byte(filepath.Base(dev1)))
		})
		return pid
	}
	impostor := inNamespace(decoy) // a regular file named like GPU 1's node
	alias := inNamespace(dev0)     // GPU 0's node under GPU 1's name

	out, err := exec.Command(testenv.Bin(t, "gpu-orphan"), "ps", "-o", "json", "--backend=sim", "--sim.root="+root).Output()
	if err != nil {
		t.Fatalf("gpu-orphan ps: %v\n%s", err, out)
	}
	// The part of gpu-orphan ps -o json that this test reads.
	type psGPU struct {
		HolderPIDs []int `json:"holder_pids"`
		Suspects   []struct {
			PID int `json:"pid"`
		} `json:"suspects"`
	}
	var r struct {
		GPUs []psGPU `json:"gpus"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("ps -o json: %v\n%s", err, out)
	}
	suspects := func(g psGPU) []int {
		var pids []int
		for _, h := range g.Suspects {
			pids = append(pids, h.PID)
		}
		return pids
	}
	g0, g1 := r.GPUs[0], r.GPUs[1]
	if slices.Contains(g1.HolderPIDs, impostor) || slices.Contains(suspects(g1), impostor) {
		t.Errorf("a process holding a regular file bind-mounted at %s is listed as a holder of GPU 1: holders %v suspects %v", dev1, g1.HolderPIDs, suspects(g1))
	}
	if slices.Contains(g1.HolderPIDs, alias) {
		t.Errorf("a process holding GPU 0's node under GPU 1's name is listed as a holder of GPU 1: %v", g1.HolderPIDs)
	}
	if !slices.Contains(g0.HolderPIDs, alias) {
		t.Errorf("a process holding GPU 0's node under GPU 1's name is missing from GPU 0's holders: %v", g0.HolderPIDs)
	}
	if got := suspects(g1); !slices.Equal(got, orphan.Children) {
		t.Errorf("GPU 1 suspects %v, want exactly the orphan's child %v", got, orphan.Children)
	}
}

// TestSafetyZombieLeader: a trainer's main thread exited (pthread_exit)
// while another thread holds the context; /proc shows it as Z. It is alive,
// its memory has a live owner, and its workers belong to it.
func TestSafetyZombieLeader(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 4096, 2, "--zombie-leader")
	testenv.Eventually(t, 5*time.Second, "the main thread to exit", func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", w.PID))
		i := bytes.LastIndexByte(b, ')')
		return i > 0 && i+2 < len(b) && b[i+2] == 'Z'
	})
	fs := procFS(t)
	members, err := fs.GroupMembers(w.PID)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(members, func(p proc.Process) bool { return p.PID == w.PID && p.LeaderExited }) {
		t.Errorf("the group's listing skips its zombie leader whose threads live: %+v", members)
	}

	a, _ := cleanGPU(t, root, 1, "--act")
	if a.State != remediate.StateSkipped || len(a.Targets) != 0 {
		t.Errorf("action %s (%s) with targets %v, want skipped with none", a.State, a.Reason, targetPIDs(a))
	}
	wantAlive(t, "the trainer whose main thread exited", w.PID)
	wantAlive(t, "the trainer's worker", w.Children...)
	wantUsedMiB(t, root, 1, 4096+8)
}

// waitRecorded waits until the agent has recorded at least n processes
// descending from live owners: the proof it needs once they die.
func waitRecorded(t *testing.T, url string, n int) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("the agent to record %d descendants of live owners", n), func() bool {
		return metricValue(t, url, "gpu_orphan_remediator_recorded_descendants", nil) >= float64(n)
	})
}

// TestSafetyReusedOwnerPID: a trainer that is not a group leader died and
// its PID was recreated for an unrelated process that holds no GPU. NVML
// still lists the PID. The orphan is found, and the newcomer is untouched.
// The trainer leads neither its group nor its session (its job script
// does): its workers are proven its inheritors by the descent the running
// agent recorded.
func TestSafetyReusedOwnerPID(t *testing.T) {
	skipShort(t)
	root := testenv.SimNode(t, 2)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 4096 --children 2 & wait", simBin(t), root))
	w := script.Ready(t)
	if w.PID == script.Cmd.Process.Pid {
		t.Fatal("the trainer leads its group; this case needs a trainer that does not")
	}
	waitRecorded(t, url, 2)
	if err := syscall.Kill(w.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testenv.WaitGone(t, w.PID) // the script reaped it: the PID is free
	newcomer := testenv.StartWithPID(t, w.PID, func() *exec.Cmd {
		c := exec.Command("sleep", "300")
		c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return c
	})

	a := alertAndWait(t, url, root, 1, fp(101))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, w.Children...)
	wantAlive(t, "the unrelated process that was given the dead trainer's PID", newcomer.Process.Pid)
	wantDead(t, "the orphan's holder", w.Children...)
	wantUsedMiB(t, root, 1, 0)
}

// TestSafetyJobScriptKeepsItsGroup: a job script (setsid) runs the trainer
// and a tensorboard in its process group and waits. The trainer is killed
// with -9. Only the trainer's workers, which hold its context, are
// signalled: the live script leads its group.
func TestSafetyJobScriptKeepsItsGroup(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	tensorboard := filepath.Join(t.TempDir(), "tensorboard")
	if err := os.Symlink("/bin/sleep", tensorboard); err != nil {
		t.Fatal(err)
	}
	script := testenv.StartScript(t, fmt.Sprintf("%s 300 & echo ready $!; %s run --root %s --gpu 1 --mib 4096 --children 2 & wait",
		tensorboard, simBin(t), root))
	tb := script.Ready(t).PID
	w := script.Ready(t)
	waitRecorded(t, url, 2)
	if err := syscall.Kill(w.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testenv.WaitGone(t, w.PID)

	a := alertAndWait(t, url, root, 1, fp(101))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, w.Children...)
	wantAlive(t, "the job script", script.Cmd.Process.Pid)
	wantAlive(t, "tensorboard", tb)
	wantDead(t, "the dead trainer's worker", w.Children...)
	wantUsedMiB(t, root, 1, 0)
}

// TestSafetyOrphanedPolicyHonoursMinAge: a healthy job started with nohup
// from a shell that then exits is orphaned from its session, beside a fork
// orphan on the same GPU. The orphaned policy still waits for
// --remediate.min-age before touching either.
func TestSafetyOrphanedPolicyHonoursMinAge(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	script := testenv.StartScript(t, fmt.Sprintf("nohup %s run --root %s --gpu 1 --mib 2048 &", simBin(t), root))
	job := script.Ready(t)
	script.Cmd.Wait() // the shell is gone: the job is orphaned from its session
	orphan := testenv.StartWorkload(t, root, 1, 1024, 1)

	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.policy=orphaned", "--remediate.min-age=1m")
	orphan.KillParent(t)
	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(110), time.Now().Add(-time.Minute)))
	if code, resp := post(t, url, token, body); code != http.StatusOK {
		t.Fatalf("post: %d %s", code, resp)
	}
	testenv.Eventually(t, 10*time.Second, "the action to wait for min-age", func() bool {
		as := actions(t, url)
		return len(as) == 1 && as[0].State == remediate.StateQueued && strings.Contains(as[0].Reason, "too_young")
	})
	time.Sleep(2 * time.Second) // two seconds after it started, as in the report
	as := actions(t, url)
	if as[0].State != remediate.StateQueued || len(as[0].Targets) != 0 {
		t.Errorf("action %s (%s) with targets %v, want queued without targets", as[0].State, as[0].Reason, targetPIDs(as[0]))
	}
	wantAlive(t, "the nohup job", job.PID)
	wantAlive(t, "the fork orphan's worker", orphan.Children...)
	wantUsedMiB(t, root, 1, 2048+8+1024+8)
}

// TestSafetyAllHoldersSparesOthers: all-holders clears GPU 1 of what maps
// it, but not a healthy job on GPU 0 that has GPU 1's node open and mapped,
// nor its workers, nor a monitor that holds the node without mapping it.
func TestSafetyAllHoldersSparesOthers(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	n, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	healthy := testenv.StartWorkload(t, root, 0, 2048, 2, "--visible", "all")
	monitor := testenv.StartScript(t, fmt.Sprintf("exec 3<%s; echo ready $$; exec sleep 300", n.DevicePath(1))).Ready(t).PID
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act", "--remediate.policy=all-holders")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, orphan.Children...)
	wantAlive(t, "the healthy job on GPU 0", healthy.PID)
	wantAlive(t, "a worker of the healthy job", healthy.Children...)
	wantAlive(t, "the NVML-only monitor", monitor)
	wantUsedMiB(t, root, 1, 0)
	why := map[int]remediate.ExclusionReason{}
	for _, e := range a.Excluded {
		why[e.PID] = e.Why
	}
	if why[healthy.PID] != "live_job_on_another_gpu" || why[monitor] != "nvml_reader_not_mapped" {
		t.Errorf("exclusions %v, want the healthy job as live_job_on_another_gpu and the monitor as nvml_reader_not_mapped", why)
	}
}

// TestSafetyOthersLeftoversAreNotFailures: a protected-named orphan sits on
// GPU 1 beside ordinary ones. Each cleanup kills its own targets and is
// judged by them: the protected one's memory is "other holders remain",
// not a failure, and the breaker (one failure opens it here) stays shut.
func TestSafetyOthersLeftoversAreNotFailures(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	dir := t.TempDir()
	hostengine := filepath.Join(dir, "nv-hostengine") // a protected name
	if err := os.Link(simBin(t), hostengine); err != nil {
		t.Fatal(err)
	}
	protected := testenv.StartScript(t, fmt.Sprintf("exec %s run --root %s --gpu 1 --mib 1024 --children 1", hostengine, root))
	pw := protected.Ready(t)
	protected.Cmd.Process.Kill()
	protected.Cmd.Wait()

	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--limit.breaker-failures=1",
		"--limit.cooldown=0s", "--limit.rate=100", "--limit.burst=10")
	for round := range 3 {
		orphan := testenv.StartWorkload(t, root, 1, 2048, 1)
		orphan.KillParent(t)
		a := alertAndWait(t, url, root, 1, fp(120+round))
		if a.State != remediate.StateSucceeded || !strings.HasPrefix(a.Reason, "other holders remain") {
			t.Fatalf("round %d: action %s (%s), want succeeded with other holders remaining", round, a.State, a.Reason)
		}
		wantTargets(t, a, orphan.Children...)
		wantDead(t, "the ordinary orphan's holder", orphan.Children...)
		if !slices.ContainsFunc(a.Leftover, func(l remediate.Leftover) bool { return l.PID == pw.Children[0] && l.Kind == "other_holder" }) {
			t.Errorf("round %d: leftovers %+v do not name the protected holder %d", round, a.Leftover, pw.Children[0])
		}
		wantUsedMiB(t, root, 1, 1024+8)
	}
	wantAlive(t, "the protected-named holder", pw.Children...)
	if v := metricValue(t, url, "gpu_orphan_remediator_breaker_open", nil); v != 0 {
		t.Errorf("breaker_open = %v after cleanups that did all they could", v)
	}
}
