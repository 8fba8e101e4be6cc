// Package decide chooses, from one snapshot, which processes a cleanup of
// one GPU may signal, and which it must leave alone. It is pure: a
// snapshot, a configuration and what the caller listed of process groups
// go in, a plan comes out; it reads nothing and signals nothing. The plan
// goes to package kill.
package decide

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

// SkipReason says why a plan does not act; Plan.SkipDetail adds the
// particulars.
type SkipReason string

// Why a plan does not act.
const (
	SkipSnapshotUnhealthy SkipReason = "snapshot_unhealthy"
	SkipGPUNotFound       SkipReason = "gpu_not_found"
	// SkipGPUReadFailed: the detail is the driver's error.
	SkipGPUReadFailed SkipReason = "gpu_read_failed"
	// SkipAccountingUnsupported: the detail is snapshot.GPU.Unsupported.
	SkipAccountingUnsupported SkipReason = "accounting_unsupported"
	// SkipUnknownPolicy: the detail is the policy.
	SkipUnknownPolicy  SkipReason = "unknown_policy"
	SkipBelowThreshold SkipReason = "below_threshold"
	SkipTooYoung       SkipReason = "too_young"
	SkipNotScanned     SkipReason = "holders_not_scanned"
	// SkipScanIncomplete: the detail says how many processes could not be
	// read, and what to do about it.
	SkipScanIncomplete SkipReason = "holders_scan_incomplete"
	SkipNoTargets      SkipReason = "no_targets"
)

// Why a process is left alone (remediate.Exclusion.Why), by the rules that
// need the snapshot; package exclude has the rules that do not.
const (
	WhyOwnsLiveMemory remediate.ExclusionReason = "owns_live_memory"
	// WhyLiveJobElsewhere: the process, or an ancestor, owns live memory on
	// another GPU: it is part of a healthy job there.
	WhyLiveJobElsewhere remediate.ExclusionReason = "live_job_on_another_gpu"
	// WhyNotMapped: it holds the device node open without mapping it, as
	// NVML-only readers (nvidia-smi, DCGM, exporters) do.
	WhyNotMapped remediate.ExclusionReason = "nvml_reader_not_mapped"
	// WhyUnexplained: it maps the GPU, but nothing the kernel records
	// proves that it inherited a dead owner's context (snapshot.
	// ReasonUnexplained): look at it; it is never signalled for a dead
	// owner.
	WhyUnexplained remediate.ExclusionReason = "unexplained_holder"
	// WhyDeadOwnerTooYoung: it inherited the context of an owner that has
	// been dead for less than MinAge.
	WhyDeadOwnerTooYoung remediate.ExclusionReason = "dead_owner_too_young"
)

// Target reasons that this package adds to the snapshot's suspect reasons.
const (
	// ReasonGroupMember: a member of a process group killed whole that
	// holds no GPU itself. No plan makes it any more (issue 22: a group is
	// killed whole only when every member is a proven target); it names
	// such targets in audit records written before.
	ReasonGroupMember remediate.TargetReason = "process_group_member"
	// ReasonDeviceHolder: under all-holders, a holder of the device node
	// that is not a suspect (a live owner, for instance).
	ReasonDeviceHolder remediate.TargetReason = "device_holder"
	// ReasonInheritorOfTarget: under orphaned, a descendant of an orphaned
	// owner that is a target, or a process sharing its open files: it
	// holds the owner's context, which would outlive the owner.
	ReasonInheritorOfTarget remediate.TargetReason = "inheritor_of_target"
	// ReasonTracerOfTarget: a process that traces a target with ptrace(2)
	// and is itself a target: of the plan of another GPU of the node, or,
	// for the epilog, a process of the ended job. Its tracee may not finish
	// dying while it lives (package cleanup adds it; the plan's notes say
	// what proves it).
	ReasonTracerOfTarget remediate.TargetReason = "tracer_of_target"
)

