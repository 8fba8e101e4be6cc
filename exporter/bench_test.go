package exporter_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/exporter"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// The benchmark node: 8 simulated GPUs, a few workloads of which two are
// docs/facts.md's fork-orphan case (creator killed, forked children still hold
// the context), and, like docs/facts.md's measurement machine, 2,000 other
// processes holding ~24 descriptors each (~48,000 links for every fd scan).
const (
	benchGPUs     = 8
	benchProcs    = 2000
	benchExtraFDs = 21 // + stdin, stdout, stderr = 24 per process

	// The exporter's default --collector.interval.
	defaultInterval = 5 * time.Second
	// rssInterval makes the real binary scan /proc/*/fd every second, and
	// rssSoak is how long it runs so before the scrapes that end with the
	// RSS reading.
	rssInterval = time.Second
	rssSoak     = 15 * time.Second

	// BenchmarkExporterScanRSS: the crowd whose descriptors every scan
	// reads (benchProcs of them shared with the other benchmarks), how
	// long the exporter runs quiet first, and how many scans it makes then.
	scanCrowd = 6000
	quietSoak = 10 * time.Second
	rssScans  = 20
)

var benchWorkloads = []struct {
	gpu, mib, children int
	orphan             bool // kill -9 the creator, leaving its children
}{
	{gpu: 0, mib: 8192, children: 4},
	{gpu: 1, mib: 6144, children: 2, orphan: true},
	{gpu: 2, mib: 2048},
	{gpu: 4, mib: 4096, children: 4, orphan: true},
	{gpu: 5, mib: 16384, children: 2},
	{gpu: 7, mib: 1024, children: 1},
}

// benchOwners is how many NVML-listed owners the node has in all (issue
// 11: the owner table is measured with 8 GPUs, 64 owners and 2,000
// processes): benchWorkloads' creators, then small live jobs spread over
// the GPUs.
const benchOwners = 64

// benchSuspects is how many holder_info series the node must show: the
// children of the orphan workloads.
func benchSuspects() int {
	n := 0
	for _, w := range benchWorkloads {
		if w.orphan {
			n += w.children
		}
	}
	return n
}

// The 2,000 processes take ~17 s to start on a 2-core VM, so both
// benchmarks share them; TestMain kills them.
var sleepers struct {
	once sync.Once
	err  error
	*testenv.Crowd
}

// TestMain also removes the binaries the integration tests built.
func TestMain(m *testing.M) {
	code := testenv.Main(m)
	if sleepers.Crowd != nil {
		sleepers.Stop()
	}
	os.Exit(code)
}

func startSleepers(b *testing.B) {
	b.Helper()
	sleepers.once.Do(func() { sleepers.Crowd, sleepers.err = testenv.StartCrowd(benchProcs, benchExtraFDs+3, 0) })
	if sleepers.err != nil {
		b.Fatal(sleepers.err)
	}
}

// benchNode makes the 8-GPU node with its workloads, orphans included, and
// the 2,000 processes; it returns the node's root.
func benchNode(b *testing.B) string {
	b.Helper()
	startSleepers(b)
	root := testenv.SimNode(b, benchGPUs)
	for _, spec := range benchWorkloads {
		w := testenv.StartWorkload(b, root, spec.gpu, spec.mib, spec.children)
		if spec.orphan {
			w.KillParent(b)
		}
	}
	for i := len(benchWorkloads); i < benchOwners; i++ {
		testenv.StartWorkload(b, root, i%benchGPUs, 64, 0)
	}
	return root
}

