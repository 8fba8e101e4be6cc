package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// simGPU reads GPU index of the simulated node at root.
func simGPU(t *testing.T, root string, index int) gpu.Reading {
	t.Helper()
	d, err := sim.NewDriver(root)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rs, err := d.Read(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return rs[index]
}

// usedMiB reads GPU gpu's used memory on the simulated node at root.
func usedMiB(t *testing.T, root string, gpu int) uint64 {
	t.Helper()
	return simGPU(t, root, gpu).Memory.Used >> 20
}

// waitFile waits for path to hold a line, and returns it without its
// newline.
func waitFile(t *testing.T, path string) string {
	t.Helper()
	var got string
	testenv.Eventually(t, 60*time.Second, path, func() bool {
		b, err := os.ReadFile(path)
		got = string(b)
		return err == nil && strings.HasSuffix(got, "\n")
	})
	return strings.TrimSuffix(got, "\n")
}

// TestCleanRefusesOwnSession (issue 15, finding 12a): a job started from
// the operator's shell (here a script with job control, as an interactive
// shell has: each job in a process group of its own) shares the shell's
// session, and so does `gpu-orphan clean --act` run from that shell. It never signals them, and says so: exit 1, the
// would-be targets named, what to do instead (another session, `setsid
// -w`), the workers alive. Run as it says, from another session, it cleans
// the GPU: exit 0, memory back.
func TestCleanRefusesOwnSession(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	dir := t.TempDir()
	// The node agent runs all along: it sees the workers fork, and clean
	// reads its proof in its store once it has recorded it.
	storePath := filepath.Join(t.TempDir(), "r.db")
	agent := testenv.NodeAgent(t, root, storePath)
	script := testenv.StartScript(t, `
set -um
"$SIM" run --root "$ROOT" --gpu 1 --mib 1024 --children 2 > "$DIR/ready" &
until [ -s "$DIR/ready" ]; do sleep 0.05; done
cat "$DIR/ready"
read _ parent _ < "$DIR/ready"
until [ -e "$DIR/seen" ]; do sleep 0.05; done
{ kill -9 "$parent"; wait "$parent"; } 2>/dev/null
until [ -e "$DIR/recorded" ]; do sleep 0.05; done
"$CLI" --backend=sim --sim.root="$ROOT" clean --gpu 1 --act --grace=1s --store.path="$STORE" > "$DIR/same.out" 2>&1; echo $? > "$DIR/same.rc"
until [ -e "$DIR/go" ]; do sleep 0.05; done
setsid -w "$CLI" --backend=sim --sim.root="$ROOT" clean --gpu 1 --act --grace=1s --store.path="$STORE" > "$DIR/other.out" 2>&1; echo $? > "$DIR/other.rc"
`, "SIM="+testenv.Bin(t, "gpu-orphan-sim"), "CLI="+testenv.Bin(t, "gpu-orphan"), "ROOT="+root, "DIR="+dir, "STORE="+storePath)
	w := script.Ready(t)
	// A snapshot sees the workers share the live trainer's open file
	// before it dies: the proof needs no race with the fork events.
	testenv.Eventually(t, 10*time.Second, "the node agent to see the workers", func() bool {
		_, mfs := testenv.Scrape(t, agent+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_recorded_descendants", nil)
		return v >= 2
	})
	if err := os.WriteFile(filepath.Join(dir, "seen"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	waitInherited(t, storePath, w.Children...)
	if err := os.WriteFile(filepath.Join(dir, "recorded"), nil, 0o600); err != nil {
		t.Fatal(err)
	}

	rc := waitFile(t, filepath.Join(dir, "same.rc"))
	out, _ := os.ReadFile(filepath.Join(dir, "same.out"))
	if rc != "1" {
		t.Errorf("clean --act from the job's own session: exit %s, want 1\n%s", rc, out)
	}
	for _, want := range []string{"own_session", "refusing: 2 holders of this GPU (PIDs " + strconv.Itoa(w.Children[0]) + ", " + strconv.Itoa(w.Children[1]) + ")",
		"this command's own session (SID " + strconv.Itoa(script.Cmd.Process.Pid) + ")", "nothing was signalled", "Run it from another session", "setsid -w gpu-orphan clean"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("clean --act from the job's own session does not say %q:\n%s", want, out)
		}
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Errorf("worker %d, in the command's own session, died", c)
		}
	}
	if got := usedMiB(t, root, 1); got < 1024 {
		t.Errorf("GPU 1 uses %d MiB after the refusal, want the orphan's 1024 and more", got)
	}

	if err := os.WriteFile(filepath.Join(dir, "go"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	rc = waitFile(t, filepath.Join(dir, "other.rc"))
	out, _ = os.ReadFile(filepath.Join(dir, "other.out"))
	if rc != "0" || !strings.Contains(string(out), "Memory back: 1032 MiB freed") {
		t.Errorf("setsid -w gpu-orphan clean --act: exit %s, want 0 and the memory back\n%s", rc, out)
	}
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("worker %d survived clean --act from another session", c)
		}
	}
	if got := usedMiB(t, root, 1); got != 0 {
		t.Errorf("GPU 1 uses %d MiB after clean --act from another session", got)
	}
}

// TestCleanWaitsForMinAge (issue 15, finding 12b): `clean --min-age
// --act` on a fork orphan younger than the min-age says what it waits for,
// and acts once the orphan is that old: exit 0, memory back. The age runs
// from the trainer's death as the node agent recorded it (clean reads it
// in the agent's store), not from clean's start: the min-age is chosen
// longer than the time already passed since the death plus clean's
// start-up, stretched by the machine's slowness, in whole seconds.
func TestCleanWaitsForMinAge(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	testenv.Bin(t, "gpu-orphan") // built before the orphan's clock starts
	w := testenv.StartWorkload(t, root, 1, 1024, 2)
	storePath := filepath.Join(t.TempDir(), "r.db")
	testenv.NodeAgent(t, root, storePath)
	w.KillParent(t)
	waitInherited(t, storePath, w.Children...)
	died := waitDeadSince(t, storePath, w.PID)
	// A margin for clean to start, read the store and plan once: far
	// more than it takes, even stretched by the load.
	minAge := (time.Since(died) + testenv.Scale(2*time.Second)).Truncate(time.Second) + time.Second
	if minAge > maxMinAge {
		t.Fatalf("the orphan is already %s old: no --min-age of clean's (at most %s) is surely ahead of it", time.Since(died), maxMinAge)
	}
	flag := "--min-age=" + minAge.String()
	code, stdout, stderr := runBin(t, "--backend=sim", "--sim.root="+root, "clean", "--gpu", "1", "--act", flag, "--grace=1s", "--store.path="+storePath)
	age := time.Since(died)
	if code != 0 {
		t.Errorf("clean %s --act: exit %d, want 0\n%s%s", flag, code, stdout, stderr)
	}
	for _, want := range []string{"Waiting: GPU 1 has 1032 MiB with no live owner, not yet " + flag + " old", "Will signal", "Memory back: 1032 MiB freed"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("clean %s --act does not say %q:\n%s%s", flag, want, stdout, stderr)
		}
	}
	if age < minAge {
		t.Errorf("clean %s acted on an orphan %s old", flag, age)
	}
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("worker %d survived", c)
		}
	}
	if got := usedMiB(t, root, 1); got != 0 {
		t.Errorf("GPU 1 uses %d MiB after clean --act", got)
	}
}