// Config is what a decision needs besides the snapshot.
type Config struct {
	// Policy is one of remediate.Policies; empty means dead-owner.
	Policy remediate.Policy
	// MinAge is how long a dead owner must have been dead (Owner.DeadSince)
	// before the holders of its context are signalled; an orphaned owner
	// must have been orphaned as long (Holder.Since), and unattributed
	// memory with no dead owner must have lasted as long (GPU.UnownedSince).
	// Each orphan has its own clock: an old one does not make a new one
	// old.
	MinAge time.Duration
	// MinBytes: memory with no live owner must exceed it. NVML charges about
	// 8 MiB per live context to no process, so it must not be zero.
	MinBytes uint64
	// Protected are comm patterns never touched; nil means
	// exclude.DefaultProtected. To protect nothing beyond the fixed rules,
	// pass an empty, non-nil slice.
	Protected []string
	// Self is the remediator. The zero value means the calling process,
	// asked of the kernel (getpid, getsid): the one thing Decide looks up
	// rather than takes, so that a forgotten Self can never target the
	// remediator. Callers set it (remediateflag does).
	Self exclude.Self
	// rules are the never-touch rules built by Resolved.
	rules *exclude.Rules
}

func (c Config) withDefaults() Config {
	if c.Policy == "" {
		c.Policy = remediate.PolicyDeadOwner
	}
	r := c.Rules().WithDefaults()
	c.Protected, c.Self = r.Protected, r.Self
	return c
}

// Rules are the never-touch rules that need no snapshot, under this
// configuration. Package kill applies them to group members forked after
// the plan.
func (c Config) Rules() exclude.Rules {
	if c.rules != nil {
		return *c.rules
	}
	return exclude.Rules{Protected: c.Protected, Self: c.Self}
}

// Resolved returns c with its never-touch rules built once: the protected
// paths stat'ed now, not at every process a plan looks at.
func (c Config) Resolved() Config {
	r := c.Rules().WithDefaults()
	c.Protected, c.Self, c.rules = r.Protected, r.Self, &r
	return c
}

// Plan is what to do about one GPU.
type Plan struct {
	GPUUUID  string
	GPUIndex int
	Policy   remediate.Policy
	// Act is true when there are targets and every precondition held.
	Act bool
	// SkipReason says why not, when !Act, and SkipDetail what a person
	// needs besides: which error, how many processes.
	SkipReason SkipReason
	SkipDetail string `json:",omitempty"`
	Before     remediate.MemoryEvidence
	// DeadOwners are the dead PIDs NVML lists on the GPU, with who they
	// were when the snapshot remembers it.
	DeadOwners []remediate.DeadOwner
	// Targets are sorted by PID.
	Targets []remediate.Target
	// Excluded are the candidates and the live owners of the GPU that the
	// plan leaves alone, sorted by PID.
	Excluded []remediate.Exclusion
	// Groups are the process groups killed whole.
	Groups []int
	// Notes explain, for the audit record, why a target's process group was
	// not killed whole.
	Notes []string
}

// SkipText is why the plan does not act, for people: the reason, and the
// detail after a colon.
func (p Plan) SkipText() string {
	if p.SkipDetail == "" {
		return string(p.SkipReason)
	}
	return string(p.SkipReason) + ": " + p.SkipDetail
}

