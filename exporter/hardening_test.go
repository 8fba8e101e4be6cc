package exporter_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/gpu-orphan/gpu-orphan/exporter"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// The hardening tests run the real gpu-orphan-exporter on a simulated node
// and hit it over loopback HTTP: under load (TestHardeningScrapeUnderChurn)
// and with a driver that fails or hangs (TestHardeningDriverFaults).
//
// Two environment variables change them:
//
//   - GPU_ORPHAN_SOAK_DURATION (a Go duration, e.g. 10m; scripts/soak.sh
//     sets it) turns them into a soak: the scrape test keeps its clients
//     scraping for 2/3 of it, the fault test cycles its faults for 1/3.
//   - GPU_ORPHAN_REPORT names a file the figures' lines (SCRAPE ..., FAULT
//     ...) are appended to.
const (
	hardenClients  = 50
	hardenScrapes  = 20 // per client, without a soak
	hardenProcs    = 2000
	hardenInterval = 250 * time.Millisecond
	// hardenTimeout is --nvml.timeout for the fault test; its hang is
	// hardenHang, far longer.
	hardenTimeout = 500 * time.Millisecond
	hardenHang    = 10 * time.Second
	hardenRSSMax  = 100 << 20
)

// soakFor is share of GPU_ORPHAN_SOAK_DURATION, or 0 without a soak.
func soakFor(t *testing.T, share float64) time.Duration {
	t.Helper()
	v := os.Getenv("GPU_ORPHAN_SOAK_DURATION")
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("GPU_ORPHAN_SOAK_DURATION=%q: want a positive Go duration such as 10m", v)
	}
	return time.Duration(float64(d) * share)
}

// report logs a line of figures and appends it to $GPU_ORPHAN_REPORT.
func report(t *testing.T, line string) {
	t.Helper()
	t.Log(line)
	path := os.Getenv("GPU_ORPHAN_REPORT")
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Errorf("GPU_ORPHAN_REPORT: %v", err)
		return
	}
	defer f.Close()
	if _, err := fmt.Fprintln(f, line); err != nil {
		t.Errorf("GPU_ORPHAN_REPORT: %v", err)
	}
}

