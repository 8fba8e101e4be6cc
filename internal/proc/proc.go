// Package proc reads what the snapshot needs from /proc: who a process is,
// whether it is alive, and which processes hold a given device node open.
package proc

// Process is the identity of one process, as read from /proc/PID.
type Process struct {
	PID  int
	PPID int
	PGID int
	SID  int
	// State is field 3 of /proc/PID/stat: "R", "S", "D", "Z", "T", ...
	State string
	// StartTime is field 22 of /proc/PID/stat, in clock ticks since boot.
	// (PID, StartTime) names a process even when its PID is reused.
	StartTime uint64
	UID       int
	User      string
	Comm      string
	Cmdline   string
	// Cgroup is the process's cgroup v2 path (or the first v1 path).
	Cgroup string
	// Container and Pod are parsed from Cgroup when the process runs in a
	// container (docker, containerd, cri-o) or a Kubernetes pod.
	Container string
	Pod       string
	// NSpid lists the process's PID in each nested PID namespace, outermost
	// first (the NSpid line of /proc/PID/status).
	NSpid []int
}

// Zombie reports whether the process has exited but not been reaped.
// Zombies hold no descriptors and own no GPU memory.
func (p Process) Zombie() bool { return p.State == "Z" || p.State == "X" }