// Decide plans the cleanup of GPU gpuID (its UUID or index) under cfg.
// now is the moment that ages are measured to. The plan targets suspects
// only; WithGroups extends it to whole process groups.
//
// No policy acts unless the GPU has an orphan: memory that dead owners own,
// or unattributed memory beyond what the live contexts explain, above
// MinBytes (GPU.UnexplainedBytes). Then:
//   - dead-owner: the proven inheritors of each dead owner that has been
//     dead for at least MinAge.
//   - orphaned: those, and each orphaned owner that NVML charges more than
//     MinBytes and that has been seen orphaned for at least MinAge, with
//     its descendants that hold its context.
//   - all-holders: every process that maps the GPU, once a dead owner (or
//     the unexplained memory) is MinAge old.
func Decide(s *snapshot.Snapshot, gpuID string, cfg Config, now time.Time) Plan {
	cfg = cfg.withDefaults()
	p := Plan{Policy: cfg.Policy}
	skip := func(reason SkipReason, detail string) Plan {
		p.Act, p.SkipReason, p.SkipDetail = false, reason, detail
		return p
	}
	if s == nil {
		return skip(SkipSnapshotUnhealthy, "")
	}
	g, found := s.GPUByID(gpuID)
	if found {
		p.GPUUUID, p.GPUIndex = g.Device.UUID, g.Device.Index
		p.Before = remediate.NewMemoryEvidence(g, s.Taken, now)
		p.DeadOwners = remediate.NewDeadOwners(g)
	}
	// A holder we could not see may be anyone: act on a complete scan only.
	if s.FDScanDenied > 0 {
		return skip(SkipScanIncomplete, fmt.Sprintf("the descriptors of %d processes could not be read; run the remediator as root or with CAP_SYS_PTRACE", s.FDScanDenied))
	}
	// A failed source may have left any GPU's numbers stale or partial.
	if !s.Healthy() {
		return skip(SkipSnapshotUnhealthy, "")
	}
	if !found {
		return skip(SkipGPUNotFound, "")
	}
	if g.Err != nil {
		return skip(SkipGPUReadFailed, g.Err.Error())
	}
	if g.Unsupported != "" {
		return skip(SkipAccountingUnsupported, g.Unsupported)
	}
	switch cfg.Policy {
	case remediate.PolicyDeadOwner, remediate.PolicyOrphaned, remediate.PolicyAllHolders:
	default:
		return skip(SkipUnknownPolicy, string(cfg.Policy))
	}

	if g.UnexplainedBytes <= cfg.MinBytes {
		return skip(SkipBelowThreshold, belowDetail(g))
	}
	old := func(since time.Time) bool {
		if since.IsZero() {
			return cfg.MinAge <= 0 // never dated: old only if any age will do
		}
		return now.Sub(since) >= cfg.MinAge
	}
	ripeDead := map[int]bool{} // dead owners dead for MinAge
	for _, o := range g.Owners {
		if !o.Alive && old(o.DeadSince) {
			ripeDead[int(o.PID)] = true
		}
	}
	// Unattributed memory with no dead owner has only the GPU's clock.
	problemRipe := len(ripeDead) > 0 || (!g.DeadOwnerListed() && old(g.UnownedSince))
	ripe := map[int]bool{} // orphaned owners old and big enough
	if cfg.Policy == remediate.PolicyOrphaned {
		for _, h := range g.Suspects {
			switch {
			case h.Reason != snapshot.ReasonOrphaned || h.UsedBytes <= cfg.MinBytes || !old(h.Since):
			default:
				ripe[h.PID] = true
			}
		}
	}
	if !problemRipe && len(ripe) == 0 {
		return skip(SkipTooYoung, "") // worth another look later
	}
	if !g.Scanned {
		return skip(SkipNotScanned, "")
	}

	w := newWorld(s)
	cands := candidates(g, cfg.Policy, ripeDead, problemRipe, ripe)
	targeted := map[int]bool{}
	excluded := map[int]bool{}
	for _, c := range cands {
		if targeted[c.PID] || excluded[c.PID] {
			continue
		}
		why := c.why
		// A never-touch rule says more of a process than a missing proof.
		if why == "" || why == WhyUnexplained || why == WhyDeadOwnerTooYoung {
			if r := cfg.Rules().Why(c.Process); r != "" {
				why = r
			}
		}
		if why == "" && w.liveOwner[c.PID] && !ownsByPolicy(cfg.Policy, c.reason) {
			why = WhyOwnsLiveMemory
		}
		if why != "" {
			excluded[c.PID] = true
			p.Excluded = append(p.Excluded, remediate.Exclusion{ProcessInfo: remediate.NewProcessInfo(c.Process), Why: why})
			continue
		}
		targeted[c.PID] = true
		p.Targets = append(p.Targets, remediate.Target{ProcessInfo: remediate.NewProcessInfo(c.Process), Reason: c.reason})
	}
	// The memory we leave on this GPU belongs to someone: say to whom.
	for _, o := range g.Owners {
		pid := int(o.PID)
		if o.Alive && o.Process != nil && !targeted[pid] && !excluded[pid] {
			excluded[pid] = true
			p.Excluded = append(p.Excluded, remediate.Exclusion{ProcessInfo: remediate.NewProcessInfo(*o.Process), Why: WhyOwnsLiveMemory})
		}
	}
	if len(p.Targets) == 0 {
		p.sort()
		if slices.ContainsFunc(p.Excluded, func(e remediate.Exclusion) bool { return e.Why == WhyDeadOwnerTooYoung }) {
			return skip(SkipTooYoung, "")
		}
		return skip(SkipNoTargets, unexplainedDetail(p.Excluded, g))
	}
	p.sort()
	p.Act = true
	return p
}

