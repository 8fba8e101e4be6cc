package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The receivers gpu-orphan ships, and the README table that says which
// Alertmanager each of their options needs.
const (
	receiversDoc      = "../../deploy/README.md"
	composeReceiver   = "../../deploy/compose/alertmanager.yml"
	stackReceiverTmpl = "../../internal/stack/alertmanager.yml.tmpl"
)

// A row of the table: | `option` ... | any or 0.NN | ... |
var versionRow = regexp.MustCompile("^\\| `([a-z_.]+)[^`]*`[^|]*\\| \\**(any|0\\.\\d+)\\** \\|")

func receiverVersions(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(receiversDoc)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if m := versionRow.FindStringSubmatch(line); m != nil {
			out[m[1]] = m[2]
		}
	}
	if len(out) == 0 {
		t.Fatalf("%s: no receiver option table", receiversDoc)
	}
	return out
}

// webhookOptions lists the options each webhook_configs entry of an
// Alertmanager configuration sets; http_config counts by its first key
// below it (http_config.authorization).
func webhookOptions(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// internal/stack fills @NAME@ placeholders.
	b = regexp.MustCompile(`@[A-Z_]+@`).ReplaceAll(b, []byte("placeholder"))
	var cfg struct {
		Receivers []struct {
			WebhookConfigs []map[string]any `json:"webhook_configs"`
		} `json:"receivers"`
	}
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var opts []string
	for _, r := range cfg.Receivers {
		for _, w := range r.WebhookConfigs {
			for k, v := range w {
				if sub, ok := v.(map[string]any); ok && k == "http_config" {
					for k2 := range sub {
						opts = append(opts, k+"."+k2)
					}
					continue
				}
				opts = append(opts, k)
			}
		}
	}
	if len(opts) == 0 {
		t.Fatalf("%s: no webhook_configs", path)
	}
	return opts
}

func TestReceiverOptionsHaveAVersion(t *testing.T) {
	versions := receiverVersions(t)
	if versions["timeout"] != "0.28" {
		t.Errorf("the table says timeout needs %q; it came with Alertmanager 0.28", versions["timeout"])
	}
	for _, f := range []string{composeReceiver, stackReceiverTmpl} {
		for _, opt := range webhookOptions(t, f) {
			if _, ok := versions[opt]; !ok {
				t.Errorf("%s sets webhook option %s, which %s's version table does not list", f, opt, receiversDoc)
			}
		}
	}
}

// minor returns 25 for "amtool, version 0.25.0 (...)".
func amtoolMinor(t *testing.T, amtool string) int {
	out, err := exec.Command(amtool, "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("amtool --version: %v: %s", err, out)
	}
	m := regexp.MustCompile(`version 0\.(\d+)\.`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("amtool --version: cannot read %q", out)
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}

// The table's claim, checked against the Alertmanager the tests install:
// an older amtool rejects each option the table says is newer, and accepts
// the configuration once those options are gone.
func TestReceiverOptionsAgainstInstalledAlertmanager(t *testing.T) {
	amtool, err := exec.LookPath("amtool")
	if err != nil {
		if os.Getenv("GPU_ORPHAN_E2E_REQUIRED") != "" {
			t.Fatal("amtool not found; scripts/deps.sh installs prometheus-alertmanager")
		}
		t.Skip("amtool not found (Debian's prometheus-alertmanager)")
	}
	installed := amtoolMinor(t, amtool)
	versions := receiverVersions(t)
	src, err := os.ReadFile(composeReceiver)
	if err != nil {
		t.Fatal(err)
	}
	check := func(name, cfg string) error {
		path := filepath.Join(t.TempDir(), name)
		if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(amtool, "check-config", path).CombinedOutput()
		if err != nil {
			t.Logf("amtool check-config %s: %s", name, out)
		}
		return err
	}
	var kept []string
	for _, line := range strings.Split(string(src), "\n") {
		key, _, _ := strings.Cut(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(line), "- ")), ":")
		if v, ok := versions[key]; ok && v != "any" {
			if n, _ := strconv.Atoi(strings.TrimPrefix(v, "0.")); n > installed {
				if check(key+".yml", string(src)) == nil {
					t.Errorf("Alertmanager 0.%d accepts %s, which the table says needs %s", installed, composeReceiver, v)
				}
				continue
			}
		}
		kept = append(kept, line)
	}
	if err := check("kept.yml", strings.Join(kept, "\n")); err != nil {
		t.Errorf("Alertmanager 0.%d rejects %s without the options newer than it: %v", installed, composeReceiver, err)
	}
}
