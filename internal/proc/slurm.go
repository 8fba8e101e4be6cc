package proc

import "strings"

// parseSlurm returns the Slurm job and step that a cgroup path names, or ""
// for each that it does not. slurmd's cgroup plugins place a step's tasks
// at (Slurm's cgroup documentation, cgroup.conf and cgroup_v2):
//
//	v1: /slurm/uid_<uid>/job_<job>/step_<step>/task_<n>
//	    /slurm_<nodename>/uid_<uid>/job_<job>/step_<step>/...  (several slurmd per host)
//	v2: /system.slice/slurmstepd.scope/job_<job>/step_<step>/user/task_<n>
//	    /system.slice/<nodename>_slurmstepd.scope/job_<job>/...
//
// <step> is a number or batch, extern, interactive. Those are the paths
// from the cgroup root, or from a container's (slurmd in a pod), never
// under a user's delegated subtree (cgroupAnchors): a user may create
// /user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_4242
// there, and it is no job of Slurm's. A reader in a cgroup namespace of
// its own sees a v2 job as ../slurmstepd.scope/job_<job>/..., relative to
// the system.slice it shares.
func parseSlurm(path string) (job, step string) {
	segs, up := cgroupSegments(path)
	for _, a := range cgroupAnchors(segs) {
		if j, s := slurmAt(segs[a:], a == 0 && up > 0); j != "" {
			job, step = j, s
		}
	}
	return job, step
}

// slurmAt matches slurmd's layout at the start of segs; partial allows the
// v2 scope's system.slice to be hidden above it (a relative path).
func slurmAt(segs []string, partial bool) (job, step string) {
	var rest []string
	switch {
	case len(segs) >= 3 && (segs[0] == "slurm" || strings.HasPrefix(segs[0], "slurm_")) && isUID(segs[1]):
		rest = segs[2:]
	case len(segs) >= 3 && segs[0] == "system.slice" && isStepdScope(segs[1]):
		rest = segs[2:]
	case len(segs) >= 2 && partial && isStepdScope(segs[0]):
		rest = segs[1:]
	default:
		return "", ""
	}
	j, ok := strings.CutPrefix(rest[0], "job_")
	if !ok || !isDigits(j) {
		return "", ""
	}
	if len(rest) > 1 {
		if s, ok := strings.CutPrefix(rest[1], "step_"); ok && isStep(s) {
			return j, s
		}
	}
	return j, ""
}

func isStepdScope(seg string) bool {
	return seg == "slurmstepd.scope" || strings.HasSuffix(seg, "_slurmstepd.scope")
}

func isUID(seg string) bool {
	u, ok := strings.CutPrefix(seg, "uid_")
	return ok && isDigits(u)
}

func isStep(s string) bool {
	switch s {
	case "batch", "extern", "interactive":
		return true
	}
	return isDigits(s)
}

func isDigits(s string) bool {
	if s == "" || len(s) > 20 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