// candidate is a process a policy would target, before the never-touch
// rules; why is set when it is excluded already.
type candidate struct {
	proc.Process
	reason remediate.TargetReason
	why    remediate.ExclusionReason
}

// candidates lists, in order, who policy would target on g. ripeDead are
// the dead owners dead for MinAge; problemRipe says whether the GPU's orphan
// is old enough for all-holders; ripe are the orphaned owners old and big
// enough for the orphaned policy.
func candidates(g snapshot.GPU, policy remediate.Policy, ripeDead map[int]bool, problemRipe bool, ripe map[int]bool) []candidate {
	var out []candidate
	for _, h := range g.Suspects {
		c := candidate{Process: h.Process, reason: remediate.TargetReason(h.Reason)}
		switch {
		case h.Reason == snapshot.ReasonInheritedFromDeadOwner:
			if !ripeDead[h.DeadOwner] {
				c.why = WhyDeadOwnerTooYoung
			}
		case h.Reason == snapshot.ReasonUnexplained && policy != remediate.PolicyAllHolders:
			c.why = WhyUnexplained
		case h.Reason == snapshot.ReasonOrphaned && policy == remediate.PolicyOrphaned && ripe[h.PID]:
		default:
			continue
		}
		out = append(out, c)
	}
	if policy == remediate.PolicyOrphaned && len(ripe) > 0 {
		// An orphaned owner's forked workers hold its context: killing the
		// owner alone leaves the memory held.
		for _, h := range g.Holders {
			if slices.ContainsFunc(out, func(c candidate) bool { return c.PID == h.PID }) {
				continue
			}
			if slices.ContainsFunc(h.LiveJobs, func(l snapshot.JobLink) bool {
				return ripe[l.OwnerPID] && l.GPU == g.Device.UUID && (l.How == snapshot.JobDescendant || l.How == snapshot.JobSharesFile)
			}) {
				out = append(out, candidate{Process: h.Process, reason: ReasonInheritorOfTarget})
			}
		}
	}
	if policy != remediate.PolicyAllHolders || !problemRipe {
		return out
	}
	// all-holders: every process that maps this GPU's device node, unless
	// it (or an ancestor) owns live memory on another GPU.
	for _, h := range g.Holders {
		if slices.ContainsFunc(out, func(c candidate) bool { return c.PID == h.PID }) {
			continue
		}
		c := candidate{Process: h.Process, reason: ReasonDeviceHolder}
		switch {
		case !h.Mapped:
			c.why = WhyNotMapped
		case slices.ContainsFunc(h.LiveJobGPUs, func(uuid string) bool { return uuid != g.Device.UUID }):
			c.why = WhyLiveJobElsewhere
		}
		out = append(out, c)
	}
	return out
}

// belowDetail says why memory with no live owner is not an orphan.
func belowDetail(g snapshot.GPU) string {
	if g.DeadOwnerListed() || g.UnownedBytes == 0 {
		return ""
	}
	live := 0
	for _, o := range g.Owners {
		if o.Alive {
			live++
		}
	}
	return fmt.Sprintf("no dead owner; the %d MiB with no owner is what %d live contexts explain (%d MiB each)",
		g.UnownedBytes>>20, live, snapshot.ContextOverheadBytes>>20)
}

// unexplainedDetail names the holders left alone for lack of proof, and
// why nothing proves them (the snapshot's Proof of each).
func unexplainedDetail(excluded []remediate.Exclusion, g snapshot.GPU) string {
	var pids, whys []string
	for _, e := range excluded {
		if e.Why != WhyUnexplained {
			continue
		}
		pids = append(pids, fmt.Sprintf("%d (%s)", e.PID, e.Comm))
		for _, h := range g.Suspects {
			if h.PID == e.PID && h.Proof != "" && !slices.Contains(whys, h.Proof) {
				whys = append(whys, h.Proof)
			}
		}
	}
	if len(pids) == 0 {
		return ""
	}
	why := ""
	if len(whys) > 0 {
		why = " (" + strings.Join(whys, ", ") + ")"
	}
	return fmt.Sprintf("nothing proves that %s inherited a dead owner's context%s; look at them with gpu-orphan ps",
		strings.Join(pids, ", "), why)
}