// TestHardeningScrapeUnderChurn: 50 clients scrape the real exporter at
// once while ~2,000 processes come and go and a fork-orphan makes every
// snapshot scan /proc/*/fd. Every scrape must answer 200, parse, and add up;
// latency must not trend up and the exporter's memory must stay bounded.
func TestHardeningScrapeUnderChurn(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test: 2,000 processes and 50 clients")
	}
	soak := soakFor(t, 2.0/3)
	// The processes start (~15 s on a busy 2-core machine) while the
	// binaries build.
	ch := startChurner(t, hardenProcs)
	rampStart := time.Now()
	root := testenv.SimNode(t, 2)
	// GPU 0: a live job (its creator and a worker). GPU 1: docs/facts.md's fork
	// case, the creator killed, two workers still holding its context, so
	// NVML lists a dead PID and every snapshot scans /proc/*/fd.
	testenv.StartWorkload(t, root, 0, 2048, 1)
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)
	orphan.KillParent(t)

	e := startExporter(t, root, "--collector.interval="+hardenInterval.String())
	ch.waitRamp(t)
	t.Logf("%d processes started in %s (while the binaries built)", hardenProcs, time.Since(rampStart).Round(time.Millisecond))
	want := churnExpect{gpu0LiveMiB: 2048, gpu1MiB: 4096, children: orphan.Children}
	testenv.Eventually(t, 10*time.Second, "the orphan's workers to be named", func() bool {
		_, mfs := testenv.Scrape(t, e.url)
		return len(testenv.Series(mfs, "gpu_orphan_holder_info", map[string]string{"gpu": "1"})) == 2
	})

	rssStart := e.rss(t)
	started0, killed0, exited0 := ch.started.Load(), ch.killed.Load(), ch.exited.Load()
	liveMin, liveMax := ch.count(), ch.count()
	stopSampling := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() {
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopSampling:
				return
			case <-tick.C:
				n := ch.count()
				liveMin, liveMax = min(liveMin, n), max(liveMax, n)
			}
		}
	})

	// The clients: each scrapes back to back with 250-750 ms between
	// scrapes, hardenScrapes times or until the soak ends.
	transport := &http.Transport{MaxIdleConnsPerHost: hardenClients}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: 30 * time.Second}
	var (
		mu        sync.Mutex
		results   []scrapeResult
		problems  []string
		nproblems int
		codes     = map[int]int{}
		snapshots = map[float64]bool{} // timestamps seen
		scanned   = map[float64]bool{} // of those, the ones with an fd scan
		deadOwner = map[float64]bool{} // and the ones where NVML listed a dead PID
	)
	problem := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		nproblems++
		if len(problems) < 20 {
			problems = append(problems, fmt.Sprintf(format, args...))
		}
	}
	scrapeOne := func(c, i int) {
		start := time.Now()
		code, body, err := get(client, e.url)
		lat := time.Since(start)
		mu.Lock()
		results = append(results, scrapeResult{start: start, lat: lat})
		codes[code]++
		mu.Unlock()
		if err != nil || code != http.StatusOK {
			problem("client %d scrape %d: %d %v", c, i, code, err)
			return
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		mfs, err := parser.TextToMetricFamilies(strings.NewReader(body))
		if err != nil {
			problem("client %d scrape %d: parse: %v", c, i, err)
			return
		}
		for _, p := range checkConsistent(mfs) {
			problem("client %d scrape %d: %s", c, i, p)
		}
		for _, p := range want.check(mfs) {
			problem("client %d scrape %d: %s", c, i, p)
		}
		ts, _ := testenv.Value(mfs, "gpu_orphan_snapshot_timestamp_seconds", nil)
		_, scan := testenv.Value(mfs, "gpu_orphan_source_success", map[string]string{"source": "fdscan"})
		dead, _ := testenv.Value(mfs, "gpu_orphan_memory_owned_dead_bytes", map[string]string{"gpu": "1"})
		mu.Lock()
		snapshots[ts] = true
		if scan {
			scanned[ts] = true
		}
		if dead > 0 {
			deadOwner[ts] = true
		}
		mu.Unlock()
	}
	// Rounds: the 50 clients are released together (the harshest "at
	// once": more scrapes in flight than the exporter serves at a time),
	// then rest 250-750 ms, hardenScrapes times or until the soak ends.
	phase := time.Now()
	deadline := phase.Add(soak)
	for i := 0; soak > 0 && time.Now().Before(deadline) || soak == 0 && i < hardenScrapes; i++ {
		if i > 0 {
			time.Sleep(250*time.Millisecond + rand.N(500*time.Millisecond))
		}
		begin := make(chan struct{})
		var clients sync.WaitGroup
		for c := range hardenClients {
			clients.Go(func() {
				<-begin
				scrapeOne(c, i)
			})
		}
		close(begin)
		clients.Wait()
	}
	phaseDur := time.Since(phase)
	close(stopSampling)
	sampler.Wait()
	rssEnd := e.rss(t)
	started, killed, exited := ch.started.Load()-started0, ch.killed.Load()-killed0, ch.exited.Load()-exited0

	for _, p := range problems {
		t.Error(p)
	}
	if nproblems > len(problems) {
		t.Errorf("... and %d more problems", nproblems-len(problems))
	}
	if codes[http.StatusOK] != len(results) {
		t.Errorf("status codes %v: every scrape must answer 200", codes)
	}

	// Latency: the first and the last quarter of the scrapes, by start.
	slices.SortFunc(results, func(a, b scrapeResult) int { return a.start.Compare(b.start) })
	q := len(results) / 4
	all := latencies(results)
	first, last := latencies(results[:q]), latencies(results[len(results)-q:])
	report(t, fmt.Sprintf("SCRAPE p50=%s p99=%s rss_start=%s rss_end=%s",
		ms(pct(all, 0.50)), ms(pct(all, 0.99)), mib(rssStart), mib(rssEnd)))
	report(t, fmt.Sprintf("SCRAPE-DETAIL scrapes=%d clients=%d seconds=%.0f first_p50=%s first_p99=%s last_p50=%s last_p99=%s max=%s snapshots=%d fdscans=%d dead_listed=%d procs=%d..%d started=%d killed=%d exited=%d",
		len(results), hardenClients, phaseDur.Seconds(), ms(pct(first, 0.50)), ms(pct(first, 0.99)), ms(pct(last, 0.50)), ms(pct(last, 0.99)),
		ms(all[len(all)-1]), len(snapshots), len(scanned), len(deadOwner), liveMin, liveMax, started, killed, exited))

	// A load that came during the scrapes (another make test beside this
	// one) slows the last quarter by the machine's slowness.
	if limit := time.Duration(float64(10*pct(first, 0.99)+50*time.Millisecond) * max(1, testenv.Slowness())); pct(last, 0.99) > limit {
		t.Errorf("scrape p99 rose from %s (first quarter) to %s (last quarter), over %s", ms(pct(first, 0.99)), ms(pct(last, 0.99)), ms(limit))
	}
	switch {
	case rssEnd < hardenRSSMax:
	case testenv.RaceEnabled:
		// The race detector's shadow memory multiplies the heap.
		t.Logf("exporter VmRSS %s at the end, over %s: not checked in a -race build", mib(rssEnd), mib(hardenRSSMax))
	default:
		t.Errorf("exporter VmRSS %s at the end, want < %s", mib(rssEnd), mib(hardenRSSMax))
	}
	// The load was real: the processes churned throughout, and the loop kept
	// taking snapshots, each with an fd scan, while the clients scraped.
	// On a loaded machine (another make test beside this one) the
	// churner replaces what it kills more slowly: half is still churn.
	if exited == 0 || started == 0 || liveMin < hardenProcs/2 {
		t.Errorf("no churn: %d..%d processes, %d started, %d exited during the scrapes", liveMin, liveMax, started, exited)
	}
	wantSnaps := int(phaseDur / hardenInterval / 4)
	if testenv.RaceEnabled {
		wantSnaps /= 4 // a race-built exporter scans several times slower
	}
	// A loaded machine runs the loop slower by its measured slowness.
	wantSnaps = int(float64(wantSnaps) / max(1, testenv.Slowness()))
	if len(snapshots) < wantSnaps {
		t.Errorf("the scrapes saw %d snapshots in %s, want at least %d: the loop stalled", len(snapshots), phaseDur, wantSnaps)
	}
	// A listed dead PID always makes the snapshot scan. (The dead creator's
	// PID may be reused by a new process in a long soak; then it looks
	// alive, as it would on a real node, and nothing needs a scan.)
	for ts := range deadOwner {
		if !scanned[ts] {
			t.Errorf("the snapshot of %.3f lists a dead PID but did not scan /proc/*/fd", ts)
		}
	}
	if len(deadOwner) < len(snapshots)/2 {
		t.Errorf("only %d of %d snapshots saw the dead creator", len(deadOwner), len(snapshots))
	}
}

