package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// fakeApt is apt-get for scripts/deps.sh: it records its arguments, prints
// apt's lines for what it installs, and puts promtool and Alertmanager on
// PATH as the packages would.
const fakeApt = `#!/bin/bash
echo "$*" >> "$APT_LOG"
[ "$1" = install ] || exit 0
echo "Reading package lists..."
echo "Need to get 42.0 MB of archives."
for p in "$@"; do
  case $p in -*|install) continue ;; esac
  echo "Unpacking $p (1.0) ..."
  echo "Setting up $p (1.0) ..."
done
printf '#!/bin/sh\n' > "$(dirname "$0")/promtool"
printf '#!/bin/sh\n' > "$(dirname "$0")/prometheus-alertmanager"
chmod +x "$(dirname "$0")/promtool" "$(dirname "$0")/prometheus-alertmanager"
`

// runDeps runs scripts/deps.sh PURPOSE on a PATH that has none of the
// packages, and returns its output and apt-get's install line.
func runDeps(t *testing.T, purpose string) (output, install string) {
	t.Helper()
	bin := t.TempDir()
	for _, tool := range []string{"bash", "awk", "id", "dirname", "chmod"} {
		path, err := exec.LookPath(tool)
		if err != nil {
			t.Skipf("%s not found: %v", tool, err)
		}
		if err := os.Symlink(path, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(bin, "apt-get"), []byte(fakeApt), 0o755); err != nil {
		t.Fatal(err)
	}
	// sudo when not root, which then runs the fake apt-get.
	if err := os.WriteFile(filepath.Join(bin, "sudo"), []byte("#!/bin/bash\nexec \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(t.TempDir(), "apt.log")
	cmd := exec.Command(filepath.Join(bin, "bash"), "../../scripts/deps.sh", purpose)
	cmd.Env = []string{
		"PATH=" + bin,
		"APT_LOG=" + log,
		// An existing file: the script leaves the system's policy-rc.d alone.
		"GPU_ORPHAN_POLICY_RC_D=" + log,
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("deps.sh %s: %v\n%s", purpose, err, out)
	}
	calls, err := os.ReadFile(log)
	if err != nil {
		t.Fatalf("apt-get never ran: %v\n%s", err, out)
	}
	for _, line := range strings.Split(string(calls), "\n") {
		if strings.HasPrefix(line, "install ") {
			install = line
		}
	}
	return string(out), install
}

// Issue 23, paper cut 1: `make run` installs only what it uses, and both
// say what they install while apt-get runs.
func TestDepsInstallPerTarget(t *testing.T) {
	out, install := runDeps(t, "run")
	pkgs := strings.Fields(install)
	for _, want := range []string{"prometheus", "prometheus-alertmanager"} {
		if !strings.Contains(" "+install+" ", " "+want+" ") {
			t.Errorf("make run's install line lacks %s: %q", want, install)
		}
	}
	for _, unused := range []string{"chromium", "slurmctld", "slurmd", "slurm-client", "munge", "psmisc"} {
		if slices.Contains(pkgs, unused) {
			t.Errorf("make run installs %s, which it does not use: %q", unused, install)
		}
	}
	for _, want := range []string{
		"deps: installing prometheus prometheus-alertmanager",
		"deps: downloading 42.0 MB",
		"deps: set up prometheus\n",
		"deps: set up prometheus-alertmanager\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}

	out, install = runDeps(t, "test")
	for _, want := range []string{"prometheus", "chromium", "slurmctld", "slurmd", "slurm-client", "munge", "psmisc"} {
		if !strings.Contains(" "+install+" ", " "+want+" ") {
			t.Errorf("make test's install line lacks %s: %q", want, install)
		}
		if !strings.Contains(out, "deps: set up "+want+"\n") {
			t.Errorf("output does not name %s as it is set up:\n%s", want, out)
		}
	}
}

// The Makefile's run and oldest targets take the run set, test the whole.
func TestMakefileDepsPerTarget(t *testing.T) {
	data, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	prereqs := func(target string) []string {
		m := regexp.MustCompile(`(?m)^` + target + `:([^\n=]*)$`).FindStringSubmatch(string(data))
		if m == nil {
			t.Fatalf("no %s target in the Makefile", target)
		}
		return strings.Fields(m[1])
	}
	for _, target := range []string{"run", "oldest"} {
		p := prereqs(target)
		if slices.Contains(p, "deps") || !slices.Contains(p, "deps-run") {
			t.Errorf("make %s depends on %v; want deps-run (Prometheus and Alertmanager only), not deps", target, p)
		}
	}
	if !slices.Contains(prereqs("test"), "deps") {
		t.Error("make test does not depend on deps")
	}
	if !regexp.MustCompile(`(?m)^deps-run:\n\t@\./scripts/deps\.sh run$`).Match(data) {
		t.Error("deps-run does not run scripts/deps.sh run")
	}
}
