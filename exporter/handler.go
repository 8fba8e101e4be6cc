package exporter

import (
	"fmt"
	"log/slog"
	"net/http"

	"github.com/gorilla/mux"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"
)

// NewRegistry returns the exporter's registry: the snapshot collector plus
// build info, Go and process collectors.
func NewRegistry(loop Source, logger *slog.Logger) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		NewCollector(loop, logger),
		versioncollector.NewCollector("gpu_orphan_exporter"),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return reg
}

// NewHandler serves metrics at telemetryPath, /-/healthy and a landing page.
func NewHandler(reg *prometheus.Registry, telemetryPath string, logger *slog.Logger) (http.Handler, error) {
	r := mux.NewRouter()
	r.Handle(telemetryPath, promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:            slog.NewLogLogger(logger.Handler(), slog.LevelError),
		MaxRequestsInFlight: 40,
		Registry:            reg,
	}))
	r.HandleFunc("/-/healthy", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "Healthy")
	})
	if telemetryPath != "/" {
		landing, err := web.NewLandingPage(web.LandingConfig{
			Name:        "GPU Orphan Exporter",
			Description: "GPU memory that no live process owns, and the processes that hold it.",
			Version:     version.Info(),
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
