package proc

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

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
		// FACTS.md's and Slurm's own paths, from the cgroup root.
		{"/slurm/uid_0/job_42/step_0", "42", "0"},
		{"/slurm_node17/uid_0/job_42/step_0", "42", "0"},
		{"/system.slice/slurmstepd.scope/job_42/step_0", "42", "0"},
		// Anchored at the root: elsewhere the same names are anyone's.
		{"/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_4242/step_0", "", ""},
		{"/user.slice/user-1000.slice/user@1000.service/app.slice/system.slice/slurmstepd.scope/job_4242/step_0", "", ""},
		{"/user.slice/user-1000.slice/user@1000.service/slurm/uid_0/job_4242/step_0", "", ""},
		{"/user.slice/user-1000.slice/user@1000.service/slurm_node17/uid_0/job_4242/step_0", "", ""},
		{"/user.slice/user-1000.slice/session-3.scope/slurm/uid_0/job_4242/step_0", "", ""},
		{"/system.slice/cron.service/slurmstepd.scope/job_4242/step_0", "", ""},
		{"/system.slice/cron.service/system.slice/slurmstepd.scope/job_4242/step_0", "", ""},
		{"/machine.slice/slurm/uid_0/job_4242/step_0", "", ""},
		{"/slurm/job_42/step_0", "", ""}, // v1 always has uid_<uid>
		{"/slurmstepd.scope/job_42/step_0", "", ""},
		// A container's own root is an anchor (slurmd in a pod), unless the
		// container sits in a user's subtree, where its name is made up too.
		{"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice/cri-containerd-" +
			"3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c.scope/system.slice/slurmstepd.scope/job_7/step_0", "7", "0"},
		{"/user.slice/user-1000.slice/user@1000.service/app.slice/docker-" +
			"3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c.scope/system.slice/slurmstepd.scope/job_4242/step_0", "", ""},
		// Read from a cgroup namespace of one's own (a container's): relative
		// to its root, up to the common ancestor.
		{"/../../system.slice/slurmstepd.scope/job_42/step_0", "42", "0"},
		{"/../slurmstepd.scope/job_42/step_0/user/task_0", "42", "0"},
		{"/../../../slurm/uid_0/job_42/step_batch", "42", "batch"},
		{"/../../user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_4242/step_0", "", ""},
		{"/../user@1000.service/slurmstepd.scope/job_4242/step_0", "", ""},
		{"/system.slice/../slurm/uid_0/job_42/step_0", "", ""}, // the kernel writes no such path
	} {
		job, step := parseSlurm(tc.path)
		if job != tc.job || step != tc.step {
			t.Errorf("parseSlurm(%q) = %q, %q; want %q, %q", tc.path, job, step, tc.job, tc.step)
		}
	}
}

// TestSlurmJobInUsersSubtree: a real process in the cgroup v2 path that an
// unprivileged user can make in the subtree systemd delegates to them,
// user@UID.service/slurmstepd.scope/job_4242/step_0, was reported as Slurm
// job 4242; so was one in user@UID.service/kubepods.slice/... as a pod. Now
// neither is attributed, while slurmd's own path, from the root, still is.
func TestSlurmJobInUsersSubtree(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	const pod = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
	userJob, realJob := testenv.SlurmJobID(), testenv.SlurmJobID()
	delegated := "user.slice/user-1000.slice/user@1000.service/"
	for _, tc := range []struct {
		name, rel, job, pod string
	}{
		{"slurmstepd.scope in a user's subtree", delegated + "slurmstepd.scope/job_" + userJob + "/step_0", "", ""},
		{"kubepods.slice in a user's subtree", delegated + "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" +
			strings.ReplaceAll(pod, "-", "_") + ".slice", "", ""},
		{"slurmd's", testenv.SlurmV2Step(realJob), realJob, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command("sleep", "60")
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			testenv.IntoCgroup(t, testenv.CgroupV2, tc.rel, cmd.Process.Pid)
			p, err := fs.Process(cmd.Process.Pid)
			if err != nil {
				t.Fatal(err)
			}
			if p.Cgroup != "/"+tc.rel || p.SlurmJob != tc.job || p.Pod != tc.pod {
				t.Errorf("process in %s: Slurm job %q, pod %q; want %q, %q", p.Cgroup, p.SlurmJob, p.Pod, tc.job, tc.pod)
			}
		})
	}
}
