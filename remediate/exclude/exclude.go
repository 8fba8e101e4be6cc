// Package exclude holds the rules that keep a process out of any cleanup,
// whatever the snapshot says: PID 1, kernel threads, a process whose
// identity is unknown, the remediator itself with its process group and
// session, zombies, and the protected daemons, known by the file they run.
// Package decide applies them when it plans; package kill applies them
// again to group members that appear after the plan.
package exclude

import (
	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// Why a process is left alone (remediate.Exclusion.Why), by these rules.
const (
	WhyPID1            remediate.ExclusionReason = "pid_1"
	WhyKernelThread    remediate.ExclusionReason = "kernel_thread"
	WhyIdentityUnknown remediate.ExclusionReason = "identity_unknown"
	WhySelf            remediate.ExclusionReason = "self"
	WhyOwnGroup        remediate.ExclusionReason = "own_process_group"
	WhyOwnSession      remediate.ExclusionReason = "own_session"
	WhyZombie          remediate.ExclusionReason = "zombie"
	WhyProtected       remediate.ExclusionReason = "protected"
)

// Self is the remediator's own identity; no cleanup includes it, its
// process group or its session.
type Self struct {
	PID, PGID, SID int
	// UID is the remediator's effective UID. An executable that this user
	// owns is trusted as one that root owns (see Rules.Protected): when the
	// remediator runs as a user, that user's files are its own.
	UID int
}

// CurrentSelf returns the identity of the calling process.
func CurrentSelf() Self {
	sid, err := unix.Getsid(0)
	if err != nil {
		sid = 0
	}
	return Self{PID: unix.Getpid(), PGID: unix.Getpgrp(), SID: sid, UID: unix.Geteuid()}
}

// Rules are the rules that need no snapshot.
type Rules struct {
	// Protected are the processes never touched, by what they run; nil
	// means DefaultProtected. To protect nothing beyond the fixed rules,
	// pass an empty, non-nil slice. Each entry is
	//   - an absolute path ("/usr/bin/nv-hostengine"): a process whose
	//     executable is that very file (st_dev, st_ino, as stat'ed when the
	//     rules are built, symlinks followed) is protected, whatever name
	//     it was exec'd by; so is one whose executable was at that path,
	//     when the file is trusted (below);
	//   - or a name pattern ("nv-hostengine", "sshd*": exact, or a prefix
	//     ending in "*", case-sensitive): a process is protected when the
	//     name of its executable matches and the file is trusted.
	// A file is trusted when root (or Self.UID) owns it and neither group
	// nor others may write it: a user's own copy of a binary named like a
	// daemon is not, nor is a worker that renamed itself (comm, argv) but
	// runs python. Only when /proc will not tell the executable (see
	// proc.Exe.Known) does the comm count, against the patterns and the
	// paths' base names, truncated to 15 bytes as the kernel keeps it:
	// when in doubt, do not signal.
	Protected []string
	// Self is the remediator; the zero value means the calling process.
	Self Self

	// files are Protected's paths as stat'ed by WithDefaults (resolved).
	files    protectedFiles
	resolved bool
}

// WithDefaults fills in DefaultProtected and the calling process as Self
// where r leaves them unset, and stats the executables that Protected names
// by path, unless that was done: keep the Rules it returns to stat them
// once. Paths that do not exist are ignored.
func (r Rules) WithDefaults() Rules {
	if r.Protected == nil {
		r.Protected = DefaultProtected
	}
	if r.Self == (Self{}) {
		r.Self = CurrentSelf()
	}
	if !r.resolved {
		r.files, r.resolved = statProtected(r.Protected), true
	}
	return r
}

// Why reports why p must never be signalled, or "" when no rule applies.
// It looks nothing up about p: what it runs is p.Exe, read with the rest
// of the snapshot.
func (r Rules) Why(p proc.Process) remediate.ExclusionReason {
	r = r.WithDefaults()
	switch {
	case p.PID == 1:
		return WhyPID1
	case p.PID == 2 || p.PPID == 2 || (p.PPID == 0 && p.Cmdline == "" && p.StartTime != 0):
		// kthreadd and its children; kernel threads have no cmdline.
		return WhyKernelThread
	case p.PID <= 0 || p.StartTime == 0:
		// proc.FS.Alive returns only the PID when /proc could not tell:
		// without a start time the kill ladder cannot check identity.
		return WhyIdentityUnknown
	case p.PID == r.Self.PID:
		return WhySelf
	case r.Self.PGID > 0 && p.PGID == r.Self.PGID:
		return WhyOwnGroup
	case r.Self.SID > 0 && p.SID == r.Self.SID:
		return WhyOwnSession
	case p.Zombie():
		return WhyZombie
	}
	if p.Exe.Known() && r.protectedExe(p.Exe) || !p.Exe.Known() && protectedComm(p.Comm, r.Protected) {
		return WhyProtected
	}
	return ""
}
