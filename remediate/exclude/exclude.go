// Package exclude holds the rules that keep a process out of any cleanup,
// whatever the snapshot says: PID 1, kernel threads, a process whose
// identity is unknown, the remediator itself with its process group and
// session, zombies, and the protected names. Package decide applies them
// when it plans; package kill applies them again to group members that
// appear after the plan.
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
}

// CurrentSelf returns the identity of the calling process.
func CurrentSelf() Self {
	sid, err := unix.Getsid(0)
	if err != nil {
		sid = 0
	}
	return Self{PID: unix.Getpid(), PGID: unix.Getpgrp(), SID: sid}
}

// Rules are the rules that need no snapshot.
type Rules struct {
	// Protected are comm patterns never touched; nil means DefaultProtected.
	// To protect nothing beyond the fixed rules, pass an empty, non-nil slice.
	Protected []string
	// Self is the remediator; the zero value means the calling process.
	Self Self
}

// WithDefaults fills in DefaultProtected and the calling process as Self
// where r leaves them unset.
func (r Rules) WithDefaults() Rules {
	if r.Protected == nil {
		r.Protected = DefaultProtected
	}
	if r.Self == (Self{}) {
		r.Self = CurrentSelf()
	}
	return r
}

// Why reports why p must never be signalled, or "" when no rule applies.
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
	if _, ok := protected(p.Comm, r.Protected); ok {
		return WhyProtected
	}
	return ""
}
