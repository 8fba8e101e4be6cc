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
	// Exe is the file the process runs (/proc/PID/exe), which it cannot
	// rename as it can Comm and Cmdline; unknown when unreadable.
	Exe Exe
	// Cgroup is the process's cgroup v2 path (or the first v1 path).
	Cgroup string
	// Container and Pod are parsed from Cgroup when the process runs in a
	// container (docker, containerd, cri-o) or a Kubernetes pod.
	Container string
	Pod       string
	// SlurmJob and SlurmStep are parsed from any of the process's cgroup
	// paths when slurmd placed it there (see parseSlurm).
	SlurmJob  string
	SlurmStep string
	// LeaderExited is set when the main thread has exited (State "Z")
	// while other threads of the process run on: it is alive, and they
	// keep its descriptors and its GPU context (measured on the H200 after
	// pthread_exit of a PyTorch process's main thread).
	LeaderExited bool
	// Exiting is set when every thread of the process has begun to exit
	// (PF_EXITING) but it is not a zombie yet: it never runs its code
	// again, and is not alive (FS.Alive), though it may still hold its
	// files for a moment. /proc no longer says all it was: its cgroup v1
	// paths read "/", its cmdline may be empty.
	Exiting bool
	// NSpid lists the process's PID in each nested PID namespace, outermost
	// first (the NSpid line of /proc/PID/status).
	NSpid []int
}

// Zombie reports whether the process has exited but not been reaped: every
// thread of it has exited. Zombies hold no descriptors and own no GPU
// memory. A main thread that exited alone does not make a zombie.
func (p Process) Zombie() bool { return (p.State == "Z" || p.State == "X") && !p.LeaderExited }
