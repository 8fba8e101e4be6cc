package proc

import "testing"

// The layouts of slurmd's cgroup plugins, as Slurm's documentation shows
// them (cgroup/v1: /sys/fs/cgroup/<controller>/slurm/uid_U/job_J/step_S;
// cgroup/v2: the slurmstepd scope under system.slice).
func TestParseSlurm(t *testing.T) {
	for _, tc := range []struct {
		path, job, step string
	}{
		{"/slurm/uid_1000/job_81234/step_0/task_0", "81234", "0"},
		{"/slurm/uid_1000/job_81234/step_batch", "81234", "batch"},
		{"/slurm/uid_1000/job_81234/step_extern/task_0", "81234", "extern"},
		{"/slurm/uid_1000/job_81234", "81234", ""},
		{"/slurm_node17/uid_1000/job_5/step_interactive", "5", "interactive"},
		{"/system.slice/slurmstepd.scope/job_81234/step_0/user/task_0", "81234", "0"},
		{"/system.slice/slurmstepd.scope/job_81234/step_batch/user/task_0", "81234", "batch"},
		{"/system.slice/node17_slurmstepd.scope/job_9/step_3/user/task_1", "9", "3"},
		{"/system.slice/slurmstepd.scope/system", "", ""},
		// Not Slurm: a job_ segment alone proves nothing.
		{"/user.slice/job_81234/step_0", "", ""},
		{"/kubepods.slice/kubepods-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice", "", ""},
		{"/slurm/uid_1000/job_x1/step_0", "", ""},
		{"/slurm/uid_1000/job_81234/step_../", "81234", ""},
		{"/", "", ""},
		{"", "", ""},
	} {
		job, step := parseSlurm(tc.path)
		if job != tc.job || step != tc.step {
			t.Errorf("parseSlurm(%q) = %q, %q; want %q, %q", tc.path, job, step, tc.job, tc.step)
		}
	}
}
