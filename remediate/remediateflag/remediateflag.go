// Package remediateflag registers the flags that decide and act, shared by
// the remediator (--act, --remediate.*) and `gpu-orphan clean` (no
// prefix). It is the remediating side's counterpart of internal/cli, which
// every binary shares and which links no decision code.
package remediateflag

import (
	"slices"
	"time"

	"github.com/alecthomas/kingpin/v2"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

// flagger is what both *kingpin.Application and *kingpin.CmdClause offer.
type flagger interface {
	Flag(name, help string) *kingpin.FlagClause
}

// Remediation holds the values of the flags that decide and act.
type Remediation struct {
	// Act: without it, dry run.
	Act           bool
	Policy        remediate.Policy
	MinAge        time.Duration
	MinBytes      uint64
	Grace         time.Duration
	VerifyTimeout time.Duration
	// Protected are more protected command names, beside the built-in list.
	Protected []string
}

// AddRemediatorFlags registers the remediator's --act and --remediate.*.
func AddRemediatorFlags(a flagger) *Remediation {
	return addRemediationFlags(a, "remediate.", "2m")
}

// AddCleanFlags registers the same flags for `gpu-orphan clean`, where a
// human asks for a cleanup now: no prefix, and no minimum age by default.
func AddCleanFlags(a flagger) *Remediation {
	return addRemediationFlags(a, "", "0s")
}

func addRemediationFlags(a flagger, prefix, minAge string) *Remediation {
	r := &Remediation{}
	a.Flag("act", "Really signal the targets. Without it, only the plan is made and reported (dry run).").BoolVar(&r.Act)
	cli.EnumVar(a.Flag(prefix+"policy", "Which holders to target: dead-owner (holders of contexts whose creator is dead), orphaned (also processes reparented after their session leader died; they may own live memory), all-holders (every holder of the GPU's device node, live owners included, as blunt scripts do).").
		Default(string(remediate.PolicyDeadOwner)), &r.Policy, remediate.Policies...)
	cli.DurationVar(a.Flag(prefix+"min-age", "How long memory must have had no live owner before anything is killed.").Default(minAge), &r.MinAge)
	cli.BytesVar(a.Flag(prefix+"min-bytes", "Memory with no live owner at or below this is not a problem (NVML charges about 8 MiB per live context to no process). Bytes, or a size with a unit: 256MiB, 1GiB.").
		Default("256MiB"), &r.MinBytes)
	cli.DurationVar(a.Flag(prefix+"grace", "Time between SIGTERM and SIGKILL.").Default("10s"), &r.Grace)
	cli.DurationVar(a.Flag(prefix+"verify-timeout", "How long to wait for the memory to come back after the signals.").Default("30s"), &r.VerifyTimeout)
	a.Flag(prefix+"protect", "Also never touch processes with this command name (repeatable; 'name*' matches a prefix). Added to the built-in list: nvidia-persistenced, nv-hostengine, dcgm, Xorg, sshd, kubelet, containerd, dockerd, systemd, ...").StringsVar(&r.Protected)
	return r
}

// DecideConfig turns the flags into the decision's configuration.
func (r *Remediation) DecideConfig() decide.Config {
	return decide.Config{
		Policy:    r.Policy,
		MinAge:    r.MinAge,
		MinBytes:  r.MinBytes,
		Protected: append(slices.Clone(exclude.DefaultProtected), r.Protected...),
		Self:      exclude.CurrentSelf(),
	}
}
