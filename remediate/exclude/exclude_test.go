package exclude

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

var self = Self{PID: 9000, PGID: 9000, SID: 8999}

// pr builds a live process of a job started from session 50, whose
// executable is unknown (as /proc says for another user's process when the
// reader lacks CAP_SYS_PTRACE).
func pr(pid, ppid, pgid int, comm string) proc.Process {
	return proc.Process{
		PID: pid, PPID: ppid, PGID: pgid, SID: 50, State: "S",
		StartTime: uint64(100000 + pid), UID: 1000, User: "alice",
		Comm: comm, Cmdline: comm + " --job", Cgroup: "/user.slice",
	}
}

// running is pr(201, ...) named comm, running exe.
func running(comm string, exe proc.Exe) proc.Process {
	p := pr(201, 1, 100, comm)
	p.Exe = exe
	return p
}

// rootExe is a system binary at path: root's, mode 0755.
func rootExe(path string) proc.Exe {
	return proc.Exe{Path: path, File: fakeID(path), UID: 0, Mode: unix.S_IFREG | 0o755}
}

// owned is e owned by uid with permissions perm.
func owned(e proc.Exe, uid int, perm uint32) proc.Exe {
	e.UID, e.Mode = uid, unix.S_IFREG|perm
	return e
}

// fakeID gives each fixture path a file identity of its own, on a device
// no real file is on.
func fakeID(path string) proc.FileID {
	var h uint64 = 14695981039346656037
	for _, c := range []byte(path) {
		h = (h ^ uint64(c)) * 1099511628211
	}
	return proc.FileID{Dev: 1<<63 | 7, Ino: h | 1}
}

func fileID(t *testing.T, path string) proc.FileID {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return proc.FileID{Dev: st.Dev, Ino: st.Ino}
}