// waitDeadSince waits until the node agent whose store is at storePath has
// recorded the death of owner pid (its saved lineage, which clean restores
// and ages the orphan by), and returns since when it counts it dead.
func waitDeadSince(t *testing.T, storePath string, pid int) time.Time {
	t.Helper()
	var since time.Time
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("the node agent to record owner %d dead", pid), func() bool {
		st, err := store.OpenReadOnly(t.Context(), storePath)
		if err != nil {
			return false
		}
		defer st.Close()
		data, ok, err := st.GetState(t.Context(), hooks.LineageState)
		if err != nil || !ok {
			return false
		}
		var saved struct {
			Dead []struct {
				PID   int       `json:"pid"`
				Since time.Time `json:"since"`
			} `json:"dead"`
		}
		if json.Unmarshal(data, &saved) != nil {
			return false
		}
		for _, d := range saved.Dead {
			if d.PID == pid && !d.Since.IsZero() {
				since = d.Since
				return true
			}
		}
		return false
	})
	return since
}

// TestCleanMinAgeBeyondItsWait: clean waits for at most 2m; a longer
// min-age is the remediator's, and is refused as a bad argument.
func TestCleanMinAgeBeyondItsWait(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runBin(t, "--backend=sim", "--sim.root="+t.TempDir(), "clean", "--gpu", "1", "--min-age=5m")
	want := "gpu-orphan: --min-age=5m0s is longer than clean waits (2m0s): leave it to the remediator (--remediate.min-age), or give a smaller --min-age\n"
	if code != 2 || stderr != want || stdout != "" {
		t.Errorf("clean --min-age=5m: exit %d, stderr %q, stdout %q; want 2, %q", code, stderr, stdout, want)
	}
}