// BenchmarkScrape times GET /metrics against the exporter's own handler on
// the benchmark node, with the snapshot loop running in the background:
//
//   - latest: the loop's default 5 s interval; scrapes serve the latest
//     snapshot while no refresh runs, the common case.
//   - refreshing: the loop refreshes back to back, so every scrape competes
//     with an fd scan of ~48,000 links for the CPUs.
//
// Each op is one scrape; p50-ms and p99-ms are over every timed scrape.
//
// static is the floor of this machine: the body of a scrape served as a
// constant by a bare handler, over the same loopback and client.
func BenchmarkScrape(b *testing.B) {
	root := benchNode(b)
	var body string
	b.Run("latest", func(b *testing.B) { body = benchScrape(b, root, defaultInterval) })
	b.Run("refreshing", func(b *testing.B) { benchScrape(b, root, time.Millisecond) })
	b.Run("static", func(b *testing.B) {
		if body == "" {
			b.Skip("needs the body of BenchmarkScrape/latest")
		}
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
			io.WriteString(w, body)
		}))
		defer srv.Close()
		client := srv.Client()
		var lat []time.Duration
		for b.Loop() {
			lat = append(lat, scrapeOnce(b, client, srv.URL))
		}
		reportLatency(b, lat, "")
		b.ReportMetric(float64(len(body)), "body-bytes")
	})
}

// benchScrape times scrapes of the exporter's handler over a loop with the
// given interval, and returns the body of one scrape.
func benchScrape(b *testing.B, root string, interval time.Duration) string {
	driver, err := sim.NewDriver(root)
	if err != nil {
		b.Fatal(err)
	}
	fs, err := proc.NewFS("/proc")
	if err != nil {
		b.Fatal(err)
	}
	logger := slog.New(slog.DiscardHandler)
	taker := snapshot.NewTaker(snapshot.Config{
		Driver:           driver,
		Proc:             fs,
		ScanUnownedBytes: 256 << 20,
		ExcludePIDs:      []int{os.Getpid()},
		Logger:           logger,
	})
	loop := snapshot.NewLoop(taker, interval, 256<<20)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	b.Cleanup(func() { cancel(); wg.Wait() })

	// Count the snapshots the loop records, and their fd scan time.
	var refreshes atomic.Int64
	var scanNanos atomic.Int64
	first := loop.Next()
	wg.Go(func() { loop.Run(ctx) })
	wg.Go(func() {
		for {
			next := loop.Next()
			select {
			case <-ctx.Done():
				return
			case <-next:
			}
			refreshes.Add(1)
			for _, src := range loop.Latest().Sources {
				if src.Name == snapshot.SourceFDScan {
					scanNanos.Add(int64(src.Duration))
				}
			}
		}
	})
	<-first

	handler, err := exporter.NewHandler(exporter.NewGatherer(exporter.NewRegistry(loop, logger), loop), "/metrics", logger)
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(handler)
	b.Cleanup(srv.Close)
	url := srv.URL + "/metrics"
	body := checkBenchScrape(b, url)

	client := srv.Client()
	var lat []time.Duration
	refreshes0, scan0 := refreshes.Load(), scanNanos.Load()
	for b.Loop() {
		lat = append(lat, scrapeOnce(b, client, url))
	}
	reportLatency(b, lat, "")
	if n := refreshes.Load() - refreshes0; n > 0 {
		b.ReportMetric(float64(n), "refreshes")
		b.ReportMetric(float64(scanNanos.Load()-scan0)/float64(n)/1e6, "scan-ms")
	} else {
		b.ReportMetric(0, "refreshes")
	}
	return body
}

// checkBenchScrape makes sure the scrape being timed is the real one: 8
// GPUs, the orphans' children named, the fd scan run. It returns the body.
func checkBenchScrape(b *testing.B, url string) string {
	b.Helper()
	body, mfs := testenv.Scrape(b, url)
	if n := len(testenv.Series(mfs, "gpu_orphan_gpu_info", nil)); n != benchGPUs {
		b.Fatalf("%d GPUs in the scrape, want %d", n, benchGPUs)
	}
	if n := len(testenv.Series(mfs, "gpu_orphan_holder_info", nil)); n != benchSuspects() {
		b.Fatalf("%d suspects in the scrape, want %d: %s", n, benchSuspects(), testenv.Describe(mfs, "gpu_orphan_holder_info"))
	}
	if _, ok := testenv.Value(mfs, "gpu_orphan_source_success", map[string]string{"source": snapshot.SourceFDScan}); !ok {
		b.Fatal("no fd scan in the latest snapshot")
	}
	return body
}

