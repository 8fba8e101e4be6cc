package exclude

import (
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

var self = Self{PID: 9000, PGID: 9000, SID: 8999}

// pr builds a live process of a job started from session 50.
func pr(pid, ppid, pgid int, comm string) proc.Process {
	return proc.Process{
		PID: pid, PPID: ppid, PGID: pgid, SID: 50, State: "S",
		StartTime: uint64(100000 + pid), UID: 1000, User: "alice",
		Comm: comm, Cmdline: comm + " --job", Cgroup: "/user.slice",
	}
}

func TestRules(t *testing.T) {
	rules := Rules{Self: self, Protected: []string{"sshd*", "nvidia-persistenced"}}
	for _, tc := range []struct {
		name string
		p    proc.Process
		want remediate.ExclusionReason
	}{
		{"ordinary", pr(201, 1, 100, "python3"), ""},
		{"pid 1", proc.Process{PID: 1, StartTime: 1, Comm: "systemd", Cmdline: "/sbin/init"}, WhyPID1},
		{"kthreadd", proc.Process{PID: 2, StartTime: 1, Comm: "kthreadd"}, WhyKernelThread},
		{"kernel thread", proc.Process{PID: 77, PPID: 2, StartTime: 5, Comm: "kworker/0:1"}, WhyKernelThread},
		{"unknown identity", proc.Process{PID: 77}, WhyIdentityUnknown},
		{"self", proc.Process{PID: 9000, PPID: 1, PGID: 1, SID: 1, StartTime: 5, Cmdline: "x"}, WhySelf},
		{"own group", proc.Process{PID: 9005, PPID: 1, PGID: 9000, SID: 1, StartTime: 5, Cmdline: "x"}, WhyOwnGroup},
		{"own session", proc.Process{PID: 9005, PPID: 1, PGID: 9005, SID: 8999, StartTime: 5, Cmdline: "x"}, WhyOwnSession},
		{"zombie", func() proc.Process { p := pr(201, 1, 100, "python3"); p.State = "Z"; return p }(), WhyZombie},
		{"protected prefix", pr(201, 1, 100, "sshd-session"), WhyProtected},
		{"protected, truncated", pr(201, 1, 100, "nvidia-persiste"), WhyProtected},
		{"case-sensitive", pr(201, 1, 100, "SSHD"), ""},
		{"default list not used when set", pr(201, 1, 100, "Xorg"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := rules.Why(tc.p); got != tc.want {
				t.Errorf("Why = %q, want %q", got, tc.want)
			}
		})
	}
	if got := (Rules{Self: self}).Why(pr(201, 1, 100, "Xorg")); got != WhyProtected {
		t.Errorf("nil Protected should mean DefaultProtected; Xorg got %q", got)
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
	for _, name := range []string{"nvidia-persistenced", "nv-hostengine", "dcgm", "dcgmi", "dcgm-exporter", "nvidia-smi", "Xorg",
		"Xwayland", "gdm", "sshd", "kubelet", "containerd", "containerd-shim-runc-v2", "dockerd", "docker", "runc", "crio",
		"conmon", "systemd", "systemd-journald", "init", "gpu-orphan", "gpu-orphan-remediator", "nvidia-cuda-mps-server"} {
		comm := name[:min(len(name), commLen)]
		if _, ok := protected(comm, DefaultProtected); !ok {
			t.Errorf("%s (comm %q) is not protected by default", name, comm)
		}
	}
	// The simulated trainer must stay cleanable.
	if _, ok := protected("gpu-orphan-sim", DefaultProtected); ok {
		t.Error("gpu-orphan-sim workloads are protected, so the simulation could never be cleaned")
	}
}