// TestCleanRefusedInAnotherPIDNamespace (issue 15, finding 10): `clean
// --act` in a PID namespace of its own (unshare --pid --fork) with the
// host's /proc refuses: exit 1, what is wrong and what to do, the workers
// untouched. A dry run there warns. The same command in the host's
// namespace cleans the GPU.
func TestCleanRefusedInAnotherPIDNamespace(t *testing.T) {
	t.Parallel()
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("unshare (util-linux) is not installed")
	}
	if os.Geteuid() != 0 {
		t.Skip("unshare --pid needs root")
	}
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 2)
	storePath := filepath.Join(t.TempDir(), "r.db")
	testenv.NodeAgent(t, root, storePath)
	w.KillParent(t)
	waitInherited(t, storePath, w.Children...)
	args := []string{"--backend=sim", "--sim.root=" + root, "--path.procfs=/proc", "clean", "--gpu", "1", "--grace=1s", "--store.path=" + storePath}
	unshared := func(extra ...string) (int, string) {
		cmd := exec.Command(unshare, append(append([]string{"--pid", "--fork", testenv.Bin(t, "gpu-orphan")}, args...), extra...)...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		code := testenv.ExitCode(t, cmd.Run())
		return code, out.String()
	}

	code, out := unshared("--act")
	if code != 1 {
		t.Errorf("clean --act in its own PID namespace: exit %d, want 1\n%s", code, out)
	}
	for _, want := range []string{"gpu-orphan: refusing to act: --path.procfs=/proc", "this process is PID 1 in its own PID namespace", "hostPID: true", "--pid=host"} {
		if !strings.Contains(out, want) {
			t.Errorf("the refusal does not say %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "Will signal") || strings.Contains(out, "Signalling") {
		t.Errorf("the refusal came after a plan:\n%s", out)
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Errorf("worker %d died", c)
		}
	}

	code, out = unshared()
	if code != 0 || !strings.Contains(out, "gpu-orphan: warning: --path.procfs=/proc") || !strings.Contains(out, "Dry run: nothing was signalled") {
		t.Errorf("a dry run in its own PID namespace: exit %d, want 0, a warning and the plan\n%s", code, out)
	}

	code, stdout, stderr := runBin(t, append(args, "--act")...)
	if code != 0 || !strings.Contains(stdout, "Memory back: 1032 MiB freed") {
		t.Errorf("clean --act in the host's PID namespace: exit %d, want 0 and the memory back\n%s%s", code, stdout, stderr)
	}
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("worker %d survived", c)
		}
	}
}

// TestCleanHelpExitStatus: clean's --help gives its exit statuses.
func TestCleanHelpExitStatus(t *testing.T) {
	t.Parallel()
	_, stdout, stderr := runBin(t, "clean", "--help")
	help := strings.Join(strings.Fields(stdout+stderr), " ")
	for _, want := range []string{"Exit status: 0 when the GPU is clean, or was cleaned and the memory verified back",
		"1 when there is something it would not or could not do, which it explains, with what to do instead",
		"2 for a wrong flag or argument", "looking again every 250ms; a --min-age above 2m0s is the remediator's"} {
		if !strings.Contains(help, want) {
			t.Errorf("clean --help does not say %q:\n%s", want, help)
		}
	}
}