type scrapeResult struct {
	start time.Time
	lat   time.Duration
}

func get(client *http.Client, url string) (int, string, error) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// checkConsistent checks the invariants of any scrape: no negative value,
// and for every accountable GPU used = owned live + owned dead +
// unattributed exactly, 0 <= unowned = used - owned live <= used, the
// per-process series adding up to the owned figures, and one holder_info
// per counted suspect.
func checkConsistent(mfs map[string]*dto.MetricFamily) []string {
	var out []string
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, v := range sampleValues(m) {
				if v < 0 || (math.IsNaN(v) && strings.HasPrefix(name, "gpu_orphan_")) {
					out = append(out, fmt.Sprintf("%s%v = %v", name, m.GetLabel(), v))
				}
			}
		}
	}
	for _, info := range testenv.Series(mfs, "gpu_orphan_gpu_info", nil) {
		g := map[string]string{"gpu": testenv.Label(info, "gpu")}
		if ok, _ := testenv.Value(mfs, "gpu_orphan_gpu_accounting_supported", g); ok != 1 {
			continue
		}
		val := func(name string, labels map[string]string) float64 {
			v, found := testenv.Value(mfs, name, labels)
			if !found {
				out = append(out, fmt.Sprintf("GPU %s: no single %s", g["gpu"], name))
			}
			return v
		}
		used := val("gpu_orphan_memory_used_bytes", g)
		total := val("gpu_orphan_memory_total_bytes", g)
		live := val("gpu_orphan_memory_owned_live_bytes", g)
		dead := val("gpu_orphan_memory_owned_dead_bytes", g)
		unattr := val("gpu_orphan_memory_unattributed_bytes", g)
		unowned := val("gpu_orphan_unowned_memory_bytes", g)
		suspects := val("gpu_orphan_suspect_holders", g)
		// Byte counts below 2^53 add exactly in float64.
		if live+dead+unattr != used {
			out = append(out, fmt.Sprintf("GPU %s: owned live %.0f + owned dead %.0f + unattributed %.0f != used %.0f", g["gpu"], live, dead, unattr, used))
		}
		if unowned < 0 || unowned > used || unowned != used-min(live, used) {
			out = append(out, fmt.Sprintf("GPU %s: unowned %.0f, used %.0f, owned live %.0f", g["gpu"], unowned, used, live))
		}
		if dead > used || used > total {
			out = append(out, fmt.Sprintf("GPU %s: owned dead %.0f, used %.0f, total %.0f", g["gpu"], dead, used, total))
		}
		var sumLive, sumDead float64
		for _, p := range testenv.Series(mfs, "gpu_orphan_process_memory_bytes", g) {
			if testenv.Label(p, "alive") == "true" {
				sumLive += p.GetGauge().GetValue()
			} else {
				sumDead += p.GetGauge().GetValue()
			}
		}
		if sumLive != live || sumDead != dead {
			out = append(out, fmt.Sprintf("GPU %s: process_memory_bytes add up to %.0f live, %.0f dead; owned %.0f live, %.0f dead", g["gpu"], sumLive, sumDead, live, dead))
		}
		if n := len(testenv.Series(mfs, "gpu_orphan_holder_info", g)); float64(n) != suspects {
			out = append(out, fmt.Sprintf("GPU %s: suspect_holders %v, %d holder_info series", g["gpu"], suspects, n))
		}
	}
	return out
}

