package cmd

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// BinDirEnv names a directory holding binaries built by `make build`;
// `make bench` sets it, so that BenchmarkIdleRSS measures the very
// binaries the Makefile builds. Without it the benchmark builds its own
// the same way (-trimpath -tags netgo).
const BinDirEnv = "GPU_ORPHAN_BENCH_BIN"

const (
	// idleFor is how long the daemons run before their memory is read, at
	// their default collector intervals; idleScrape is how often each is
	// scraped meanwhile, so that the HTTP path is warm.
	idleFor    = 20 * time.Second
	idleScrape = 5 * time.Second
	idleGPUs   = 2
	idleToken  = "idle-rss-bench-token-0123456789abcdef"
)

// BenchmarkIdleRSS: the memory of the node's two daemons idle (issue 18,
// §2). The real gpu-orphan-exporter and the real gpu-orphan-remediator
// (node role), both --backend=sim on a 2-GPU simulated node with nothing
// running, are started side by side and left for idleFor at their default
// intervals, scraped every idleScrape; then VmRSS, RssAnon and RssFile are
// read from each one's /proc/PID/status. The timed op, after the reading,
// is one scrape of each. Both run with their default flags, as shipped, so
// the guard follows the defaults: --nvml.release-zero-pages is off (opt-in
// since issue 24), and without NVML it would have nothing to hand back.
func BenchmarkIdleRSS(b *testing.B) {
	bin := idleBinaries(b)
	dir := b.TempDir()
	root := filepath.Join(dir, "node")
	if out, err := exec.Command(filepath.Join(bin, "gpu-orphan-sim"), "init", "--root", root,
		"--gpus", strconv.Itoa(idleGPUs)).CombinedOutput(); err != nil {
		b.Fatalf("gpu-orphan-sim init: %v\n%s", err, out)
	}
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(idleToken+"\n"), 0o600); err != nil {
		b.Fatal(err)
	}

	exporterAddr, agentAddr := testenv.FreeAddr(b), testenv.FreeAddr(b)
	exporter := testenv.Daemon(b, filepath.Join(bin, "gpu-orphan-exporter"),
		"--backend=sim", "--sim.root="+root, "--web.listen-address="+exporterAddr)
	agent := testenv.Daemon(b, filepath.Join(bin, "gpu-orphan-remediator"),
		"--backend=sim", "--sim.root="+root, "--node.name=idle", "--auth.token-file="+token,
		"--store.path="+filepath.Join(dir, "remediator.db"), "--web.listen-address="+agentAddr)
	urls := []string{"http://" + exporterAddr + "/metrics", "http://" + agentAddr + "/metrics"}
	for _, u := range urls {
		testenv.Eventually(b, 30*time.Second, u+" to serve", func() bool { return idleScrapeOnce(u) == nil })
	}

	for end := time.Now().Add(idleFor); time.Now().Before(end); {
		time.Sleep(min(idleScrape, time.Until(end)))
		for _, u := range urls {
			if err := idleScrapeOnce(u); err != nil {
				b.Fatal(err)
			}
		}
	}
	mem := map[string]procMem{}
	for name, cmd := range map[string]*exec.Cmd{"exporter": exporter, "agent": agent} {
		m, err := readProcMem(cmd.Process.Pid)
		if err != nil {
			b.Fatal(err)
		}
		mem[name] = m
	}

	for b.Loop() {
		for _, u := range urls {
			if err := idleScrapeOnce(u); err != nil {
				b.Fatal(err)
			}
		}
	}
	for name, m := range mem {
		b.ReportMetric(mib(m.rss), name+"-rss-MiB")
		b.ReportMetric(mib(m.anon), name+"-anon-MiB")
		b.ReportMetric(mib(m.file), name+"-file-MiB")
	}
}

// idleBinaries is the directory of the binaries: BinDirEnv's, or a build
// of its own as `make build` does.
func idleBinaries(b *testing.B) string {
	b.Helper()
	if dir := os.Getenv(BinDirEnv); dir != "" {
		return dir
	}
	root, err := testenv.ModuleRoot()
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	cmd := exec.Command("go", "build", "-trimpath", "-tags", "netgo", "-o", dir+"/",
		"./cmd/gpu-orphan-exporter", "./cmd/gpu-orphan-remediator", "./cmd/gpu-orphan-sim")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build: %v\n%s", err, out)
	}
	return dir
}

func idleScrapeOnce(url string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}

// procMem is a process's resident memory, in bytes.
type procMem struct{ rss, anon, file uint64 }

func mib(n uint64) float64 { return float64(n) / (1 << 20) }

// readProcMem reads VmRSS, RssAnon and RssFile from /proc/PID/status.
func readProcMem(pid int) (procMem, error) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return procMem{}, err
	}
	return parseProcMem(data)
}

func parseProcMem(data []byte) (procMem, error) {
	var m procMem
	fields := map[string]*uint64{"VmRSS": &m.rss, "RssAnon": &m.anon, "RssFile": &m.file}
	for line := range bytes.Lines(data) {
		key, val, ok := strings.Cut(string(line), ":")
		p := fields[key]
		if !ok || p == nil {
			continue
		}
		f := strings.Fields(val) // "12345 kB"
		if len(f) != 2 || f[1] != "kB" {
			return procMem{}, fmt.Errorf("unexpected %s line %q", key, line)
		}
		kb, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return procMem{}, fmt.Errorf("%s: %w", key, err)
		}
		*p = kb << 10
		delete(fields, key)
	}
	if len(fields) > 0 {
		return procMem{}, fmt.Errorf("no %d of VmRSS, RssAnon, RssFile", len(fields))
	}
	return m, nil
}

func TestParseProcMem(t *testing.T) {
	t.Parallel()
	status := "Name:\tgpu-orphan-expo\nVmHWM:\t   18000 kB\nVmRSS:\t   17872 kB\nRssAnon:\t    2856 kB\nRssFile:\t   15016 kB\nRssShmem:\t       0 kB\n"
	got, err := parseProcMem([]byte(status))
	if err != nil {
		t.Fatal(err)
	}
	if want := (procMem{rss: 17872 << 10, anon: 2856 << 10, file: 15016 << 10}); got != want {
		t.Errorf("parseProcMem = %+v, want %+v", got, want)
	}
	for _, bad := range []string{"VmRSS:\t1 kB\nRssAnon:\t1 kB\n", "VmRSS:\t1 MB\nRssAnon:\t1 kB\nRssFile:\t1 kB\n"} {
		if _, err := parseProcMem([]byte(bad)); err == nil {
			t.Errorf("parseProcMem(%q): no error", bad)
		}
	}
}
