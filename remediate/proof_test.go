package remediate_test

// Issue 15: innocent until proven. Each test is a finding of the issue,
// run with real processes through the real webhook with --act on a
// simulated node; each failed on the code before it (docs/safety.md).

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

func excludedAs(a remediate.Action, pid int) remediate.ExclusionReason {
	for _, e := range a.Excluded {
		if e.PID == pid {
			return e.Why
		}
	}
	return ""
}

// TestProofDaemonStartedBefore (finding 1): a daemon that maps GPU 1 and
// started long before the trainer that died is no inheritor of it; nor is
// its process group.
func TestProofDaemonStartedBefore(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	daemon := testenv.StartScript(t, fmt.Sprintf("exec %s launch --root %s --gpu 1", simBin(t), root)).Line(t, "launcher").PID
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, orphan.Children...)
	wantAlive(t, "the daemon started before the trainer", daemon)
	wantDead(t, "the orphan's worker", orphan.Children...)
	wantUsedMiB(t, root, 1, 0)
	if why := excludedAs(a, daemon); why != "unexplained_holder" {
		t.Errorf("the daemon is recorded as %q, want unexplained_holder", why)
	}
}

// TestProofLauncherOfLiveRank (finding 2): a torchrun-like launcher that
// called cuInit (the device open and mapped, no context) is the parent of a
// healthy rank on GPU 1, beside a fork orphan of another job there.
func TestProofLauncherOfLiveRank(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	sim := simBin(t)
	s := testenv.StartScript(t, fmt.Sprintf("exec %s launch --root %s --gpu 1 -- %s run --root %s --gpu 1 --mib 1024 --children 1", sim, root, sim, root))
	launcher := s.Line(t, "launcher").PID
	rank := s.Ready(t)
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, orphan.Children...)
	wantAlive(t, "the launcher", launcher)
	wantAlive(t, "the healthy rank", rank.PID)
	wantAlive(t, "the rank's worker", rank.Children...)
	wantUsedMiB(t, root, 1, 1024+8)
}

// TestProofHelperOfHealthyTrainer (finding 3): a healthy trainer's
// double-forked helper, reparented to init, in the trainer's group, holds
// the trainer's own open files. Another job dies on the same GPU.
func TestProofHelperOfHealthyTrainer(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	healthy := testenv.StartWorkload(t, root, 1, 1024, 1, testenv.HelperFlag)
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, orphan.Children...)
	wantAlive(t, "the healthy trainer", healthy.PID)
	wantAlive(t, "the healthy trainer's helper", healthy.Helper)
	wantUsedMiB(t, root, 1, 1024+8)
}

// TestProofNoOrphanAllHolders (finding 4): two healthy jobs of 20
// contexts each, no dead owner. NVML charges 8 MiB per live context to no
// process: 320 MiB "with no live owner", above min-bytes. all-holders must
// not act.
func TestProofNoOrphanAllHolders(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	var pids []int
	for job := range 2 {
		s := testenv.StartScript(t, strings.Repeat(fmt.Sprintf("%s run --root %s --gpu 1 --mib 64 & ", simBin(t), root), 20)+"wait")
		for range 20 {
			pids = append(pids, s.Ready(t).PID)
		}
		_ = job
	}
	wantUsedMiB(t, root, 1, 40*(64+8))

	a, _ := cleanGPU(t, root, 1, "--act", "--remediate.policy=all-holders", "--remediate.min-bytes=256MiB")
	if a.State != remediate.StateSkipped || len(a.Targets) != 0 || !strings.Contains(a.Reason, "below_threshold") {
		t.Errorf("action %s (%s) with targets %v, want skipped below threshold", a.State, a.Reason, targetPIDs(a))
	}
	wantAlive(t, "a healthy job's process", pids...)
}

// TestProofAnotherUsersMapper (finding 5): another user's process maps
// GPU 1 without a context, started after the trainer died, in a session of
// its own. Nothing ties it to the dead owner.
func TestProofAnotherUsersMapper(t *testing.T) {
	skipShort(t)
	t.Parallel()
	if os.Getuid() != 0 {
		t.Skip("running a process as another user needs root")
	}
	root := testenv.SimNode(t, 2)
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)
	// nobody must reach the node's device files.
	for dir := root; dir != "/" && dir != os.TempDir(); dir = filepath.Dir(dir) {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	err := filepath.WalkDir(filepath.Join(root, "dev"), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Chmod(p, 0o777)
	})
	if err != nil {
		t.Fatal(err)
	}
	// ... and its binary.
	bin, err := os.MkdirTemp("", "gpu-orphan-sim-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(bin) })
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	testenv.CopyExecutable(t, simBin(t), filepath.Join(bin, "gpu-orphan-sim"), 0o755)
	cmd := exec.Command(filepath.Join(bin, "gpu-orphan-sim"), "launch", "--root", root, "--gpu", "1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line := make([]byte, 64)
	if n, err := out.Read(line); err != nil || !strings.HasPrefix(string(line[:n]), "launcher ") {
		t.Fatalf("the other user's launcher did not start: %q %v", line[:n], err)
	}
	stranger := cmd.Process.Pid

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, orphan.Children...)
	wantAlive(t, "another user's process", stranger)
	if why := excludedAs(a, stranger); why != "unexplained_holder" {
		t.Errorf("another user's process is recorded as %q, want unexplained_holder", why)
	}
}