// sampleValues is every number a sample carries.
func sampleValues(m *dto.Metric) []float64 {
	switch {
	case m.Gauge != nil:
		return []float64{m.GetGauge().GetValue()}
	case m.Counter != nil:
		return []float64{m.GetCounter().GetValue()}
	case m.Untyped != nil:
		return []float64{m.GetUntyped().GetValue()}
	case m.Summary != nil:
		vs := []float64{m.GetSummary().GetSampleSum(), float64(m.GetSummary().GetSampleCount())}
		for _, q := range m.GetSummary().GetQuantile() {
			vs = append(vs, q.GetValue())
		}
		return vs
	case m.Histogram != nil:
		vs := []float64{m.GetHistogram().GetSampleSum(), float64(m.GetHistogram().GetSampleCount())}
		for _, b := range m.GetHistogram().GetBucket() {
			vs = append(vs, float64(b.GetCumulativeCount()))
		}
		return vs
	}
	return nil
}

// churnExpect is what the churn test's node must show in every scrape,
// whatever the other processes do.
type churnExpect struct {
	gpu0LiveMiB, gpu1MiB int
	children             []int
}

func (w churnExpect) check(mfs map[string]*dto.MetricFamily) []string {
	var out []string
	for _, src := range testenv.Series(mfs, "gpu_orphan_source_success", nil) {
		if src.GetGauge().GetValue() != 1 {
			out = append(out, fmt.Sprintf("source %s failed", testenv.Label(src, "source")))
		}
	}
	gpu0, gpu1 := map[string]string{"gpu": "0"}, map[string]string{"gpu": "1"}
	v := func(name string, g map[string]string) float64 { x, _ := testenv.Value(mfs, name, g); return x }
	if live, unowned := v("gpu_orphan_memory_owned_live_bytes", gpu0), v("gpu_orphan_unowned_memory_bytes", gpu0); live != testenv.MiB(w.gpu0LiveMiB) || unowned != testenv.MiB(8) {
		out = append(out, fmt.Sprintf("GPU 0 (a live job): owned live %.0f, unowned %.0f", live, unowned))
	}
	used, live, dead := v("gpu_orphan_memory_used_bytes", gpu1), v("gpu_orphan_memory_owned_live_bytes", gpu1), v("gpu_orphan_memory_owned_dead_bytes", gpu1)
	if used != testenv.MiB(w.gpu1MiB+8) || live+dead != testenv.MiB(w.gpu1MiB) {
		out = append(out, fmt.Sprintf("GPU 1 (the orphan): used %.0f, owned live %.0f, owned dead %.0f", used, live, dead))
	}
	// Unless a new process took the dead creator's PID (then NVML's PID
	// looks alive, as it would on a real node), its workers are the suspects.
	if dead == testenv.MiB(w.gpu1MiB) {
		var pids []int
		for _, h := range testenv.Series(mfs, "gpu_orphan_holder_info", gpu1) {
			pid, _ := strconv.Atoi(testenv.Label(h, "pid"))
			pids = append(pids, pid)
		}
		slices.Sort(pids)
		if !slices.Equal(pids, w.children) {
			out = append(out, fmt.Sprintf("GPU 1: suspects %v, want the workers %v", pids, w.children))
		}
	}
	return out
}

func latencies(rs []scrapeResult) []time.Duration {
	out := make([]time.Duration, len(rs))
	for i, r := range rs {
		out[i] = r.lat
	}
	slices.Sort(out)
	return out
}

// pct is the p-quantile of sorted durations.
func pct(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/1e6) }
func mib(b uint64) string       { return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20)) }

// churner keeps about target `sleep` processes alive: each sleeps 5-120 s
// and exits by itself, and a few random ones are killed every 100 ms; new
// ones replace them as they go.
type churner struct {
	target                  int
	mu                      sync.Mutex
	live                    map[*os.Process]bool
	started, killed, exited atomic.Int64
	ramped                  chan error
	stop                    context.CancelFunc
	loops, waits            sync.WaitGroup
}

