package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The ports that gpu-orphan must not take by default: the exporters GPU
// operators run beside it, and the Prometheus stack. 9100-9999 is the range
// of Prometheus's default-port-allocations page, fully allocated since 2023.
var takenPorts = map[int]string{
	9835: "nvidia_gpu_exporter",
	9400: "dcgm-exporter",
	9100: "node_exporter",
	9090: "Prometheus",
	9093: "Alertmanager",
	9094: "Alertmanager cluster",
	3000: "Grafana",
	8080: "cAdvisor",
}

// oldPorts were gpu-orphan's defaults before 0.x; no deployment file may
// still use them (CHANGELOG says what changed).
var oldPorts = regexp.MustCompile(`\b983[56]\b`)

var listenDefault = regexp.MustCompile(`AddFlags\(\w+, ":(\d+)"\)`)

// defaultPort reads the --web.listen-address default from a binary's main.
func defaultPort(t *testing.T, binary string) int {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("..", "..", "cmd", binary, "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	m := listenDefault.FindSubmatch(src)
	if m == nil {
		t.Fatalf("%s: no kingpinflag.AddFlags default in main.go", binary)
	}
	port, _ := strconv.Atoi(string(m[1]))
	return port
}

func TestDefaultPortsFitTheEcosystem(t *testing.T) {
	exporter, remediator := defaultPort(t, "gpu-orphan-exporter"), defaultPort(t, "gpu-orphan-remediator")
	if exporter == remediator {
		t.Fatalf("the exporter and the remediator both default to %d", exporter)
	}
	for _, p := range []int{exporter, remediator} {
		if who, ok := takenPorts[p]; ok {
			t.Errorf("default port %d is %s's", p, who)
		}
		if p >= 9100 && p <= 9999 {
			t.Errorf("default port %d lies in 9100-9999, allocated to other exporters", p)
		}
	}
}

// Every deployment file names the binaries' default ports, and none names
// the old ones.
func TestDeploymentFilesUseTheDefaultPorts(t *testing.T) {
	exporter, remediator := defaultPort(t, "gpu-orphan-exporter"), defaultPort(t, "gpu-orphan-remediator")
	root := filepath.Join("..", "..")
	files := []string{"docker-compose.yml", "README.md", "deploy/README.md", "docs/runbook.md", "docs/metrics.md"}
	for _, dir := range []string{"deploy", "charts"} {
		_ = filepath.WalkDir(filepath.Join(root, dir), func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				rel, _ := filepath.Rel(root, path)
				files = append(files, rel)
			}
			return nil
		})
	}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		if loc := oldPorts.FindIndex(b); loc != nil {
			line := strings.Count(string(b[:loc[0]]), "\n") + 1
			t.Errorf("%s:%d names the old port %s", f, line, b[loc[0]:loc[1]])
		}
	}

	want := map[string][]string{
		"deploy/systemd/gpu-orphan-exporter.default":   {"--web.listen-address=:" + strconv.Itoa(exporter)},
		"deploy/systemd/gpu-orphan-remediator.default": {"--web.listen-address=:" + strconv.Itoa(remediator)},
		"deploy/docker/Dockerfile":                     {"EXPOSE " + strconv.Itoa(exporter) + " " + strconv.Itoa(remediator)},
		"deploy/compose/prometheus.yml":                {"exporter:" + strconv.Itoa(exporter), "remediator:" + strconv.Itoa(remediator)},
		"deploy/compose/alertmanager.yml":              {"remediator:" + strconv.Itoa(remediator) + "/api/v1/alerts"},
		"docker-compose.yml": {
			"127.0.0.1:" + strconv.Itoa(exporter) + ":" + strconv.Itoa(exporter),
			"127.0.0.1:" + strconv.Itoa(remediator) + ":" + strconv.Itoa(remediator),
		},
	}
	for f, needles := range want {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		for _, n := range needles {
			if !strings.Contains(string(b), n) {
				t.Errorf("%s does not contain %q", f, n)
			}
		}
	}
}
