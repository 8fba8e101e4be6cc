package exporter_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/exporter"
)

// TestLandingPageLinks: every link of the landing page to the exporter
// itself answers; its pprof links were 404s.
func TestLandingPageLinks(t *testing.T) {
	h, err := exporter.NewHandler(prometheus.NewRegistry(), "/metrics", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	links := regexp.MustCompile(`href="(/[^"]*)"`).FindAllStringSubmatch(string(body), -1)
	if len(links) < 2 || strings.Contains(string(body), "debug/pprof") {
		t.Fatalf("landing page links %v, want /metrics and /-/healthy and no pprof:\n%s", links, body)
	}
	for _, l := range links {
		resp, err := http.Get(srv.URL + l[1])
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("the landing page's link %s: %d", l[1], resp.StatusCode)
		}
	}
}