func startChurner(t *testing.T, target int) *churner {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &churner{target: target, live: map[*os.Process]bool{}, ramped: make(chan error, 1), stop: cancel}
	t.Cleanup(c.close)
	c.loops.Go(func() {
		// Ramp up on a few goroutines: one start costs ~7 ms of fork and
		// exec on a busy 2-core machine.
		var ramp sync.WaitGroup
		var rampErr atomic.Value
		var left atomic.Int64
		left.Store(int64(target))
		for range 4 {
			ramp.Go(func() {
				for left.Add(-1) >= 0 && ctx.Err() == nil {
					if err := c.spawn(); err != nil {
						rampErr.CompareAndSwap(nil, err)
						return
					}
				}
			})
		}
		ramp.Wait()
		if err, _ := rampErr.Load().(error); err != nil {
			c.ramped <- err
			return
		}
		c.ramped <- nil
		refill := time.NewTicker(10 * time.Millisecond)
		kill := time.NewTicker(100 * time.Millisecond)
		defer refill.Stop()
		defer kill.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-kill.C:
				c.killSome(2)
			case <-refill.C:
				for n := c.target - c.count(); n > 0 && ctx.Err() == nil; n-- {
					if err := c.spawn(); err != nil {
						return // the count shows it; the test reports the churn
					}
				}
			}
		}
	})
	return c
}

func (c *churner) waitRamp(t *testing.T) {
	t.Helper()
	select {
	case err := <-c.ramped:
		if err != nil {
			t.Fatalf("starting %d processes: %v", c.target, err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("starting %d processes took over 2 minutes", c.target)
	}
}

func (c *churner) spawn() error {
	cmd := exec.Command("sleep", strconv.Itoa(5+rand.IntN(116)))
	// Die with the test binary, whatever kills it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	c.started.Add(1)
	p := cmd.Process
	c.mu.Lock()
	c.live[p] = true
	c.mu.Unlock()
	c.waits.Go(func() {
		cmd.Wait()
		c.mu.Lock()
		delete(c.live, p)
		c.mu.Unlock()
		c.exited.Add(1)
	})
	return nil
}

// killSome SIGKILLs n of the processes, whichever the map yields first.
// os.Process signals through a pidfd, so a reaped process's PID, reused
// by someone else, is never signalled.
func (c *churner) killSome(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p := range c.live {
		if n == 0 {
			return
		}
		if p.Signal(syscall.SIGKILL) == nil {
			c.killed.Add(1)
			n--
		}
	}
}

func (c *churner) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.live)
}

func (c *churner) close() {
	c.stop()
	c.loops.Wait()
	c.mu.Lock()
	for p := range c.live {
		p.Signal(syscall.SIGKILL)
	}
	c.mu.Unlock()
	c.waits.Wait()
}

// exporterProc is a running gpu-orphan-exporter whose log the test reads.
type exporterProc struct {
	cmd     *exec.Cmd
	url     string
	logPath string
}

// startExporter runs the exporter on the node under root and waits until
// it serves; SIGTERM stops it at cleanup.
func startExporter(t *testing.T, root string, extra ...string) *exporterProc {
	t.Helper()
	addr := testenv.FreeAddr(t)
	e := &exporterProc{url: "http://" + addr + "/metrics", logPath: filepath.Join(t.TempDir(), "exporter.log")}
	logf, err := os.Create(e.logPath)
	if err != nil {
		t.Fatal(err)
	}
	args := append([]string{"--backend=sim", "--sim.root=" + root, "--web.listen-address=" + addr}, extra...)
	e.cmd = exec.Command(testenv.Bin(t, "gpu-orphan-exporter"), args...)
	e.cmd.Stdout, e.cmd.Stderr = logf, logf
	e.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := e.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { e.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Errorf("the exporter did not stop within 10 s of SIGTERM")
			e.cmd.Process.Kill()
			<-done
		}
		logf.Close()
		if t.Failed() {
			log := e.log(t)
			if len(log) > 8000 {
				log = "...\n" + log[len(log)-8000:]
			}
			t.Logf("exporter log:\n%s", log)
		}
	})
	testenv.Eventually(t, 30*time.Second, "the exporter to serve", func() bool {
		_, err := httpGet(e.url)
		return err == nil
	})
	return e
}

