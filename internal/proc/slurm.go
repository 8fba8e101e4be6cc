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
// <step> is a number or batch, extern, interactive. A path that has no
// Slurm root segment names no job, whatever its other segments say.
func parseSlurm(path string) (job, step string) {
	inSlurm := false
	for seg := range strings.SplitSeq(path, "/") {
		switch {
		case seg == "slurm" || strings.HasPrefix(seg, "slurm_") ||
			seg == "slurmstepd.scope" || strings.HasSuffix(seg, "_slurmstepd.scope"):
			inSlurm = true
		case !inSlurm:
		case job == "":
			if j, ok := strings.CutPrefix(seg, "job_"); ok && isDigits(j) {
				job = j
			}
		default:
			if s, ok := strings.CutPrefix(seg, "step_"); ok && isStep(s) {
				return job, s
			}
			return job, ""
		}
	}
	return job, ""
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