func scrapeOnce(b *testing.B, client *http.Client, url string) time.Duration {
	start := time.Now()
	resp, err := client.Get(url)
	if err != nil {
		b.Fatal(err)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	d := time.Since(start)
	if err != nil || resp.StatusCode != http.StatusOK {
		b.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return d
}

// reportLatency reports the median, 99th percentile and maximum of lat.
func reportLatency(b *testing.B, lat []time.Duration, prefix string) {
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	q := func(p float64) float64 {
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Nanoseconds()) / 1e6
	}
	b.ReportMetric(q(0.50), prefix+"p50-ms")
	b.ReportMetric(q(0.99), prefix+"p99-ms")
	b.ReportMetric(float64(lat[len(lat)-1].Nanoseconds())/1e6, prefix+"max-ms")
}

// BenchmarkExporterRSS runs the real gpu-orphan-exporter --backend=sim on
// the benchmark node with a 1 s interval, so that it scans /proc/*/fd every
// second (the orphans make every snapshot scan). After rssSoak of scrapes
// every 100 ms it is scraped back to back (the timed ops), then its VmRSS
// and VmHWM are read from /proc/PID/status.
func BenchmarkExporterRSS(b *testing.B) {
	root := benchNode(b)
	addr := testenv.FreeAddr(b)
	cmd := testenv.Daemon(b, testenv.Bin(b, "gpu-orphan-exporter"), "--backend=sim", "--sim.root="+root,
		"--web.listen-address="+addr, "--collector.interval="+rssInterval.String())
	url := "http://" + addr + "/metrics"
	testenv.Eventually(b, 30*time.Second, "the exporter to serve", func() bool {
		_, err := httpGet(url)
		return err == nil
	})
	checkBenchScrape(b, url)

	// Soak: the snapshots it takes are the distinct timestamps it serves.
	snapshots := map[float64]bool{}
	var scans []float64
	for end := time.Now().Add(rssSoak); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		_, mfs := testenv.Scrape(b, url)
		ts, _ := testenv.Value(mfs, "gpu_orphan_snapshot_timestamp_seconds", nil)
		if !snapshots[ts] {
			snapshots[ts] = true
			if d, ok := testenv.Value(mfs, "gpu_orphan_source_duration_seconds", map[string]string{"source": snapshot.SourceFDScan}); ok {
				scans = append(scans, d)
			}
		}
	}
	if len(scans) < len(snapshots)-1 {
		b.Fatalf("only %d of %d snapshots scanned /proc/*/fd", len(scans), len(snapshots))
	}

	client := &http.Client{}
	var lat []time.Duration
	for b.Loop() {
		lat = append(lat, scrapeOnce(b, client, url))
	}
	rss, hwm, err := memStatus(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	reportLatency(b, lat, "bin-")
	b.ReportMetric(float64(len(snapshots)), "snapshots")
	var sum float64
	for _, s := range scans {
		sum += s
	}
	if len(scans) > 0 {
		b.ReportMetric(sum/float64(len(scans))*1e3, "scan-ms")
	}
	b.ReportMetric(float64(rss)/(1<<20), "rss-MiB")
	b.ReportMetric(float64(hwm)/(1<<20), "hwm-MiB")
}

// memStatus reads VmRSS and VmHWM, in bytes, from /proc/PID/status.
func memStatus(pid int) (rss, hwm uint64, err error) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, 0, err
	}
	for line := range strings.Lines(string(data)) {
		key, val, ok := strings.Cut(line, ":")
		if !ok || (key != "VmRSS" && key != "VmHWM") {
			continue
		}
		f := strings.Fields(val) // "12345 kB"
		if len(f) != 2 || f[1] != "kB" {
			return 0, 0, fmt.Errorf("/proc/%d/status: unexpected %s line %q", pid, key, line)
		}
		kb, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, 0, err
		}
		if key == "VmRSS" {
			rss = kb << 10
		} else {
			hwm = kb << 10
		}
	}
	if rss == 0 || hwm == 0 {
		return 0, 0, fmt.Errorf("no VmRSS or VmHWM in /proc/%d/status", pid)
	}
	return rss, hwm, nil
}