func (e *exporterProc) log(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(e.logPath)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func (e *exporterProc) rss(t *testing.T) uint64 {
	t.Helper()
	rss, _, err := memStatus(e.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	return rss
}

// TestHardeningDriverFaults makes the simulated NVML fail for one GPU,
// fail as a whole, and hang past --nvml.timeout, then clears each fault:
// the exporter must keep answering, say what failed (in metrics and in its
// log), never publish a failed GPU's numbers, and recover.
func TestHardeningDriverFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	soak := soakFor(t, 1.0/3)
	root := testenv.SimNode(t, 2)
	testenv.StartWorkload(t, root, 0, 1024, 1)
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2)
	orphan.KillParent(t)
	e := startExporter(t, root, "--collector.interval="+hardenInterval.String(), "--nvml.timeout="+hardenTimeout.String())
	gpu0, gpu1 := map[string]string{"gpu": "0"}, map[string]string{"gpu": "1"}
	sim0 := map[string]string{"source": "sim"}

	// healthy is the node's whole truth: both GPUs read and accounted, the
	// orphan and its two workers on GPU 1.
	healthy := func(mfs map[string]*dto.MetricFamily) bool {
		for _, src := range testenv.Series(mfs, "gpu_orphan_source_success", nil) {
			if src.GetGauge().GetValue() != 1 {
				return false
			}
		}
		u0, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", gpu0)
		l0, _ := testenv.Value(mfs, "gpu_orphan_memory_owned_live_bytes", gpu0)
		u1, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", gpu1)
		return len(testenv.Series(mfs, "gpu_orphan_source_success", nil)) == 3 && u0 == testenv.MiB(8) && l0 == testenv.MiB(1024) &&
			u1 == testenv.MiB(4104) && len(testenv.Series(mfs, "gpu_orphan_holder_info", gpu1)) == 2
	}
	var mfs map[string]*dto.MetricFamily
	testenv.Eventually(t, 10*time.Second, "a healthy node", func() bool { _, mfs = testenv.Scrape(t, e.url); return healthy(mfs) })
	// The age clock of GPU 1 started at clockStart; failed reads must not
	// restart it (a failed read is not evidence the memory came back).
	age0, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_age_seconds", gpu1)
	clockStart := time.Now().Add(-time.Duration(age0 * float64(time.Second)))

	// scrape is testenv.Scrape, timed, with the invariants of every scrape.
	var scrapeMax, lastScrape time.Duration
	scrape := func() map[string]*dto.MetricFamily {
		t.Helper()
		start := time.Now()
		_, mfs := testenv.Scrape(t, e.url)
		d := time.Since(start)
		scrapeMax, lastScrape = max(scrapeMax, d), d
		if limit := testenv.Scale(2 * time.Second); d > limit {
			t.Errorf("a scrape took %s while the driver was broken, over %s", d, limit)
		}
		for _, p := range checkConsistent(mfs) {
			t.Error(p)
		}
		return mfs
	}
	// detect waits for cond and returns how long it took.
	detect := func(what string, cond func(map[string]*dto.MetricFamily) bool) time.Duration {
		t.Helper()
		start := time.Now()
		testenv.Eventually(t, 5*time.Second, what, func() bool { return cond(scrape()) })
		return time.Since(start)
	}
	// observe scrapes for d, every 100 ms, checking each scrape.
	observe := func(d time.Duration, check func(map[string]*dto.MetricFamily)) {
		t.Helper()
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
			check(scrape())
		}
	}
	var recoverMax time.Duration
	clear := func() {
		t.Helper()
		if err := sim.ClearFaults(root); err != nil {
			t.Fatal(err)
		}
		recoverMax = max(recoverMax, detect("recovery after the fault is cleared", healthy))
		// GPU 1's age clock kept running through the fault.
		mfs := scrape()
		age, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_age_seconds", gpu1)
		if want := time.Since(clockStart).Seconds() - 2; age < want {
			t.Errorf("GPU 1's orphan age is %.1f s after the fault, want >= %.1f s: a failed read restarted the clock", age, want)
		}
	}
	// noGPUNumbers: nothing about the GPUs' memory is published.
	noGPUNumbers := func(mfs map[string]*dto.MetricFamily, g map[string]string) {
		t.Helper()
		for _, name := range []string{"gpu_orphan_unowned_memory_bytes", "gpu_orphan_unowned_memory_age_seconds", "gpu_orphan_memory_used_bytes",
			"gpu_orphan_memory_owned_live_bytes", "gpu_orphan_memory_owned_dead_bytes", "gpu_orphan_memory_unattributed_bytes",
			"gpu_orphan_suspect_holders", "gpu_orphan_holder_info", "gpu_orphan_process_memory_bytes"} {
			if s := testenv.Series(mfs, name, g); len(s) > 0 {
				t.Errorf("%s published for a GPU that could not be read: %v", name, s[0].GetLabel())
			}
		}
	}
	logHas := func(re *regexp.Regexp) {
		t.Helper()
		// LogChanges writes the line as the snapshot is recorded; allow it
		// a moment to reach the file.
		testenv.Eventually(t, 2*time.Second, "the log line "+re.String(), func() bool { return re.MatchString(e.log(t)) })
	}

	var gpuDetect, readDetect, hangDetect, hangAgeMax, hangScrapeMax time.Duration
	var hangSnapshots int
	cycles := 0
	for deadline := time.Now().Add(soak); cycles == 0 || time.Now().Before(deadline); cycles++ {
		// (a) NVML fails for GPU 1 only.
		const lost = "GPU has fallen off the bus"
		if err := sim.WriteFaults(root, sim.Faults{Error: lost, GPU: 1}); err != nil {
			t.Fatal(err)
		}
		gpuDetect = max(gpuDetect, detect("gpu_read_success{gpu=1} 0", func(mfs map[string]*dto.MetricFamily) bool {
			v, ok := testenv.Value(mfs, "gpu_orphan_gpu_read_success", gpu1)
			return ok && v == 0
		}))
		observe(time.Second, func(mfs map[string]*dto.MetricFamily) {
			if v, ok := testenv.Value(mfs, "gpu_orphan_gpu_accounting_supported", map[string]string{"gpu": "1", "reason": "read_error"}); !ok || v != 0 {
				t.Errorf("gpu_accounting_supported{gpu=1,reason=read_error} = %v (present %v), want 0", v, ok)
			}
			if v, _ := testenv.Value(mfs, "gpu_orphan_gpu_read_success", gpu1); v != 0 {
				t.Errorf("gpu_read_success{gpu=1} = %v while GPU 1 fails", v)
			}
			noGPUNumbers(mfs, gpu1)
			if v, _ := testenv.Value(mfs, "gpu_orphan_source_success", sim0); v != 1 {
				t.Errorf("source_success{sim} = %v: one GPU's error failed the whole read", v)
			}
			u0, _ := testenv.Value(mfs, "gpu_orphan_unowned_memory_bytes", gpu0)
			l0, _ := testenv.Value(mfs, "gpu_orphan_memory_owned_live_bytes", gpu0)
			r0, _ := testenv.Value(mfs, "gpu_orphan_gpu_read_success", gpu0)
			if u0 != testenv.MiB(8) || l0 != testenv.MiB(1024) || r0 != 1 {
				t.Errorf("GPU 0 while GPU 1 fails: read %v, unowned %.0f, owned live %.0f; want 1, 8 MiB, 1024 MiB", r0, u0, l0)
			}
		})
		logHas(regexp.MustCompile(`level=ERROR .*msg="Cannot read GPU" gpu=1 uuid=\S+ err="` + lost + `"`))
		clear()

		// (b) The whole read fails.
		const unloaded = "NVML driver not loaded"
		if err := sim.WriteFaults(root, sim.Faults{Error: unloaded, GPU: sim.AllGPUs}); err != nil {
			t.Fatal(err)
		}
		readDetect = max(readDetect, detect("source_success{sim} 0", func(mfs map[string]*dto.MetricFamily) bool {
			v, ok := testenv.Value(mfs, "gpu_orphan_source_success", sim0)
			return ok && v == 0
		}))
		observe(time.Second, func(mfs map[string]*dto.MetricFamily) {
			if v, ok := testenv.Value(mfs, "gpu_orphan_source_success", sim0); !ok || v != 0 {
				t.Errorf("source_success{sim} = %v (present %v) while every read fails", v, ok)
			}
			// A snapshot whose driver read failed has no GPUs: nothing stale.
			noGPUNumbers(mfs, nil)
		})
		logHas(regexp.MustCompile(`level=ERROR .*msg="Snapshot source failed" input=sim err="reading GPUs through sim: ` + unloaded + `"`))
		clear()

		// (c) The driver hangs for far longer than --nvml.timeout.
		if err := sim.WriteFaults(root, sim.Faults{Delay: hardenHang, GPU: sim.AllGPUs}); err != nil {
			t.Fatal(err)
		}
		hangDetect = max(hangDetect, detect("source_success{sim} 0 under a hang", func(mfs map[string]*dto.MetricFamily) bool {
			v, ok := testenv.Value(mfs, "gpu_orphan_source_success", sim0)
			return ok && v == 0
		}))
		stamps := map[float64]bool{}
		// The waits below are a loaded machine's: its slowness stretches
		// them, as testenv.Eventually's.
		hangWatch, slack := testenv.Scale(3*time.Second), testenv.Scale(time.Second)
		observe(hangWatch, func(mfs map[string]*dto.MetricFamily) {
			hangScrapeMax = max(hangScrapeMax, lastScrape)
			if v, ok := testenv.Value(mfs, "gpu_orphan_source_success", sim0); !ok || v != 0 {
				t.Errorf("source_success{sim} = %v (present %v) while the driver hangs", v, ok)
			}
			noGPUNumbers(mfs, nil)
			// The latest snapshot is the latest attempt: it says how old it
			// is, and that attempt is honest (no GPUs, the driver failed).
			ts, _ := testenv.Value(mfs, "gpu_orphan_snapshot_timestamp_seconds", nil)
			age, _ := testenv.Value(mfs, "gpu_orphan_snapshot_age_seconds", nil)
			stamps[ts] = true
			ageD := time.Duration(age * float64(time.Second))
			hangAgeMax = max(hangAgeMax, ageD)
			if skew := float64(time.Now().UnixNano())/1e9 - (ts + age); age < 0 || math.Abs(skew) > slack.Seconds() {
				t.Errorf("snapshot timestamp %.3f + age %.3f is %.3f s off the clock", ts, age, skew)
			}
			if dur, _ := testenv.Value(mfs, "gpu_orphan_source_duration_seconds", sim0); dur > (hardenTimeout + slack).Seconds() {
				t.Errorf("source_duration_seconds{sim} = %.3f: the read was not cut at --nvml.timeout=%s", dur, hardenTimeout)
			}
		})
		hangSnapshots = len(stamps)
		if len(stamps) < 2 {
			t.Errorf("%d snapshot(s) in %s of a hung driver: the loop is stuck behind it", len(stamps), hangWatch)
		}
		if limit := hardenTimeout + hardenInterval + 2*slack; hangAgeMax > limit {
			t.Errorf("snapshot age reached %s under a hang, want <= %s", hangAgeMax, limit)
		}
		logHas(regexp.MustCompile(`level=ERROR .*msg="Snapshot source failed" input=sim err="(reading GPUs through sim: context deadline exceeded|` + regexp.QuoteMeta("an earlier GPU driver call is still hung") + `)"`))
		clear()
	}
	report(t, fmt.Sprintf("FAULT cycles=%d gpu_error_detect=%s read_error_detect=%s hang_detect=%s hang_scrape_max=%s hang_age_max=%s hang_snapshots_3s=%d recover_max=%s scrape_max=%s",
		cycles, ms(gpuDetect), ms(readDetect), ms(hangDetect), ms(hangScrapeMax), ms(hangAgeMax), hangSnapshots, ms(recoverMax), ms(scrapeMax)))
}