// TestProofMPS: the MPS control daemon (started first, the device mapped,
// not listed by NVML) and its server (an NVML owner) beside a client whose
// kill -9 leaves its forked workers holding its memory. As on the H200,
// the daemon runs under a name on no protected list (gpu-watchd): only the
// proof rules keep it alive.
func TestProofMPS(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	mps := testenv.StartScript(t, fmt.Sprintf("exec %s mps --root %s --gpu 1 --control-comm gpu-watchd", simBin(t), root)).Ready(t)
	client := testenv.StartWorkload(t, root, 1, 2048, 2)

	a, _ := cleanGPUAfter(t, root, 1, func() { client.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, client.Children...)
	wantAlive(t, "the MPS control daemon", mps.PID)
	wantAlive(t, "the MPS server", mps.Children...)
	wantUsedMiB(t, root, 1, 66+8)
}

// TestProofMinAgePerDeadOwner (finding 7): an old orphan that a protected
// process holds keeps the GPU's memory unowned for longer than min-age; a
// trainer that dies later is still given min-age of its own.
func TestProofMinAgePerDeadOwner(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	hostengine := filepath.Join(t.TempDir(), "nv-hostengine") // a protected name
	if err := os.Link(simBin(t), hostengine); err != nil {
		t.Fatal(err)
	}
	// min-age must outlast the alert's way to the plan, so that the plan is
	// seen waiting: 3 s on an idle machine, stretched by a loaded one's
	// slowness (a plan made 3 s after the death would find the trainer
	// old enough, and the test would see no wait).
	minAge := testenv.Scale(3 * time.Second).Round(time.Second)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.min-age="+minAge.String())
	old := testenv.StartScript(t, fmt.Sprintf("exec %s run --root %s --gpu 1 --mib 1024 --children 1", hostengine, root)).Ready(t)
	syscall.Kill(old.PID, syscall.SIGKILL)
	time.Sleep(minAge + 500*time.Millisecond) // the old orphan is older than min-age
	trainer := testenv.StartWorkload(t, root, 1, 2048, 2)
	trainer.KillParent(t)
	died := time.Now()

	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(130), time.Now().Add(-time.Minute)))
	if code, resp := post(t, url, token, body); code != 200 {
		t.Fatalf("post: %d %s", code, resp)
	}
	testenv.Eventually(t, 10*time.Second, "the action to wait for the trainer's min-age", func() bool {
		as := actions(t, url)
		return len(as) == 1 && as[0].State == remediate.StateQueued && strings.Contains(as[0].Reason, "too_young")
	})
	if time.Since(died) < minAge*2/3 {
		wantAlive(t, "a worker of a trainer dead for less than min-age", trainer.Children...)
	}
	var a remediate.Action
	testenv.Eventually(t, 20*time.Second, "the action to finish", func() bool {
		as := actions(t, url)
		a = as[0]
		return a.State != remediate.StateQueued && a.State != remediate.StateRunning
	})
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	if a.FinishedAt == nil || a.FinishedAt.Sub(died) < minAge {
		t.Errorf("the trainer's workers were signalled %v after it died, before min-age (%s)", a.FinishedAt.Sub(died), minAge)
	}
	wantTargets(t, a, trainer.Children...)
	wantAlive(t, "the protected holder of the old orphan", old.Children...)
	wantUsedMiB(t, root, 1, 1024+8)
}

// TestProofReusedPIDHoldsTheGPU (finding 8): the dead trainer's PID is
// recreated for a process that opens and maps the same GPU (a launcher).
// NVML still lists the PID with the dead trainer's memory.
func TestProofReusedPIDHoldsTheGPU(t *testing.T) {
	skipShort(t)
	root := testenv.SimNode(t, 2)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 4096 --children 2 & wait", simBin(t), root))
	w := script.Ready(t)
	waitRecorded(t, url, 2)
	if err := syscall.Kill(w.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testenv.WaitGone(t, w.PID)
	newcomer := testenv.StartWithPID(t, w.PID, func() *exec.Cmd {
		c := exec.Command(simBin(t), "launch", "--root", root, "--gpu", "1")
		c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return c
	})
	testenv.Eventually(t, 5*time.Second, "the newcomer to map GPU 1", func() bool {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", w.PID))
		return strings.Contains(string(b), "nvidia1")
	})

	a := alertAndWait(t, url, root, 1, fp(131))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, w.Children...)
	wantAlive(t, "the newcomer given the dead trainer's PID", newcomer.Process.Pid)
	wantUsedMiB(t, root, 1, 0)
}

