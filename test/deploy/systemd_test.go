package deploy

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

const systemdDir = "../../deploy/systemd"

// unitFile is a systemd unit as key → values, continuation lines joined.
type unitFile map[string][]string

func parseUnit(path string) (unitFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	u := unitFile{}
	section, pending := "", ""
	s := bufio.NewScanner(f)
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if pending != "" {
			line = pending + " " + line
			pending = ""
		}
		if l, ok := strings.CutSuffix(line, "\\"); ok {
			pending = strings.TrimSpace(l)
			continue
		}
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			section = strings.Trim(line, "[]")
		default:
			k, v, _ := strings.Cut(line, "=")
			key := section + "." + strings.TrimSpace(k)
			u[key] = append(u[key], strings.TrimSpace(v))
		}
	}
	return u, s.Err()
}

// last returns the value in force: the last assignment.
func (u unitFile) last(key string) string {
	if v := u[key]; len(v) > 0 {
		return v[len(v)-1]
	}
	return ""
}

var argsVar = regexp.MustCompile(`^([A-Z_]+)="(.*)"$`)

func TestSystemdUnits(t *testing.T) {
	flags := flagChecker{}
	for _, tc := range []struct {
		binary string
		caps   []string
	}{
		{"gpu-orphan-exporter", []string{"CAP_DAC_READ_SEARCH", "CAP_NET_ADMIN", "CAP_SYS_PTRACE"}},
		{"gpu-orphan-remediator", []string{"CAP_DAC_READ_SEARCH", "CAP_KILL", "CAP_NET_ADMIN", "CAP_SYS_PTRACE"}},
	} {
		t.Run(tc.binary, func(t *testing.T) {
			u, err := parseUnit(filepath.Join(systemdDir, tc.binary+".service"))
			if err != nil {
				t.Fatal(err)
			}
			caps := strings.Fields(u.last("Service.CapabilityBoundingSet"))
			slices.Sort(caps)
			if !slices.Equal(caps, tc.caps) {
				t.Errorf("CapabilityBoundingSet %v, want %v", caps, tc.caps)
			}
			for key, want := range map[string]string{
				"Service.NoNewPrivileges": "yes",
				"Service.ProtectSystem":   "strict",
				"Service.ProtectHome":     "read-only",
				// Hiding other users' processes would hide the holders.
				"Service.ProtectProc": "default",
				"Service.ProcSubset":  "all",
			} {
				if got := u.last(key); got != want {
					t.Errorf("%s=%q, want %q", key, got, want)
				}
			}
			for _, key := range []string{"Service.PrivateUsers", "Service.PrivateDevices", "Service.DynamicUser", "Service.User"} {
				if v := u.last(key); v != "" && v != "no" && v != "root" {
					t.Errorf("%s=%s: it would take away the capabilities or the GPUs", key, v)
				}
			}
			envFile := u.last("Service.EnvironmentFile")
			if envFile == "" {
				t.Fatal("no EnvironmentFile")
			}
			// The shipped defaults file is the one the unit reads.
			defaults := filepath.Join(systemdDir, tc.binary+".default")
			if filepath.Base(strings.TrimPrefix(envFile, "-")) != tc.binary {
				t.Errorf("EnvironmentFile=%s, want /etc/default/%s (shipped as %s)", envFile, tc.binary, defaults)
			}
			env := map[string][]string{}
			data, err := os.ReadFile(defaults)
			if err != nil {
				t.Fatal(err)
			}
			for _, line := range strings.Split(string(data), "\n") {
				if m := argsVar.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
					env[m[1]] = strings.Fields(m[2])
				}
			}
			var argv []string
			for _, f := range strings.Fields(u.last("Service.ExecStart")) {
				if v, ok := strings.CutPrefix(f, "$"); ok {
					if _, ok := env[v]; !ok {
						t.Errorf("ExecStart uses $%s, which %s does not set", v, defaults)
					}
					argv = append(argv, env[v]...)
					continue
				}
				argv = append(argv, f)
			}
			if len(argv) == 0 || filepath.Base(argv[0]) != tc.binary {
				t.Fatalf("ExecStart runs %v, want %s", argv, tc.binary)
			}
			flags.check(t, "ExecStart", argv)
			if slices.Contains(argv, "--act") {
				t.Error("--act is on; the shipped unit must be a dry run")
			}
			if tc.binary == "gpu-orphan-remediator" {
				store, _ := flagValue(argv, "store.path")
				dir := u.last("Service.StateDirectory")
				if dir == "" || !strings.HasPrefix(store, "/var/lib/"+dir+"/") {
					t.Errorf("--store.path=%s is not in StateDirectory=%s, the only writable place", store, dir)
				}
				if tf, _ := flagValue(argv, "auth.token-file"); tf == "" {
					t.Error("no --auth.token-file")
				}
			}
		})
	}
}

// TestSystemdAnalyzeVerify runs systemd-analyze verify on the units, with
// ExecStart pointed at a binary that exists here.
func TestSystemdAnalyzeVerify(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed")
	}
	units, _ := filepath.Glob(filepath.Join(systemdDir, "*.service"))
	if len(units) == 0 {
		t.Fatal("no units")
	}
	trueBin, err := exec.LookPath("true")
	if err != nil {
		t.Skip("no true(1)")
	}
	dir := t.TempDir()
	var args []string
	for _, unit := range units {
		data, err := os.ReadFile(unit)
		if err != nil {
			t.Fatal(err)
		}
		data = regexp.MustCompile(`/usr/local/bin/gpu-orphan-[a-z]+`).ReplaceAll(data, []byte(trueBin))
		out := filepath.Join(dir, filepath.Base(unit))
		if err := os.WriteFile(out, data, 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, sa, append([]string{"verify", "--man=no", "--generators=no"}, args...)...)
	out, err := cmd.CombinedOutput()
	// verify only warns about unknown keys: any output is a failure.
	if err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
