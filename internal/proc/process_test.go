package proc

import (
	"errors"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

func TestProcessFixture(t *testing.T) {
	fs := newFixture(t)
	tests := []struct {
		pid  int
		want Process
	}{
		{1, Process{PID: 1, PPID: 0, PGID: 1, SID: 1, State: "S", StartTime: 2, UID: 0, User: "root",
			Comm: "systemd", Cmdline: "/sbin/init splash", Cgroup: "/init.scope", NSpid: []int{1}}},
		{100, Process{PID: 100, PPID: 90, PGID: 100, SID: 100, State: "S", StartTime: 500000, UID: 0, User: "root",
			Comm: "python3", Cmdline: "python3 train.py --epochs 10",
			Cgroup:    "/system.slice/docker-" + fixDocker + ".scope",
			Container: fixDocker, NSpid: []int{100, 1}}},
		{200, Process{PID: 200, PPID: 1, PGID: 200, SID: 200, State: "S", StartTime: 600000, UID: 3999999, User: "3999999",
			Comm: "trainer", Cmdline: "/usr/bin/trainer",
			Cgroup:    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-" + fixContainerd + ".scope",
			Container: fixContainerd, Pod: fixPod1, NSpid: []int{200, 7}}},
		{300, Process{PID: 300, PPID: 1, PGID: 300, SID: 300, State: "R", StartTime: 700000, UID: 0, User: "root",
			Comm: "vllm", Cmdline: "python3 -m vllm.entrypoints.openai.api_server",
			Cgroup:    "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod6d0f0a87_5d0d_4c31_a2f6_4d8e52c2a1b9.slice/crio-" + fixCRIO + ".scope",
			Container: fixCRIO, Pod: fixPod2, NSpid: []int{300, 1}}},
		{400, Process{PID: 400, PPID: 399, PGID: 399, SID: 399, State: "S", StartTime: 800, UID: 0, User: "root",
			Comm: "(sd-pam)", Cmdline: "(sd-pam)", Cgroup: "/user.slice/user-1000.slice/user@1000.service/init.scope", NSpid: []int{400}}},
		{500, Process{PID: 500, PPID: 1, PGID: 500, SID: 500, State: "S", StartTime: 900000, UID: 0, User: "root",
			Comm: "a b) c", Cmdline: "/app/worker --gpu 0",
			Cgroup:    "/kubepods/burstable/pod" + fixStaticPod + "/" + fixCgroupfs,
			Container: fixCgroupfs, Pod: fixStaticPod, NSpid: []int{500, 1}}},
		{600, Process{PID: 600, PPID: 100, PGID: 100, SID: 100, State: "Z", StartTime: 500100, UID: 0, User: "root",
			Comm: "python3", Cgroup: "/system.slice/docker-" + fixDocker + ".scope",
			Container: fixDocker, NSpid: []int{600, 3}}},
	}
	for _, tt := range tests {
		t.Run(strconv.Itoa(tt.pid), func(t *testing.T) {
			got, err := fs.Process(tt.pid)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Process(%d) =\n%+v\nwant\n%+v", tt.pid, got, tt.want)
			}
			_, alive := fs.Alive(tt.pid)
			if alive != !tt.want.Zombie() {
				t.Errorf("Alive(%d) = %v, want %v", tt.pid, alive, !tt.want.Zombie())
			}
		})
	}
}

func TestProcessFixtureGone(t *testing.T) {
	fs := newFixture(t)
	// 700 has a stat but no status: it exited between the two reads.
	for _, pid := range []int{700, 999, 0, -1} {
		p, err := fs.Process(pid)
		if !errors.Is(err, ErrNotExist) || !errors.Is(err, iofs.ErrNotExist) {
			t.Errorf("Process(%d) = %+v, %v; want ErrNotExist", pid, p, err)
		}
		if _, alive := fs.Alive(pid); alive {
			t.Errorf("Alive(%d) = true for a process that is gone", pid)
		}
	}
}

// statLine is a /proc/PID/stat line of kernel 6.18 (52 fields).
func statLine(comm, state string) string {
	return "42 (" + comm + ") " + state + " 7 8 9 0 -1 4194560 1811 0 12 0 130 47 0 0 20 0 1 0 123456789 3133440 409 " +
		"18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
}

