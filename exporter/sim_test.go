package exporter_test

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestSimForkOrphan runs the real exporter binary on a simulated node with
// a real workload: docs/facts.md's fork case, end to end.
func TestSimForkOrphan(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("integration test")
	}
	const interval = 500 * time.Millisecond
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 4096, 2)

	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-exporter"), "--backend=sim", "--sim.root="+root,
		"--web.listen-address="+addr, "--collector.interval="+interval.String(), "--log.level=debug")
	url := "http://" + addr + "/metrics"
	gpu1 := map[string]string{"gpu": "1"}
	testenv.Eventually(t, 10*time.Second, "the exporter to serve", func() bool {
		_, err := httpGet(url)
		return err == nil
	})

	// Alive: the creator owns its memory; only the ~8 MiB overhead has no live owner.
	_, mfs := testenv.Scrape(t, url)
	if v, _ := testenv.Value(mfs, "gpu_orphan_memory_owned_live_bytes", gpu1); v != testenv.MiB(4096) {
		t.Fatalf("owned live = %v, want 4096 MiB", v)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", gpu1); v != testenv.MiB(8) {
		t.Fatalf("unowned = %v, want 8 MiB", v)
	}
	if n := len(testenv.Series(mfs, "gpu_orphan_holder_info", nil)); n != 0 {
		t.Fatalf("%d suspects while the creator lives", n)
	}

	// Kill -9 the creator: within one interval the memory has no live owner
	// and the children are named.
	killed := time.Now()
	w.KillParent(t)
	var body string
	testenv.Eventually(t, interval+time.Second, "the orphan to show", func() bool {
		body, mfs = testenv.Scrape(t, url)
		return len(testenv.Series(mfs, "gpu_orphan_holder_info", gpu1)) == 2
	})
	t.Logf("orphan visible %s after kill -9 (interval %s)", time.Since(killed).Round(time.Millisecond), interval)
	if v, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", gpu1); v != testenv.MiB(4096+8) {
		t.Errorf("unowned = %v, want 4104 MiB", v)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_memory_owned_dead_bytes", gpu1); v != testenv.MiB(4096) {
		t.Errorf("owned dead = %v, want 4096 MiB", v)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_process_memory_bytes", map[string]string{"pid": strconv.Itoa(w.PID), "alive": "false"}); v != testenv.MiB(4096) {
		t.Errorf("the dead creator %d must stay listed with its memory: %s", w.PID, testenv.Describe(mfs, "gpu_orphan_process_memory_bytes"))
	}
	for _, m := range testenv.Series(mfs, "gpu_orphan_holder_info", gpu1) {
		pid, _ := strconv.Atoi(testenv.Label(m, "pid"))
		if !contains(w.Children, pid) || testenv.Label(m, "reason") != "inherited_from_dead_owner" || testenv.Label(m, "pgid") != strconv.Itoa(w.PID) {
			t.Errorf("unexpected suspect %v (children %v)", m.GetLabel(), w.Children)
		}
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", map[string]string{"gpu": "0"}); v != 0 {
		t.Errorf("GPU 0 is idle but has %v unowned", v)
	}
	checkGolden(t, body)

	// gpu-orphan ps sees the same.
	out, err := exec.Command(testenv.Bin(t, "gpu-orphan"), "--backend=sim", "--sim.root="+root, "ps", "-o", "json").Output()
	if err != nil {
		t.Fatalf("gpu-orphan ps: %v", err)
	}
	var rep psReport
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatal(err)
	}
	if g := rep.GPUs[1]; len(g.Suspects) != 2 || g.UnownedBytes != 4104<<20 || g.OwnedDeadBytes != 4096<<20 {
		t.Errorf("ps -o json GPU 1: %+v", g)
	}
	// Without the node agent's store, ps takes the exporter's verdicts:
	// the exporter saw the workers fork (issue 23, paper cut 3).
	table, _ := exec.Command(testenv.Bin(t, "gpu-orphan"), "--backend=sim", "--sim.root="+root, "ps", "--exporter.url="+url).Output()
	for _, want := range []string{"NO LIVE OWNER 4104 MiB", "inherited_from_dead_owner", "(exporter)", strconv.Itoa(w.Children[0])} {
		if !strings.Contains(string(table), want) {
			t.Errorf("ps table lacks %q:\n%s", want, table)
		}
	}

	// Kill the children: the memory comes back.
	for _, c := range w.Children {
		syscall.Kill(c, syscall.SIGKILL)
	}
	testenv.Eventually(t, interval+2*time.Second, "the memory to come back", func() bool {
		_, mfs = testenv.Scrape(t, url)
		v, _ := testenv.Value(mfs, "gpu_orphan_memory_used_bytes", gpu1)
		return v == 0 && len(testenv.Series(mfs, "gpu_orphan_holder_info", nil)) == 0
	})
	if v, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_age_seconds", gpu1); v != 0 {
		t.Errorf("age = %v after the memory came back", v)
	}
}

// volatile are the parts of a scrape that change from run to run.
var volatile = []struct {
	re   *regexp.Regexp
	repl string
}{
	{regexp.MustCompile(`(pid|pgid|sid|ppid)="\d+"`), `$1="N"`},
	{regexp.MustCompile(`uuid="[^"]+"`), `uuid="U"`},
	{regexp.MustCompile(`user="[^"]*"`), `user="X"`},
	{regexp.MustCompile(`^gpu_orphan_fork_record_processes \d+$`), `gpu_orphan_fork_record_processes N`},
	{regexp.MustCompile(`(gpu_orphan_(source_duration_seconds|snapshot_timestamp_seconds|snapshot_age_seconds|unowned_memory_age_seconds|process_events_applied_timestamp_seconds)(\{[^}]*\})?) .*`), `$1 V`},
}

// checkGolden lints the whole-binary scrape with promtool and diffs the
// gpu_orphan_ series, with volatile values masked, against a golden file.
func checkGolden(t *testing.T, body string) {
	t.Helper()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: run `make deps` (Debian's prometheus package)")
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
	var keep []string
	for _, line := range strings.Split(body, "\n") {
		if strings.Contains(line, "gpu_orphan_") && !strings.Contains(line, "build_info") {
			for _, v := range volatile {
				line = v.re.ReplaceAllString(line, v.repl)
			}
			keep = append(keep, line)
		}
	}
	got := strings.Join(keep, "\n") + "\n"
	const golden = "testdata/sim_fork_orphan.golden"
	if os.Getenv("UPDATE_GOLDEN") != "" {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("scrape differs from %s (UPDATE_GOLDEN=1 to accept):\n--- got\n%s", golden, got)
	}
}

func contains(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// TestNoNVMLSuggestsSim: on a machine without NVML the exporter exits with
// an error that tells the user about --backend=sim.
func TestNoNVMLSuggestsSim(t *testing.T) {
	if _, err := os.Stat("/dev/nvidiactl"); err == nil {
		t.Skip("this machine has an NVIDIA driver")
	}
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-exporter"), "--web.listen-address="+testenv.FreeAddr(t))
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("exit: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "--backend=sim") {
		t.Errorf("the error does not mention --backend=sim:\n%s", out)
	}
}