// BenchmarkExporterScanRSS measures whether the fd scan keeps memory: the
// real gpu-orphan-exporter --backend=sim, --collector.interval=1s, among a
// crowd of 6,000 other processes (~144,000 descriptors). It runs quiet
// first, the healthy workloads only, so that no snapshot scans /proc/*/fd;
// its VmRSS then is rss-quiet-MiB. Then the two fork-orphans appear, and
// every snapshot scans the whole crowd; after rssScans scans its VmRSS is
// rss-scanned-MiB, and the difference rss-growth-MiB. It is scraped every
// 100 ms all along, as in BenchmarkExporterRSS, so that only the scans
// differ. The timed ops are back-to-back scrapes of it among the crowd.
func BenchmarkExporterScanRSS(b *testing.B) {
	startSleepers(b)
	more, err := testenv.StartCrowd(scanCrowd-benchProcs, benchExtraFDs+3, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(more.Stop)
	root := testenv.SimNode(b, benchGPUs)
	for _, spec := range benchWorkloads {
		if !spec.orphan {
			testenv.StartWorkload(b, root, spec.gpu, spec.mib, spec.children)
		}
	}
	addr := testenv.FreeAddr(b)
	cmd := testenv.Daemon(b, testenv.Bin(b, "gpu-orphan-exporter"), "--backend=sim", "--sim.root="+root,
		"--web.listen-address="+addr, "--collector.interval="+rssInterval.String())
	url := "http://" + addr + "/metrics"
	testenv.Eventually(b, 30*time.Second, "the exporter to serve", func() bool {
		_, err := httpGet(url)
		return err == nil
	})

	// scrapeUntil scrapes every 100 ms until done says so, and returns the
	// fd scan durations of the distinct snapshots it saw.
	scrapeUntil := func(done func(snapshots int, scans []float64) bool) []float64 {
		seen := map[float64]bool{}
		var scans []float64
		for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
			_, mfs := testenv.Scrape(b, url)
			if ts, _ := testenv.Value(mfs, "gpu_orphan_snapshot_timestamp_seconds", nil); !seen[ts] {
				seen[ts] = true
				if d, ok := testenv.Value(mfs, "gpu_orphan_source_duration_seconds", map[string]string{"source": snapshot.SourceFDScan}); ok {
					scans = append(scans, d)
				}
			}
			if done(len(seen), scans) {
				return scans
			}
			if time.Now().After(deadline) {
				b.Fatalf("gave up after %d snapshots, %d of them scanning", len(seen), len(scans))
			}
		}
	}

	start := time.Now()
	if scans := scrapeUntil(func(int, []float64) bool { return time.Since(start) >= quietSoak }); len(scans) > 0 {
		b.Fatalf("the quiet exporter scanned /proc/*/fd %d times", len(scans))
	}
	quiet, _, err := memStatus(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}

	for _, spec := range benchWorkloads {
		if spec.orphan {
			testenv.StartWorkload(b, root, spec.gpu, spec.mib, spec.children).KillParent(b)
		}
	}
	scans := scrapeUntil(func(_ int, scans []float64) bool { return len(scans) >= rssScans })
	scanned, hwm, err := memStatus(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	checkBenchScrape(b, url)

	client := &http.Client{}
	var lat []time.Duration
	for b.Loop() {
		lat = append(lat, scrapeOnce(b, client, url))
	}
	reportLatency(b, lat, "bin-")
	var sum float64
	for _, s := range scans {
		sum += s
	}
	b.ReportMetric(float64(len(scans)), "scans")
	b.ReportMetric(sum/float64(len(scans))*1e3, "scan-ms")
	b.ReportMetric(float64(quiet)/(1<<20), "rss-quiet-MiB")
	b.ReportMetric(float64(scanned)/(1<<20), "rss-scanned-MiB")
	b.ReportMetric((float64(scanned)-float64(quiet))/(1<<20), "rss-growth-MiB")
	b.ReportMetric(float64(hwm)/(1<<20), "hwm-MiB")
}
