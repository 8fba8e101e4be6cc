package exclude

import "strings"

// commLen is the most bytes of a name that /proc/PID/stat's comm keeps
// (TASK_COMM_LEN 16, less the NUL): "nvidia-persistenced" runs as
// "nvidia-persiste", "containerd-shim-runc-v2" as "containerd-shim".
const commLen = 15

// DefaultProtected are the comm patterns of processes no policy may touch,
// whatever they hold: the node's GPU and container plumbing, display
// servers, remote access, init, and our own binaries. A pattern is an exact
// comm, or a prefix ending in "*". Matching is case-sensitive.
var DefaultProtected = []string{
	// NVIDIA's daemons and tools. The MPS server owns its clients' memory.
	"nvidia-persistenced",
	"nvidia-fabricmanager",
	"nvidia-powerd",
	"nvidia-cuda-mps*",
	"nvidia-smi",
	"nvidia-container*",
	"nvidia-device-plugin",
	"gpu-feature-discovery",
	"nv-hostengine",
	"dcgm*", // dcgm, dcgmi, dcgm-exporter
	// Display servers and sessions hold the GPU of a workstation.
	"Xorg",
	"Xwayland",
	"gdm*",
	"sddm",
	"lightdm",
	"gnome-shell",
	"kwin_wayland",
	"kwin_x11",
	// Remote access and logins.
	"sshd*", // sshd, and OpenSSH 9.8's sshd-session, sshd-auth
	"login",
	"agetty",
	// Kubernetes, containers and schedulers.
	"kubelet",
	"k3s*",
	"containerd*", // containerd, containerd-shim*
	"dockerd",
	"docker",
	"docker-proxy",
	"runc",
	"crun",
	"crio",
	"conmon",
	"podman",
	"pause",
	"tini",
	"dumb-init",
	"slurmd",
	"slurmstepd",
	"slurmctld",
	// The system itself.
	"systemd*", // systemd, systemd-journald, systemd-udevd, ...
	"init",
	"dbus-daemon",
	"dbus-broker",
	// Ourselves: gpu-orphan, gpu-orphan-exporter, gpu-orphan-remediator
	// (comm keeps 15 bytes). Not gpu-orphan-sim: its workloads stand in for
	// trainers and must be cleanable.
	"gpu-orphan",
	"gpu-orphan-expo*",
	"gpu-orphan-reme*",
}

// protected reports the first pattern of patterns that comm matches.
func protected(comm string, patterns []string) (string, bool) {
	for _, p := range patterns {
		if matchComm(p, comm) {
			return p, true
		}
	}
	return "", false
}

// matchComm matches one pattern against a comm, allowing for the kernel's
// truncation of comm to 15 bytes: without it a long name such as
// "nvidia-persistenced" would never match.
func matchComm(pattern, comm string) bool {
	if pattern == "" || comm == "" {
		return false
	}
	if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
		if len(prefix) > commLen {
			prefix = prefix[:commLen]
		}
		return strings.HasPrefix(comm, prefix)
	}
	if comm == pattern {
		return true
	}
	return len(pattern) > commLen && len(comm) == commLen && pattern[:commLen] == comm
}