// TestHardeningScrapesWaitTheirTurn: more scrapes at once than the handler
// gathers at a time wait for a turn instead of getting a 503, and no more
// than its bound gather at once. A collector that blocks holds the first
// ones in flight.
func TestHardeningScrapesWaitTheirTurn(t *testing.T) {
	const clients, bound = 60, 40 // bound: the handler's maxScrapesInFlight
	blocking := &blockingCollector{release: make(chan struct{})}
	reg := prometheus.NewRegistry()
	reg.MustRegister(blocking)
	h, err := exporter.NewHandler(reg, "/metrics", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	defer blocking.open() // before Close, which waits for the blocked scrapes
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}, Timeout: 30 * time.Second}

	codes := make(chan int, clients)
	for range clients {
		go func() {
			code, _, err := get(client, srv.URL+"/metrics")
			if err != nil {
				t.Error(err)
			}
			codes <- code
		}()
	}
	testenv.Eventually(t, 10*time.Second, "the first scrapes to be gathering", func() bool { return blocking.inside.Load() == bound })
	time.Sleep(200 * time.Millisecond) // the others have arrived and wait
	if n := blocking.inside.Load(); n != bound {
		t.Errorf("%d scrapes gathering at once, want the bound %d", n, bound)
	}
	select {
	case code := <-codes:
		t.Fatalf("a scrape answered %d while it should wait for a turn", code)
	default:
	}
	blocking.open()
	got := map[int]int{}
	for range clients {
		got[<-codes]++
	}
	if got[http.StatusOK] != clients {
		t.Errorf("status codes %v, want %d x 200", got, clients)
	}
	if p := blocking.peak.Load(); p > bound {
		t.Errorf("%d scrapes gathered at once, over the bound %d", p, bound)
	}
}

// blockingCollector holds every Collect until open is called.
type blockingCollector struct {
	release      chan struct{}
	once         sync.Once
	inside, peak atomic.Int64
}

func (c *blockingCollector) open() { c.once.Do(func() { close(c.release) }) }

func (c *blockingCollector) Describe(chan<- *prometheus.Desc) {}

func (c *blockingCollector) Collect(ch chan<- prometheus.Metric) {
	n := c.inside.Add(1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
	<-c.release
	c.inside.Add(-1)
	ch <- prometheus.MustNewConstMetric(prometheus.NewDesc("test_blocked", "A metric after a wait.", nil, nil), prometheus.GaugeValue, 1)
}
