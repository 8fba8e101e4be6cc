// Package remediateflag registers the flags that decide and act, shared by
// the remediator (--act, --remediate.*) and `gpu-orphan clean` (no
// prefix). It is the remediating side's counterpart of internal/cli, which
// every binary shares and which links no decision code.
package remediateflag

import (
	"fmt"
	"slices"
	"strings"
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
	// Protected are more protected executables, by name or absolute path,
	// beside the built-in list (see exclude.Rules.Protected).
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
	f := a.Flag(prefix+"protect", "Also never touch processes that run this executable (repeatable). An absolute path protects that very file "+
		"(device and inode, symlinks followed), whatever name runs it, and a root-owned file installed there since. A name ('name', or 'name*' for a prefix) protects "+
		"executables of that name that root owns and only root can write: a user's copy named like a daemon, or a process that renamed "+
		"itself, is not protected. The command name (comm) counts only where the executable cannot be read. Added to the built-in list: "+
		"nvidia-persistenced, nv-fabricmanager, nv-hostengine, dcgm*, nvidia-cuda-mps*, and NVIDIA's daemons by path in /usr/bin and "+
		"/usr/sbin; Xorg, sshd*, kubelet, containerd*, dockerd, systemd*, ...").PlaceHolder("NAME|PATH")
	f.SetValue(&protectValue{flag: f.Model().Name, entries: &r.Protected})
	return r
}

// protectValue collects --protect entries: absolute paths and names. A
// relative path is refused: it would protect nothing, silently.
type protectValue struct {
	flag    string
	entries *[]string
}

func (v *protectValue) Set(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("invalid --%s: empty; give a name or an absolute path", v.flag)
	case !exclude.IsPath(s) && strings.Contains(s, "/"):
		return fmt.Errorf("invalid --%s %q: a name has no '/'; give an absolute path (/usr/bin/NAME) or a name", v.flag, s)
	}
	*v.entries = append(*v.entries, s)
	return nil
}

func (v *protectValue) String() string { return strings.Join(*v.entries, ",") }

// IsCumulative makes the flag repeatable.
func (v *protectValue) IsCumulative() bool { return true }

// DecideConfig turns the flags into the decision's configuration.
func (r *Remediation) DecideConfig() decide.Config {
	return decide.Config{
		Policy:    r.Policy,
		MinAge:    r.MinAge,
		MinBytes:  r.MinBytes,
		Protected: append(slices.Clone(exclude.DefaultProtected), r.Protected...),
		Self:      exclude.CurrentSelf(),
	}.Resolved()
}