func TestRules(t *testing.T) {
	// A daemon protected by its path, installed (writable by all: its
	// identity is what counts) behind a symlink.
	dir := t.TempDir()
	daemon := filepath.Join(dir, "opt", "daemon-1.2")
	if err := os.MkdirAll(filepath.Dir(daemon), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(daemon, []byte("#!/bin/true\n"), 0o777); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "mydaemon")
	if err := os.Symlink(daemon, link); err != nil {
		t.Fatal(err)
	}
	daemonExe := proc.Exe{Path: daemon, File: fileID(t, daemon), UID: 1000, Mode: unix.S_IFREG | 0o777}
	hardLinked := daemonExe
	hardLinked.Path = filepath.Join(dir, "worker")

	rules := Rules{Self: self, Protected: []string{"sshd*", "nvidia-persistenced", "nv-fabricmanager", "systemd*", "my-long-daemon-",
		link, filepath.Join(dir, "missing")}}.WithDefaults()
	selfUID := rules
	selfUID.Self.UID = 1234
	for _, tc := range []struct {
		name  string
		rules Rules
		p     proc.Process
		want  remediate.ExclusionReason
	}{
		{"ordinary", rules, running("python3", rootExe("/usr/bin/python3.11")), ""},
		{"pid 1", rules, proc.Process{PID: 1, StartTime: 1, Comm: "systemd", Cmdline: "/sbin/init"}, WhyPID1},
		{"kthreadd", rules, proc.Process{PID: 2, StartTime: 1, Comm: "kthreadd"}, WhyKernelThread},
		{"kernel thread", rules, proc.Process{PID: 77, PPID: 2, StartTime: 5, Comm: "kworker/0:1"}, WhyKernelThread},
		{"unknown identity", rules, proc.Process{PID: 77}, WhyIdentityUnknown},
		{"self", rules, proc.Process{PID: 9000, PPID: 1, PGID: 1, SID: 1, StartTime: 5, Cmdline: "x"}, WhySelf},
		{"own group", rules, proc.Process{PID: 9005, PPID: 1, PGID: 9000, SID: 1, StartTime: 5, Cmdline: "x"}, WhyOwnGroup},
		{"own session", rules, proc.Process{PID: 9005, PPID: 1, PGID: 9005, SID: 8999, StartTime: 5, Cmdline: "x"}, WhyOwnSession},
		{"zombie", rules, func() proc.Process { p := pr(201, 1, 100, "python3"); p.State = "Z"; return p }(), WhyZombie},

		// By the executable's name, when root owns it.
		{"daemon", rules, running("sshd", rootExe("/usr/sbin/sshd")), WhyProtected},
		{"daemon, prefix", rules, running("sshd-session", rootExe("/usr/lib/openssh/sshd-session")), WhyProtected},
		{"daemon, comm truncated", rules, running("nv-fabricmanage", rootExe("/usr/bin/nv-fabricmanager")), WhyProtected},
		{"daemon, comm renamed", rules, running("worker", rootExe("/usr/sbin/nvidia-persistenced")), WhyProtected},
		{"daemon upgraded while it runs", rules, running("sshd", rootExe("/usr/sbin/sshd (deleted)")), WhyProtected},
		{"a 15-byte pattern, copied from ps", rules, running("my-long-daemon-", rootExe("/usr/bin/my-long-daemon-name")), WhyProtected},
		{"case-sensitive", rules, running("SSHD", rootExe("/usr/sbin/SSHD")), ""},
		{"default list not used when set", rules, running("Xorg", rootExe("/usr/lib/xorg/Xorg")), ""},
		{"the name of a directory does not count", rules, running("python3", rootExe("/usr/lib/sshd/python3")), ""},

		// What a process calls itself does not count when its executable is known.
		{"worker renamed systemd-worker (prctl)", rules, running("systemd-worker", rootExe("/usr/bin/python3.11")), ""},
		{"simulated worker renamed", rules, running("systemd-worker", rootExe("/tmp/bin/gpu-orphan-sim")), ""},
		{"a user's copy named like a daemon", rules, running("nv-fabricmanage", owned(rootExe("/home/alice/nv-fabricmanager"), 1000, 0o755)), ""},
		{"root's file, writable by its group", rules, running("sshd", owned(rootExe("/srv/sshd"), 0, 0o775)), ""},
		{"root's file, writable by all", rules, running("sshd", owned(rootExe("/tmp/sshd"), 0, 0o777)), ""},
		{"a file of the remediator's user", selfUID, running("sshd", owned(rootExe("/opt/sshd"), 1234, 0o755)), WhyProtected},
		{"a file of another user", selfUID, running("sshd", owned(rootExe("/opt/sshd"), 1000, 0o755)), ""},

		// By path: the file itself, or root's file at that path.
		{"protected file, by a hard link", rules, running("worker", hardLinked), WhyProtected},
		{"protected file, by its symlink's target", rules, running("daemon-1.2", daemonExe), WhyProtected},
		{"protected path, replaced since", rules, running("mydaemon", rootExe(link+" (deleted)")), WhyProtected},
		{"protected path, a user's file there", rules, running("mydaemon", owned(rootExe(link), 1000, 0o755)), ""},
		{"missing path: nothing runs it", rules, running("python3", rootExe("/usr/bin/python3")), ""},

		// Executable unknown: the comm, as before.
		{"unknown exe, protected comm", rules, pr(201, 1, 100, "sshd-session"), WhyProtected},
		{"unknown exe, truncated comm", rules, pr(201, 1, 100, "nvidia-persiste"), WhyProtected},
		{"unknown exe, renamed comm", rules, pr(201, 1, 100, "systemd-worker"), WhyProtected},
		{"unknown exe, a path's base name", rules, pr(201, 1, 100, "mydaemon"), WhyProtected},
		{"unknown exe, ordinary comm", rules, pr(201, 1, 100, "python3"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.rules.Why(tc.p); got != tc.want {
				t.Errorf("Why = %q, want %q", got, tc.want)
			}
		})
	}
	if got := (Rules{Self: self}).Why(running("Xorg", rootExe("/usr/lib/xorg/Xorg"))); got != WhyProtected {
		t.Errorf("nil Protected should mean DefaultProtected; Xorg got %q", got)
	}
	if got := (Rules{Self: self, Protected: []string{}}).Why(running("sshd", rootExe("/usr/sbin/sshd"))); got != "" {
		t.Errorf("an empty Protected should protect nothing; sshd got %q", got)
	}
}

