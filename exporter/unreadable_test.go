package exporter_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpu-orphan/gpu-orphan/exporter"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

type fixedSource struct{ s *snapshot.Snapshot }

func (f fixedSource) Latest() *snapshot.Snapshot { return f.s }
func (f fixedSource) OrphanBytes() uint64        { return 0 }

// TestCollectorUnreadableProcesses: the count of processes whose
// descriptors could not be read is exported, 0 included, beside the
// fdscan source's failure.
func TestCollectorUnreadableProcesses(t *testing.T) {
	const help = `# HELP gpu_orphan_fdscan_unreadable_processes Processes whose descriptors could not be read in the latest snapshot (not root, no CAP_SYS_PTRACE); when not 0, holders may be missing and the fdscan source fails.
# TYPE gpu_orphan_fdscan_unreadable_processes gauge
gpu_orphan_fdscan_unreadable_processes %d
# HELP gpu_orphan_source_success 1 if the source succeeded in the latest snapshot.
# TYPE gpu_orphan_source_success gauge
gpu_orphan_source_success{source="fdscan"} %d
gpu_orphan_source_success{source="proc"} 1
gpu_orphan_source_success{source="sim"} 1
`
	for _, tc := range []struct {
		name     string
		denied   int
		shielded []int
		ok       int
	}{
		{"complete", 0, nil, 1},
		{"shielded only", 0, []int{1}, 1},
		{"denied", 42, []int{1}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &snapshot.Snapshot{Taken: time.Now(), Driver: "sim", HostPIDsVisible: true,
				FDScanDenied: tc.denied, FDScanShielded: tc.shielded,
				Sources: []snapshot.Source{{Name: "sim"}, {Name: snapshot.SourceProc}, {Name: snapshot.SourceFDScan}}}
			if tc.denied > 0 {
				s.Sources[2].Err = fmt.Errorf("%w: %d processes", snapshot.ErrScanIncomplete, tc.denied)
			}
			c := exporter.NewCollector(fixedSource{s}, nil)
			want := fmt.Sprintf(help, tc.denied, tc.ok)
			if err := testutil.CollectAndCompare(c, strings.NewReader(want), "gpu_orphan_fdscan_unreadable_processes", "gpu_orphan_source_success"); err != nil {
				t.Error(err)
			}
		})
	}
}

// nobody is the unprivileged user the binaries run as.
const nobody = 65534

// TestUnreadableDescriptorsAsNobody is the issue, end to end with real
// processes: a fork orphan's memory has no live owner, and the binaries run
// without the right to read other users' /proc/PID/fd. `gpu-orphan ps` used
// to print "no suspect holders" and exit 0. Now it warns and exits non-zero,
// and the exporter counts the unreadable processes and fails fdscan. As
// root, the same node is a plain fork orphan.
func TestUnreadableDescriptorsAsNobody(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("integration test")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run the binaries as nobody")
	}
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	w.KillParent(t)

	// t.TempDir's directories are 0700: open the way to the node, and
	// copy the binaries where nobody can run them.
	shared := filepath.Dir(root)
	openToAll(t, root)
	ps := copyBin(t, testenv.Bin(t, "gpu-orphan"), shared)
	exp := copyBin(t, testenv.Bin(t, "gpu-orphan-exporter"), shared)
	simArgs := []string{"--backend=sim", "--sim.root=" + root}

	// gpu-orphan ps as nobody: a warning, and a non-zero exit.
	out, code := runAs(t, shared, true, ps, append(simArgs, "ps")...)
	if code == 0 {
		t.Errorf("ps as nobody exited 0 while holders could not be read:\n%s", out)
	}
	if !strings.Contains(out, "WARNING: the descriptors of ") || !strings.Contains(out, "could not be read (run as root, or with CAP_SYS_PTRACE)") {
		t.Errorf("ps as nobody does not warn:\n%s", out)
	}
	if strings.Contains(out, "  no suspect holders (") {
		t.Errorf("ps as nobody claims no suspect holders:\n%s", out)
	}
	t.Logf("ps as nobody (exit %d):\n%s", code, out)

	out, code = runAs(t, shared, true, ps, append(simArgs, "ps", "-o", "json")...)
	if code == 0 {
		t.Errorf("ps -o json as nobody exited 0")
	}
	var rep psReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("ps -o json as nobody: %v\n%s", err, out)
	}
	if rep.FDScanUnreadableProcesses <= 0 {
		t.Errorf("fdscan_unreadable_processes = %d as nobody, want > 0:\n%s", rep.FDScanUnreadableProcesses, out)
	}

	// The exporter as nobody: the count, and fdscan failing.
	addr := testenv.FreeAddr(t)
	cmd := exec.Command(exp, append(simArgs, "--web.listen-address="+addr, "--collector.interval=200ms")...)
	cmd.Dir = shared
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	var log strings.Builder
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		if t.Failed() {
			t.Logf("exporter log:\n%s", log.String())
		}
	})
	url := "http://" + addr + "/metrics"
	testenv.Eventually(t, 10*time.Second, "the exporter as nobody to serve a snapshot with a scan", func() bool {
		body, err := httpGet(url)
		return err == nil && strings.Contains(body, `gpu_orphan_source_success{source="fdscan"}`)
	})
	_, mfs := testenv.Scrape(t, url)
	if v, ok := testenv.Value(mfs, "gpu_orphan_fdscan_unreadable_processes", nil); !ok || v <= 0 {
		t.Errorf("gpu_orphan_fdscan_unreadable_processes = %v (present %v) as nobody, want > 0", v, ok)
	}
	if v, ok := testenv.Value(mfs, "gpu_orphan_source_success", map[string]string{"source": snapshot.SourceFDScan}); !ok || v != 0 {
		t.Errorf("gpu_orphan_source_success{source=\"fdscan\"} = %v (present %v) as nobody, want 0", v, ok)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", map[string]string{"gpu": "1"}); v != testenv.MiB(1024+8) {
		t.Errorf("unowned on GPU 1 = %v as nobody, want 1032 MiB", v)
	}

	// As root the scan is complete: a security policy's shielded PIDs
	// (this sandbox's PID 1) do not count, and the orphan is found.
	out, code = runAs(t, shared, false, ps, append(simArgs, "ps", "-o", "json")...)
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("ps -o json as root: %v\n%s", err, out)
	}
	if code != 0 || rep.FDScanUnreadableProcesses != 0 || len(rep.GPUs) != 2 || len(rep.GPUs[1].Suspects) != 1 || rep.GPUs[1].Suspects[0].PID != w.Children[0] {
		t.Errorf("ps -o json as root: exit %d, fdscan_unreadable_processes %d, want 0 and 0 with suspect %d:\n%s",
			code, rep.FDScanUnreadableProcesses, w.Children[0], out)
	}
	out, _ = runAs(t, shared, false, ps, append(simArgs, "ps")...)
	if strings.Contains(out, "WARNING") || !strings.Contains(out, strconv.Itoa(w.Children[0])) {
		t.Errorf("ps as root:\n%s", out)
	}
}

