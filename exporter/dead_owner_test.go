package exporter_test

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

const (
	testPodUID    = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
	testContainer = "3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c3f4e2d1c"
)

// metricsURL starts an exporter on the node and returns its metrics URL.
func metricsURL(t *testing.T, root string) string {
	t.Helper()
	return startExporter(t, root, "--collector.interval=200ms").url
}

// deadOwner waits for the exporter to list pid as a dead owner and returns
// the series' labels.
func deadOwner(t *testing.T, url string, pid int) map[string]string {
	t.Helper()
	labels := map[string]string{}
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("gpu_orphan_dead_owner_info for PID %d", pid), func() bool {
		_, mfs := testenv.Scrape(t, url)
		ms := testenv.Series(mfs, "gpu_orphan_dead_owner_info", map[string]string{"pid": strconv.Itoa(pid)})
		if len(ms) != 1 {
			return false
		}
		for _, l := range ms[0].GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		return true
	})
	return labels
}

// waitOwned waits until the exporter has seen pid alive, owning memory.
func waitOwned(t *testing.T, url string, pid int) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "the exporter to see the owner alive", func() bool {
		_, mfs := testenv.Scrape(t, url)
		return len(testenv.Series(mfs, "gpu_orphan_process_memory_bytes", map[string]string{"pid": strconv.Itoa(pid), "alive": "true"})) == 1
	})
}

// waitSnapshotAfter waits until the exporter publishes a snapshot taken
// after at.
func waitSnapshotAfter(t *testing.T, url string, at time.Time) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "a snapshot taken after "+at.Format(time.StampMilli), func() bool {
		_, mfs := testenv.Scrape(t, url)
		taken, ok := testenv.Value(mfs, "gpu_orphan_snapshot_timestamp_seconds", nil)
		return ok && taken > float64(at.UnixNano())/1e9
	})
}

// TestDeadOwnerIdentity: a job runs under the cgroup that Slurm (v1 and v2)
// or the kubelet gives it, and is killed with -9 while a forked worker
// keeps its context. The exporter that saw it alive names it; one started
// after it died says it does not know.
func TestDeadOwnerIdentity(t *testing.T) {
	t.Parallel()
	jobV2, jobV1 := testenv.SlurmJobID(), testenv.SlurmJobID()
	for _, tc := range []struct {
		name, mount, rel string
		want             map[string]string
	}{
		{"slurm cgroup v2", testenv.CgroupV2, testenv.SlurmV2Step(jobV2),
			map[string]string{"slurm_job": jobV2, "pod_uid": "", "container_id": ""}},
		{"slurm cgroup v1", testenv.CgroupV1, "slurm/uid_0/job_" + jobV1 + "/step_batch/task_0",
			map[string]string{"slurm_job": jobV1, "pod_uid": "", "container_id": ""}},
		{"kubernetes", testenv.CgroupV2, "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" +
			strings.ReplaceAll(testPodUID, "-", "_") + ".slice/cri-containerd-" + testContainer + ".scope",
			map[string]string{"slurm_job": "", "pod_uid": testPodUID, "container_id": testContainer}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each its own node, job and cgroup
			root := testenv.SimNode(t, 2)
			w := testenv.StartWorkload(t, root, 1, 1024, 1)
			testenv.IntoCgroup(t, tc.mount, tc.rel, w.PID)
			// The exporter starts after the move: the snapshot that
			// waitOwned sees is a look at the owner in its cgroup.
			url := metricsURL(t, root)
			waitOwned(t, url, w.PID)
			w.KillParent(t)

			got := deadOwner(t, url, w.PID)
			want := map[string]string{"comm": "gpu-orphan-sim", "user": "root", "gpu": "1"}
			for k, v := range tc.want {
				want[k] = v
			}
			for k, v := range want {
				if got[k] != v {
					t.Errorf("dead owner label %s = %q, want %q (all: %v)", k, got[k], v, got)
				}
			}

			// gpu-orphan ps starts after the death: it asks the exporter.
			d := psDeadOwner(t, root, url, w.PID)
			if !d.Known || d.Comm != "gpu-orphan-sim" || d.SlurmJob != want["slurm_job"] || d.PodUID != want["pod_uid"] {
				t.Errorf("ps -o json dead_owner = %+v, want the exporter's identity %v", d, want)
			}

			lateURL := metricsURL(t, root)
			late := deadOwner(t, lateURL, w.PID)
			for _, k := range []string{"comm", "user", "slurm_job", "pod_uid", "container_id"} {
				if late[k] != "" {
					t.Errorf("an exporter started after the owner died guessed %s=%q", k, late[k])
				}
			}
			if d := psDeadOwner(t, root, lateURL, w.PID); d.Known || !strings.Contains(d.Unknown, "exporter started after the owner died") {
				t.Errorf("ps asking the late exporter: %+v, want unknown (exporter started after the owner died)", d)
			}
		})
	}
}

// psOwner is a dead owner as gpu-orphan ps -o json names it, and the
// table's output.
type psOwner struct {
	Known    bool   `json:"known"`
	Comm     string `json:"comm"`
	User     string `json:"user"`
	SlurmJob string `json:"slurm_job"`
	PodUID   string `json:"pod_uid"`
	Unknown  string `json:"unknown"`
	Table    string `json:"-"`
}

// psDeadOwner runs gpu-orphan ps -o json against the exporter at url and
// returns the dead owner pid's identity.
func psDeadOwner(t *testing.T, root, url string, pid int) psOwner {
	t.Helper()
	var d psOwner
	args := []string{"ps", "--backend=sim", "--sim.root=" + root, "--exporter.url=" + url}
	out, _ := exec.Command(testenv.Bin(t, "gpu-orphan"), append(args, "-o", "json")...).Output()
	var r struct {
		GPUs []struct {
			Owners []struct {
				PID       int      `json:"pid"`
				DeadOwner *psOwner `json:"dead_owner"`
			} `json:"owners"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("ps -o json: %v\n%s", err, out)
	}
	for _, g := range r.GPUs {
		for _, o := range g.Owners {
			if o.PID == pid && o.DeadOwner != nil {
				d = *o.DeadOwner
			}
		}
	}
	table, _ := exec.Command(testenv.Bin(t, "gpu-orphan"), args...).Output()
	d.Table = string(table)
	if !strings.Contains(d.Table, fmt.Sprintf("left by PID %d: ", pid)) {
		t.Errorf("ps does not say who left the memory:\n%s", table)
	}
	return d
}

// TestDeadOwnerPIDReused: the dead owner's PID is given to an unrelated
// process; the dead owner keeps its own identity, and the newcomer is
// never named as the owner.
func TestDeadOwnerPIDReused(t *testing.T) {
	root := testenv.SimNode(t, 2)
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 1024 --children 1 & wait", testenv.Bin(t, "gpu-orphan-sim"), root))
	w := script.Ready(t)
	url := metricsURL(t, root)
	waitOwned(t, url, w.PID)
	if err := syscall.Kill(w.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testenv.WaitGone(t, w.PID)
	testenv.StartWithPID(t, w.PID, func() *exec.Cmd {
		c := exec.Command("sleep", "300")
		c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return c
	})
	waitSnapshotAfter(t, url, time.Now()) // one with the newcomer in place
	got := deadOwner(t, url, w.PID)
	if got["comm"] != "gpu-orphan-sim" {
		t.Errorf("dead owner %d named %q, want the dead trainer gpu-orphan-sim, never the newcomer", w.PID, got["comm"])
	}
}
