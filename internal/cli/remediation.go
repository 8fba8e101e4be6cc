package cli

import (
	"slices"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

// Remediation holds the flags that decide and act, shared by the
// remediator (--remediate.*) and `gpu-orphan clean` (no prefix).
type Remediation struct {
	Act           *bool
	Policy        *string
	MinAge        *time.Duration
	MinBytes      *uint64
	Grace         *time.Duration
	VerifyTimeout *time.Duration
	Protected     *[]string
}

// AddRemediationFlags registers the remediator's --act and --remediate.*.
func AddRemediationFlags(a flagger) *Remediation {
	return addRemediationFlags(a, "remediate.", "2m")
}

// AddCleanFlags registers the same flags for `gpu-orphan clean`, where a
// human asks for a cleanup now: no prefix, and no minimum age by default.
func AddCleanFlags(a flagger) *Remediation {
	return addRemediationFlags(a, "", "0s")
}

func addRemediationFlags(a flagger, prefix, minAge string) *Remediation {
	return &Remediation{
		Act: a.Flag("act", "Really signal the targets. Without it, only the plan is made and reported (dry run).").Bool(),
		Policy: a.Flag(prefix+"policy", "Which holders to target: dead-owner (holders of contexts whose creator is dead), orphaned (also processes reparented after their session leader died; they may own live memory), all-holders (every holder of the GPU's device node, live owners included, as blunt scripts do).").
			Default(string(remediate.PolicyDeadOwner)).Enum(string(remediate.PolicyDeadOwner), string(remediate.PolicyOrphaned), string(remediate.PolicyAllHolders)),
		MinAge: a.Flag(prefix+"min-age", "How long memory must have had no live owner before anything is killed.").Default(minAge).Duration(),
		MinBytes: a.Flag(prefix+"min-bytes", "Memory with no live owner at or below this is not a problem (NVML charges about 8 MiB per live context to no process).").
			Default("268435456").Uint64(),
		Grace:         a.Flag(prefix+"grace", "Time between SIGTERM and SIGKILL.").Default("10s").Duration(),
		VerifyTimeout: a.Flag(prefix+"verify-timeout", "How long to wait for the memory to come back after the signals.").Default("30s").Duration(),
		Protected:     a.Flag(prefix+"protect", "Also never touch processes with this command name (repeatable; 'name*' matches a prefix). Added to the built-in list: nvidia-persistenced, nv-hostengine, dcgm, Xorg, sshd, kubelet, containerd, dockerd, systemd, ...").Strings(),
	}
}

// DecideConfig turns the flags into the decision's configuration.
func (r *Remediation) DecideConfig() decide.Config {
	return decide.Config{
		Policy:    remediate.Policy(*r.Policy),
		MinAge:    *r.MinAge,
		MinBytes:  *r.MinBytes,
		Protected: append(slices.Clone(exclude.DefaultProtected), *r.Protected...),
		Self:      exclude.CurrentSelf(),
	}
}