// TestProofReplacementIsReplanned (finding 9): the trainer's worker, told
// to stop, starts a replacement that holds the context and exits. The job
// script leads the group, so it is not killed whole. The action must not
// call that leftover "other holders": it plans again, signals the
// replacement (a proven inheritor: the worker's child), and the memory
// comes back.
func TestProofReplacementIsReplanned(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 4096 --children 1 --respawn-on-sigterm & wait; sleep 300", simBin(t), root))
	w := script.Ready(t)
	waitRecorded(t, url, 1)
	syscall.Kill(w.PID, syscall.SIGKILL)
	testenv.WaitGone(t, w.PID)

	a := alertAndWait(t, url, root, 1, fp(132))
	if a.State != remediate.StateSucceeded || strings.HasPrefix(a.Reason, "other holders remain") {
		t.Fatalf("action %s (%s), want succeeded with the memory back", a.State, a.Reason)
	}
	if len(a.Targets) != 2 || !slices.ContainsFunc(a.Targets, func(tg remediate.Target) bool { return tg.PID == w.Children[0] }) {
		t.Errorf("targets %v, want the worker and its replacement", targetPIDs(a))
	}
	wantAlive(t, "the job script", script.Cmd.Process.Pid)
	wantUsedMiB(t, root, 1, 0)
}

// TestProofOrphanedOwnerWithWorkers (finding 9): under orphaned, a nohup
// job orphaned from its session has forked workers holding its context.
// Killing the owner alone would leave the memory held: its workers are
// targets of the same plan. A fork orphan on the same GPU makes it a GPU
// with an orphan (finding 6).
func TestProofOrphanedOwnerWithWorkers(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.policy=orphaned")
	script := testenv.StartScript(t, fmt.Sprintf("nohup %s run --root %s --gpu 1 --mib 2048 --children 2 &", simBin(t), root))
	job := script.Ready(t)
	script.Cmd.Wait()
	waitRecorded(t, url, 2)
	orphan := testenv.StartWorkload(t, root, 1, 1024, 1)
	orphan.KillParent(t)
	// What is awaited here is time itself: the fork orphan's owner dead for
	// --remediate.min-age (500ms) as the agent saw it die (one collector
	// interval, 200ms, later at most), so that one plan takes both; an
	// alert sooner leaves its worker to a later action, excluded as
	// dead_owner_too_young (seen on a loaded machine).
	time.Sleep(500*time.Millisecond + 200*time.Millisecond + 300*time.Millisecond)

	a := alertAndWait(t, url, root, 1, fp(133))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, append(append([]int{job.PID}, job.Children...), orphan.Children...)...)
	wantUsedMiB(t, root, 1, 0)
}

// TestProofNoProofNoSignal: the agent starts after a trainer that led
// neither its group nor its session died. Nothing the kernel shows now
// ties its workers to it: they are unexplained holders, named in the
// record, and not signalled. A missed orphan, never a wrong kill
// (docs/safety.md says when this happens).
func TestProofNoProofNoSignal(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 2048 --children 2 & wait", simBin(t), root))
	w := script.Ready(t)
	syscall.Kill(w.PID, syscall.SIGKILL)
	testenv.WaitGone(t, w.PID)

	a, _ := cleanGPU(t, root, 1, "--act")
	if a.State != remediate.StateSkipped || len(a.Targets) != 0 || !strings.Contains(a.Reason, "nothing proves that") {
		t.Errorf("action %s (%s) with targets %v, want skipped, naming the unexplained holders", a.State, a.Reason, targetPIDs(a))
	}
	for _, c := range w.Children {
		if why := excludedAs(a, c); why != "unexplained_holder" {
			t.Errorf("worker %d recorded as %q, want unexplained_holder", c, why)
		}
	}
	wantAlive(t, "an unproven holder", w.Children...)
}

// TestProofLauncherBelongsToItsJob: the ancestor rule alone. A launcher
// that called cuInit (the device mapped, no context), parent of a live
// rank, beside another job's fork orphan, is part of the rank's job: no
// suspect at all, not even an unexplained holder.
func TestProofLauncherBelongsToItsJob(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	sim := simBin(t)
	s := testenv.StartScript(t, fmt.Sprintf("exec %s launch --root %s --gpu 1 -- %s run --root %s --gpu 1 --mib 1024", sim, root, sim, root))
	launcher := s.Line(t, "launcher").PID
	s.Ready(t)
	orphan := testenv.StartWorkload(t, root, 1, 2048, 1)
	orphan.KillParent(t)
	out, err := exec.Command(testenv.Bin(t, "gpu-orphan"), "ps", "-o", "json", "--backend=sim", "--sim.root="+root).Output()
	if err != nil {
		t.Fatalf("gpu-orphan ps: %v\n%s", err, out)
	}
	var r struct {
		GPUs []struct {
			Suspects []struct {
				PID    int    `json:"pid"`
				Reason string `json:"reason"`
			} `json:"suspects"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatal(err)
	}
	for _, h := range r.GPUs[1].Suspects {
		if h.PID == launcher {
			t.Errorf("the launcher of a live rank is a suspect (%s)", h.Reason)
		}
	}
}