// ownsByPolicy reports whether the policy targets a process by name even
// though it owns live memory.
func ownsByPolicy(policy remediate.Policy, reason remediate.TargetReason) bool {
	switch policy {
	case remediate.PolicyAllHolders:
		return true
	case remediate.PolicyOrphaned:
		return reason == remediate.ReasonOrphaned
	}
	return false
}

// world is what the snapshot says about every GPU at once.
type world struct {
	liveOwner map[int]bool
	holder    map[int]bool
	// allScanned is true when every GPU's holders were scanned, so that
	// "holds no GPU" is known rather than assumed.
	allScanned bool
}

func newWorld(s *snapshot.Snapshot) world {
	w := world{liveOwner: map[int]bool{}, holder: map[int]bool{}, allScanned: true}
	for _, g := range s.GPUs {
		for _, o := range g.Owners {
			if o.Alive {
				w.liveOwner[int(o.PID)] = true
			}
		}
		for _, pid := range g.HolderPIDs {
			w.holder[pid] = true
		}
		if !g.Scanned {
			w.allScanned = false
		}
	}
	return w
}

// Group is what the caller found of one process group: its live members,
// a zombie leader whose other threads run among them
// (proc.FS.GroupMembers), or why they could not be listed.
type Group struct {
	Members []proc.Process
	Err     error
}

// GroupsToList returns the process groups of the plan's targets, sorted:
// the caller lists each one's members and passes them to WithGroups.
func (p Plan) GroupsToList() []int {
	var pgids []int
	if !p.Act {
		return nil
	}
	for _, t := range p.Targets {
		if t.PGID > 0 && !slices.Contains(pgids, t.PGID) {
			pgids = append(pgids, t.PGID)
		}
	}
	slices.Sort(pgids)
	return pgids
}

// WithGroups applies the group rule to a plan that acts, and returns the
// plan with whole groups; s and cfg are those the plan was made from, and
// groups holds the members of GroupsToList's groups. A process group is
// killed whole only when every live member is a proven target: a member
// that is not (a job script, a helper, another user's process left in a
// group whose leader exited) is never signalled for being in it, and the
// targets are then signalled one by one through their pidfds. A group
// missing from groups is not killed whole.
func (p Plan) WithGroups(s *snapshot.Snapshot, cfg Config, groups map[int]Group) Plan {
	if !p.Act || s == nil {
		return p
	}
	cfg = cfg.withDefaults()
	p.Targets = slices.Clone(p.Targets)
	p.Groups, p.Notes = slices.Clone(p.Groups), slices.Clone(p.Notes)
	targeted := map[int]bool{}
	for _, t := range p.Targets {
		targeted[t.PID] = true
	}
	for _, pgid := range p.GroupsToList() {
		if pgid == cfg.Self.PGID || slices.Contains(p.Groups, pgid) {
			continue
		}
		if note := groupNotWhole(groups, targeted, pgid); note != "" {
			p.Notes = append(p.Notes, fmt.Sprintf("process group %d not killed whole, its targets signalled one by one: %s", pgid, note))
			continue
		}
		for i := range p.Targets {
			if p.Targets[i].PGID == pgid {
				p.Targets[i].WholeGroup = true
			}
		}
		p.Groups = append(p.Groups, pgid)
	}
	p.sort()
	return p
}

// groupNotWhole says why pgid may not be killed whole: a live member that
// is not a target, or members that could not be listed. "" when every
// member is a target.
func groupNotWhole(groups map[int]Group, targeted map[int]bool, pgid int) string {
	g, ok := groups[pgid]
	if !ok {
		return "its members were not listed"
	}
	if g.Err != nil {
		return fmt.Sprintf("listing its members: %v", g.Err)
	}
	for _, m := range g.Members {
		if m.PGID == pgid && !targeted[m.PID] {
			return fmt.Sprintf("member %d (%s) is not a proven target", m.PID, m.Comm)
		}
	}
	return ""
}

func (p *Plan) sort() {
	slices.SortFunc(p.Targets, func(a, b remediate.Target) int { return a.PID - b.PID })
	slices.SortFunc(p.Excluded, func(a, b remediate.Exclusion) int { return a.PID - b.PID })
}