// runAs runs bin in dir, as nobody or as ourselves, and returns its stdout
// and exit code.
func runAs(t *testing.T, dir string, asNobody bool, bin string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	if asNobody {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &exit):
		t.Logf("%s stderr: %s", filepath.Base(bin), stderr.String())
		return string(out), exit.ExitCode()
	}
	t.Fatalf("%s: %v\n%s", bin, err, stderr.String())
	return "", 0
}

// openToAll makes dir and its parents up to the system's temp directory
// readable and searchable by everyone.
func openToAll(t *testing.T, dir string) {
	t.Helper()
	tmp := filepath.Clean(os.TempDir())
	for d := filepath.Clean(dir); strings.HasPrefix(d, tmp+string(filepath.Separator)); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// copyBin copies bin into dir, executable by everyone.
func copyBin(t *testing.T, bin, dir string) string {
	t.Helper()
	dst := filepath.Join(dir, filepath.Base(bin))
	testenv.CopyExecutable(t, bin, dst, 0o755)
	return dst
}

// TestPSOwnerStates: `gpu-orphan ps` tells what the kernel shows about a
// listed PID, with real processes. A dead owner whose PID was given to an
// unrelated process is DEAD, and the newcomer is named; an owner whose main
// thread exited while its other threads run is alive.
func TestPSOwnerStates(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	root := testenv.SimNode(t, 2)
	ps := testenv.Bin(t, "gpu-orphan")
	simArgs := []string{"--backend=sim", "--sim.root=" + root}

	zombie := testenv.StartWorkload(t, root, 0, 512, 0, "--zombie-leader")
	// The kernel gives out no PID that still names a live group or
	// session, so the dead owner must not lead its group: a job script
	// leads it, as a scheduler's does.
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 1024 --children 1 & wait", testenv.Bin(t, "gpu-orphan-sim"), root))
	orphan := script.Ready(t)
	if err := syscall.Kill(orphan.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testenv.WaitGone(t, orphan.PID) // the script reaped it: the PID is free
	newcomer := testenv.StartWithPID(t, orphan.PID, func() *exec.Cmd { return exec.Command("sleep", "60") })

	testenv.Eventually(t, 5*time.Second, "the zombie leader's main thread to exit", func() bool {
		return !testenv.Alive(zombie.PID) // Z, while its other threads run
	})
	out, code := runAs(t, "", false, ps, append(simArgs, "ps", "-o", "json")...)
	var rep psReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("ps -o json: %v (exit %d)\n%s", err, code, out)
	}
	if len(rep.GPUs) != 2 || len(rep.GPUs[0].Owners) != 1 || len(rep.GPUs[1].Owners) != 1 {
		t.Fatalf("ps -o json: %s", out)
	}
	if o := rep.GPUs[0].Owners[0]; !o.Alive || !o.LeaderExited || o.ReusedBy != nil {
		t.Errorf("zombie-leader owner %+v: want alive, leader_exited", o)
	}
	o := rep.GPUs[1].Owners[0]
	if o.Alive || o.ReusedBy == nil || o.ReusedBy.PID != newcomer.Process.Pid || o.ReusedBy.Comm != "sleep" || o.ReusedBy.StartTime == 0 {
		t.Errorf("reused owner %+v (reused_by %+v): want dead, reused_by the sleep %d", o, o.ReusedBy, newcomer.Process.Pid)
	}

	out, _ = runAs(t, "", false, ps, append(simArgs, "ps")...)
	for _, want := range []string{
		fmt.Sprintf("%d 512 MiB (alive, main thread exited)", zombie.PID),
		fmt.Sprintf("%d 1024 MiB (DEAD: PID now belongs to %d sleep, which holds no descriptor of this GPU)", orphan.PID, orphan.PID),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("ps lacks %q:\n%s", want, out)
		}
	}
}
