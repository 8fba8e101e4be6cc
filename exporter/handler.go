package exporter

import (
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/gorilla/mux"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// NewRegistry returns the exporter's registry: the snapshot collector plus
// build info, Go and process collectors.
func NewRegistry(loop Source, logger *slog.Logger, extra ...prometheus.Collector) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(extra...)
	reg.MustRegister(
		NewCollector(loop, logger),
		versioncollector.NewCollector("gpu_orphan_exporter"),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return reg
}

// Scrapes gathered at once are bounded (each holds a gathered body and a
// compressor); the ones beyond wait for a turn, for up to maxScrapeWait or
// until their client gives up, rather than fail. A scrape only serialises
// the latest snapshot, so a turn comes quickly; promhttp's own
// MaxRequestsInFlight would answer 503 at once, and 50 clients scraping
// together got 503s (exporter/hardening_test.go).
const (
	maxScrapesInFlight = 40
	maxScrapeWait      = 10 * time.Second
)

// NewHandler serves metrics from g at telemetryPath, /-/healthy and a
// landing page. g is NewGatherer's in production.
func NewHandler(g prometheus.Gatherer, telemetryPath string, logger *slog.Logger) (http.Handler, error) {
	r := mux.NewRouter()
	r.Handle(telemetryPath, queueInFlight(promhttp.HandlerFor(g, promhttp.HandlerOpts{
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelError),
	}), maxScrapesInFlight, maxScrapeWait))
	r.HandleFunc("/-/healthy", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "Healthy")
	})
	if telemetryPath != "/" {
		landing, err := web.NewLandingPage(web.LandingConfig{
			Name:        "GPU Orphan Exporter",
			Description: "GPU memory that no live process owns, and the processes that hold it.",
			Version:     version.Info(),
			// pprof is not served.
			Profiling: "false",
			Links: []web.LandingLinks{
				{Address: telemetryPath, Text: "Metrics"},
				{Address: "/-/healthy", Text: "Health"},
			},
		})
		if err != nil {
			return nil, fmt.Errorf("building the landing page: %w", err)
		}
		r.Handle("/", landing)
	}
	return r, nil
}

// gatherTTL is how long one gathering serves further scrapes of the same
// snapshot. The GPU figures change only with a new snapshot, which always
// gathers anew; only the exporter's own Go and process figures may be this
// much older. Sharing a gathering keeps scrape latency low and flat when
// many scrapers arrive together.
const gatherTTL = time.Second

// NewGatherer serves one gathering of reg to every scrape of the same
// snapshot within gatherTTL; scrapes that arrive during a gathering wait
// for it rather than start their own.
func NewGatherer(reg prometheus.Gatherer, src Source) prometheus.Gatherer {
	return &cachedGatherer{g: reg, src: src, ttl: gatherTTL}
}

type cachedGatherer struct {
	g   prometheus.Gatherer
	src Source
	ttl time.Duration

	mu       sync.Mutex
	at       time.Time
	snapshot *snapshot.Snapshot
	mfs      []*dto.MetricFamily
	err      error
}

// Gather implements prometheus.Gatherer. The families are shared between
// scrapes: promhttp only reads them.
func (c *cachedGatherer) Gather() ([]*dto.MetricFamily, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	latest := c.src.Latest()
	if c.snapshot != nil && latest == c.snapshot && time.Since(c.at) < c.ttl {
		return c.mfs, c.err
	}
	c.mfs, c.err = c.g.Gather()
	c.at, c.snapshot = time.Now(), latest
	return c.mfs, c.err
}

// queueInFlight lets n requests through h at a time; the others wait for a
// turn for up to wait, then get a 503. A request whose client goes away
// while it waits is dropped.
func queueInFlight(h http.Handler, n int, wait time.Duration) http.Handler {
	turns := make(chan struct{}, n)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case turns <- struct{}{}:
		default:
			timer := time.NewTimer(wait)
			defer timer.Stop()
			select {
			case turns <- struct{}{}:
			case <-r.Context().Done():
				return
			case <-timer.C:
				http.Error(w, fmt.Sprintf("Limit of concurrent requests reached (%d), try again later.", n), http.StatusServiceUnavailable)
				return
			}
		}
		defer func() { <-turns }()
		h.ServeHTTP(w, r)
	})
}
