package cmd

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestExitCodes: every binary follows the README's "Exit codes": 2 for bad
// input (an unknown flag, with the flag it is close to; a value a flag does
// not take, named; a missing command, a required flag, flags that do not
// go together), 1 for a failure at run time, each with a plain last line
// on stderr that says what is wrong, after the binary's name (the Slurm
// hooks': "gpu-orphan epilog: "). Each case
// runs the real binary, with none of Slurm's variables in its environment.
func TestExitCodes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	none := filepath.Join(dir, "none") // exists nowhere
	targets := filepath.Join(dir, "targets.json")
	if err := os.WriteFile(targets, []byte(`{"gpu-a": "http://127.0.0.1:1"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	store := func(name string) string { return "--store.path=" + filepath.Join(dir, name) }
	const usage, failure = 2, 1
	for _, tc := range []struct {
		bin  string
		args []string
		code int
		says string
	}{
		// gpu-orphan and its commands.
		{"gpu-orphan", nil, usage, "no command: want one of ps, clean, report, prolog, epilog"},
		{"gpu-orphan", []string{"--backend=sim"}, usage, "no command"},
		{"gpu-orphan", []string{"top"}, usage, `expected command but got "top"`},
		{"gpu-orphan", []string{"ps", "--exporter-url=x"}, usage, "did you mean --exporter.url?"},
		{"gpu-orphan", []string{"--backend=cuda", "ps"}, usage, `invalid --backend "cuda": want one of nvml, sim`},
		{"gpu-orphan", []string{"--backend=sim", "--sim.root=" + none, "ps"}, failure, "holds no simulated node"},
		{"gpu-orphan", []string{"clean"}, usage, "required flag(s) '--gpu' not provided"},
		{"gpu-orphan", []string{"clean", "--gpu=0", "--grace=soon"}, usage, `invalid --grace "soon"`},
		{"gpu-orphan", []string{"--backend=sim", "--sim.root=" + none, "clean", "--gpu=0"}, failure, "holds no simulated node"},
		{"gpu-orphan", []string{"report", "--since=soon"}, usage, `invalid --since "soon"`},
		{"gpu-orphan", []string{"report", "--url=http://127.0.0.1:1", store("r.db")}, usage, "give --store.path or --url, not both"},
		{"gpu-orphan", []string{"report", "--bye=user"}, usage, "did you mean --by?"},
		{"gpu-orphan", []string{"report", store("none.db")}, failure, "no audit database"},
		{"gpu-orphan", []string{"prolog", "--timout=5s"}, usage, "did you mean --timeout?"},
		{"gpu-orphan", []string{"epilog", "--grace=soon"}, usage, `invalid --grace "soon"`},
		{"gpu-orphan", []string{"epilog"}, usage, "no job: SLURM_JOB_ID is not set"},
		// The daemons.
		{"gpu-orphan-exporter", []string{"--web.listen-adress=:0"}, usage, "did you mean --web.listen-address?"},
		{"gpu-orphan-exporter", []string{"--collector.interval=0s"}, usage, "invalid --collector.interval 0s"},
		{"gpu-orphan-exporter", []string{"--scan.unowned-bytes=lots"}, usage, `invalid --scan.unowned-bytes "lots"`},
		{"gpu-orphan-exporter", []string{"--backend=sim", "--sim.root=" + none, "--web.listen-address=127.0.0.1:0"}, failure, "holds no simulated node"},
		{"gpu-orphan-remediator", []string{"--remediate.polcy=orphaned"}, usage, "did you mean --remediate.policy?"},
		{"gpu-orphan-remediator", []string{"--remediate.grace=soon"}, usage, `invalid --remediate.grace "soon"`},
		{"gpu-orphan-remediator", []string{store("r.db")}, usage, "authentication is required"},
		{"gpu-orphan-remediator", []string{"--auth.token-file=" + none, store("r.db"), "--web.listen-address=127.0.0.1:0"}, failure, none},
		{"gpu-orphan-dispatcher", []string{"--dispatch.target-file=x"}, usage, "did you mean --dispatch.targets-file?"},
		{"gpu-orphan-dispatcher", []string{"--dispatch.max-fraction=half"}, usage, `invalid --dispatch.max-fraction "half"`},
		{"gpu-orphan-dispatcher", []string{"--auth.insecure-none", store("d.db")}, usage, "the dispatcher needs an allow-list of its agents"},
		{"gpu-orphan-dispatcher", []string{"--auth.token-file=" + none, "--dispatch.targets-file=" + targets, store("d.db"),
			"--web.listen-address=127.0.0.1:0"}, failure, none},
		// The simulated node and the demo.
		{"gpu-orphan-sim", nil, usage, "no command: want one of init, run, launch, mps, status"},
		{"gpu-orphan-sim", []string{"status", "--rot=" + none}, usage, "did you mean --root?"},
		{"gpu-orphan-sim", []string{"run", "--root=" + none, "--gpu=one", "--mib=1"}, usage, `invalid --gpu "one"`},
		{"gpu-orphan-sim", []string{"status", "--root=" + none}, failure, "holds no simulated node"},
		{"gpu-orphan-demo", []string{"--sim-gpu=1"}, usage, "did you mean --sim.gpu?"},
		{"gpu-orphan-demo", []string{"--backend=cuda"}, usage, `invalid --backend "cuda": want one of sim, nvml`},
		{"gpu-orphan-demo", []string{"--run.timeout=soon"}, usage, `invalid --run.timeout "soon"`},
	} {
		name := strings.Join(append([]string{tc.bin}, tc.args...), " ")
		t.Run(name, func(t *testing.T) {
			cmd := exec.Command(testenv.Bin(t, tc.bin), tc.args...)
			for _, kv := range os.Environ() {
				if !strings.HasPrefix(kv, "SLURM") && !strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") && !strings.HasPrefix(kv, "GPU_DEVICE_ORDINAL=") {
					cmd.Env = append(cmd.Env, kv)
				}
			}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			code := testenv.ExitCode(t, cmd.Run())
			lines := strings.Split(strings.TrimRight(stderr.String(), "\n"), "\n")
			last := lines[len(lines)-1]
			named := strings.HasPrefix(last, tc.bin+": ") || strings.HasPrefix(last, tc.bin+" epilog: ") || strings.HasPrefix(last, tc.bin+" prolog: ")
			if code != tc.code || !named || !strings.Contains(last, tc.says) {
				t.Errorf("exit %d, stderr's last line %q; want exit %d and a line %q that says %q\nstderr:\n%s",
					code, last, tc.code, tc.bin+": ...", tc.says, stderr.String())
			}
			if tc.code == usage && stdout.Len() > 0 {
				t.Errorf("bad input printed on stdout:\n%s", stdout.String())
			}
		})
	}
}