func TestProcessStat(t *testing.T) {
	tests := []struct {
		name, stat  string
		comm, state string
		wantErr     bool
	}{
		{name: "plain", stat: statLine("sleep", "S"), comm: "sleep", state: "S"},
		{name: "spaces", stat: statLine("my prog", "R"), comm: "my prog", state: "R"},
		{name: "parentheses", stat: statLine("(sd-pam)", "S"), comm: "(sd-pam)", state: "S"},
		{name: "closing parenthesis", stat: statLine("a b) c", "S"), comm: "a b) c", state: "S"},
		{name: "looks like fields", stat: statLine(") Z 1 2 3", "D"), comm: ") Z 1 2 3", state: "D"},
		{name: "newline", stat: statLine("a\nb", "S"), comm: "a\nb", state: "S"},
		{name: "invalid utf-8", stat: statLine("gpu\xff\xfe", "S"), comm: "gpu\uFFFD", state: "S"},
		{name: "zombie", stat: statLine("python3", "Z"), comm: "python3", state: "Z"},
		{name: "dead", stat: statLine("python3", "X"), comm: "python3", state: "X"},
		{name: "no parentheses", stat: "42 sleep S 7 8 9\n", wantErr: true},
		{name: "truncated", stat: "42 (sleep) S 7 8\n", wantErr: true},
		{name: "not numbers", stat: strings.Replace(statLine("sleep", "S"), " 7 8 9 ", " x y z ", 1), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := statFixture(t, tt.stat)
			p, err := fs.Process(42)
			if tt.wantErr {
				if err == nil || errors.Is(err, ErrNotExist) {
					t.Fatalf("Process = %+v, %v; want a parse error", p, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.Comm != tt.comm || p.State != tt.state || p.PPID != 7 || p.PGID != 8 || p.SID != 9 || p.StartTime != 123456789 {
				t.Errorf("Process = %+v", p)
			}
		})
	}
}

// statFixture is a procfs holding PID 42 with the given stat.
func statFixture(t *testing.T, stat string) FS {
	t.Helper()
	root := t.TempDir()
	dir := filepath.Join(root, "42")
	if err := os.CopyFS(dir, os.DirFS("testdata/proc/1")); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string]string{"stat": stat, "cmdline": "x\x00"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fs, err := NewFS(root)
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

func TestFormatCmdline(t *testing.T) {
	long := strings.Repeat("a", maxCmdline-1) + "é" // é straddles the cap
	tests := []struct{ in, want string }{
		{"", ""},
		{"\x00", ""},
		{"sleep\x003600\x00", "sleep 3600"},
		{"\x00\x00python\x00", "python"},
		{"nginx: worker process", "nginx: worker process"}, // rewritten argv, no NULs
		{"a\xffb\x00", "a\uFFFDb"},
		{long, strings.Repeat("a", maxCmdline-1)},
		{strings.Repeat("ab\x00", 200), strings.Repeat("ab ", maxCmdline/3) + "a"},
	}
	for _, tt := range tests {
		if got := formatCmdline([]byte(tt.in)); got != tt.want {
			t.Errorf("formatCmdline(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func FuzzFormatCmdline(f *testing.F) {
	for _, s := range []string{"", "sleep\x003600\x00", "\x00\x00a", strings.Repeat("é\x00", 200), "\xff\xfe"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		s := formatCmdline(b)
		if len(s) > maxCmdline || strings.ContainsRune(s, 0) || !utf8.ValidString(s) || strings.TrimSpace(s) != s {
			t.Errorf("formatCmdline(%q) = %q", b, s)
		}
	})
}

func TestProcessSelf(t *testing.T) {
	fs, err := NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	p, err := fs.Process(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if p.PID != os.Getpid() || p.PPID != os.Getppid() || p.UID != os.Geteuid() || p.StartTime == 0 {
		t.Errorf("Process(self) = %+v", p)
	}
	if pgid, _ := syscall.Getpgid(0); p.PGID != pgid {
		t.Errorf("PGID = %d, want %d", p.PGID, pgid)
	}
	if exe := filepath.Base(os.Args[0]); !strings.HasPrefix(exe, p.Comm) || !strings.Contains(p.Cmdline, exe) {
		t.Errorf("Comm %q, Cmdline %q; want them to name %q", p.Comm, p.Cmdline, exe)
	}
	if len(p.NSpid) == 0 || p.NSpid[len(p.NSpid)-1] != os.Getpid() {
		t.Errorf("NSpid = %v, want it to end with %d", p.NSpid, os.Getpid())
	}
	if p.Cgroup == "" || p.User == "" {
		t.Errorf("Cgroup %q, User %q; want both", p.Cgroup, p.User)
	}
	if _, alive := fs.Alive(os.Getpid()); !alive {
		t.Error("Alive(self) = false")
	}
}

func TestProcessExited(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid // reaped: gone (unless reused within the test)
	if _, err := fs.Process(pid); !errors.Is(err, ErrNotExist) {
		t.Errorf("Process(exited %d) err = %v, want ErrNotExist", pid, err)
	}
	if _, alive := fs.Alive(pid); alive {
		t.Errorf("Alive(exited %d) = true", pid)
	}
}

func TestProcessZombie(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()

	// Not reaped yet: a zombie once the kill has landed.
	var p Process
	for deadline := time.Now().Add(slowness.Scale(10*time.Second, slowness.Factor())); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if p, err = fs.Process(pid); err != nil || p.Zombie() {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	if !p.Zombie() || p.Comm != "sleep" || p.Cmdline != "" {
		t.Errorf("Process(killed, unreaped) = %+v; want a zombie sleep without argv", p)
	}
	if _, alive := fs.Alive(pid); alive {
		t.Error("Alive(zombie) = true")
	}
}

func BenchmarkProcessFixture(b *testing.B) {
	fs := newFixture(b)
	for b.Loop() {
		if _, err := fs.Process(200); err != nil {
			b.Fatal(err)
		}
	}
}