// TestWithDefaultsStatsOnce: the protected paths are stat'ed when the rules
// are built; Why does not look again.
func TestWithDefaultsStatsOnce(t *testing.T) {
	path := filepath.Join(t.TempDir(), "daemon")
	if err := os.WriteFile(path, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	id := fileID(t, path)
	p := running("worker", proc.Exe{Path: "/elsewhere/worker", File: id, UID: 1000, Mode: unix.S_IFREG | 0o755})

	built := Rules{Self: self, Protected: []string{path}}.WithDefaults()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if got := built.Why(p); got != WhyProtected {
		t.Errorf("rules built before the file went: Why = %q, want protected", got)
	}
	if got := (Rules{Self: self, Protected: []string{path}}).Why(p); got != "" {
		t.Errorf("rules built after the file went: Why = %q, want nothing (no such file)", got)
	}
}

func TestDefaultProtected(t *testing.T) {
	rules := Rules{Self: self}.WithDefaults()
	for _, path := range []string{"/usr/bin/nvidia-persistenced", "/usr/bin/nv-fabricmanager", "/usr/bin/nv-hostengine",
		"/usr/bin/dcgm-exporter", "/usr/bin/dcgmi", "/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-control",
		"/usr/bin/nvidia-cuda-mps-server", "/usr/bin/nvidia-container-runtime-hook", "/usr/bin/nvidia-device-plugin",
		"/usr/lib/xorg/Xorg", "/usr/bin/Xwayland", "/usr/sbin/gdm3", "/usr/sbin/sshd", "/usr/lib/openssh/sshd-session",
		"/usr/bin/kubelet", "/usr/bin/containerd", "/usr/bin/containerd-shim-runc-v2", "/usr/bin/dockerd", "/usr/bin/docker",
		"/usr/sbin/runc", "/usr/bin/crio", "/usr/bin/conmon", "/usr/lib/systemd/systemd", "/usr/lib/systemd/systemd-journald",
		"/sbin/init", "/usr/local/bin/gpu-orphan", "/usr/local/bin/gpu-orphan-remediator", "/usr/local/bin/gpu-orphan-exporter",
	} {
		p := running("renamed", rootExe(path))
		if got := rules.Why(p); got != WhyProtected {
			t.Errorf("%s is not protected by default (%q)", path, got)
		}
		// Unknown executable: its comm as exec gave it.
		name := filepath.Base(path)
		if got := rules.Why(pr(201, 1, 100, name[:min(len(name), commLen)])); got != WhyProtected {
			t.Errorf("comm %q, exe unknown, is not protected by default (%q)", name[:min(len(name), commLen)], got)
		}
	}
	// The simulated trainer must stay cleanable, renamed or not.
	for _, comm := range []string{"gpu-orphan-sim", "systemd-worker"} {
		if got := rules.Why(running(comm, rootExe("/usr/local/bin/gpu-orphan-sim"))); got != "" {
			t.Errorf("gpu-orphan-sim workloads (comm %q) are protected (%q), so the simulation could never be cleaned", comm, got)
		}
	}
	// NVIDIA's daemons are protected by path as well: by the file, whatever
	// name runs it.
	for _, name := range []string{"nvidia-persistenced", "nv-fabricmanager", "nvidia-fabricmanager", "nvidia-cuda-mps-control",
		"nvidia-cuda-mps-server", "nv-hostengine"} {
		for _, dir := range []string{"/usr/bin/", "/usr/sbin/"} {
			if !slices.Contains(DefaultProtected, dir+name) {
				t.Errorf("DefaultProtected lacks %s", dir+name)
			}
		}
	}
	for _, e := range DefaultProtected {
		if IsPath(e) != (filepath.IsAbs(e) && filepath.Clean(e) == e) {
			t.Errorf("default entry %q is neither a clean absolute path nor a name pattern", e)
		}
	}
}

func TestMatchComm(t *testing.T) {
	for _, tc := range []struct {
		pattern, comm string
		want          bool
	}{
		{"Xorg", "Xorg", true},
		{"Xorg", "Xorg2", false},
		{"Xorg", "xorg", false},
		{"systemd*", "systemd", true},
		{"systemd*", "systemd-journal", true},
		{"systemd*", "system", false},
		{"containerd*", "containerd-shim", true},
		{"nvidia-persistenced", "nvidia-persiste", true},
		{"nvidia-persistenced", "nvidia-persist", false},
		{"gpu-orphan-expo*", "gpu-orphan-expo", true},
		{"nvidia-cuda-mps-control-x*", "nvidia-cuda-mps", true},
		{"", "", false},
		{"*", "anything", true},
	} {
		if got := matchComm(tc.pattern, tc.comm); got != tc.want {
			t.Errorf("matchComm(%q, %q) = %v, want %v", tc.pattern, tc.comm, got, tc.want)
		}
	}
}

func TestMatchName(t *testing.T) {
	for _, tc := range []struct {
		pattern, name string
		want          bool
	}{
		{"Xorg", "Xorg", true},
		{"Xorg", "Xorg2", false},
		{"Xorg", "xorg", false},
		{"systemd*", "systemd-journald", true},
		{"systemd*", "system", false},
		{"nvidia-persistenced", "nvidia-persistenced", true},
		// The name is whole: a comm-length cut of a longer pattern is not it.
		{"nvidia-persistenced", "nvidia-persiste", false},
		{"nvidia-fabricmanager", "nv-fabricmanager", false},
		// A pattern of 15 bytes may be a comm copied from ps.
		{"nvidia-persiste", "nvidia-persistenced", true},
		{"nvidia-persist", "nvidia-persistenced", false},
		{"gpu-orphan-expo*", "gpu-orphan-exporter", true},
		{"gpu-orphan", "gpu-orphan-sim", false},
		{"nvidia-cuda-mps-control-x*", "nvidia-cuda-mps-control", false},
		{"", "", false},
		{"*", "anything", true},
	} {
		if got := matchName(tc.pattern, tc.name); got != tc.want {
			t.Errorf("matchName(%q, %q) = %v, want %v", tc.pattern, tc.name, got, tc.want)
		}
	}
}
