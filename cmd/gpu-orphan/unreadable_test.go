package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// node is a snapshot of two GPUs. GPU 0 has a dead owner whose PID now
// belongs to an unrelated process, and no suspect; GPU 1 has a live owner
// whose main thread has exited.
func node(denied int, shielded ...int) *snapshot.Snapshot {
	s := &snapshot.Snapshot{
		Taken: time.Unix(1_800_000_000, 0), Driver: "sim", HostPIDsVisible: true,
		Sources:      []snapshot.Source{{Name: "sim"}, {Name: snapshot.SourceProc}, {Name: snapshot.SourceFDScan}},
		FDScanDenied: denied, FDScanShielded: shielded,
		GPUs: []snapshot.GPU{
			{
				Device: gpu.Device{Index: 0, UUID: "GPU-0", Name: "NVIDIA H200"},
				Memory: gpu.Memory{Used: 1032 * gpu.MiB},
				Owners: []snapshot.Owner{{PID: 4000, UsedBytes: 1024 * gpu.MiB,
					ReusedBy: &proc.Process{PID: 4000, Comm: "sleep", StartTime: 123456}}},
				OwnedDeadBytes: 1024 * gpu.MiB, UnownedBytes: 1032 * gpu.MiB, Scanned: true,
			},
			{
				Device: gpu.Device{Index: 1, UUID: "GPU-1", Name: "NVIDIA H200", Minor: 1},
				Memory: gpu.Memory{Used: 2056 * gpu.MiB},
				Owners: []snapshot.Owner{{PID: 5000, UsedBytes: 2048 * gpu.MiB, Alive: true,
					Process: &proc.Process{PID: 5000, State: "Z", LeaderExited: true, Comm: "python3"}}},
				OwnedLiveBytes: 2048 * gpu.MiB, UnownedBytes: 8 * gpu.MiB, Scanned: true,
				HolderPIDs: []int{5000}, Holders: []snapshot.Holding{{Process: proc.Process{PID: 5000}, Mapped: true}},
			},
		},
	}
	if denied > 0 {
		s.Sources[2].Err = fmt.Errorf("%w: %d processes", snapshot.ErrScanIncomplete, denied)
	}
	return s
}

func devicePath(minor int) string { return fmt.Sprintf("/dev/nvidia%d", minor) }

func TestTableWarnsWhenDescriptorsUnreadable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		s      *snapshot.Snapshot
		want   []string
		absent []string
	}{
		{
			name: "complete scan",
			s:    node(0),
			want: []string{
				"  no suspect holders (0 processes hold the device)\n",
				"4000 1024 MiB (DEAD: PID now belongs to 4000 sleep, which holds no descriptor of this GPU)",
				"5000 2048 MiB (alive, main thread exited)",
			},
			absent: []string{"WARNING", "NOT PROVEN", "security policy"},
		},
		{
			name: "unreadable descriptors",
			s:    node(7),
			want: []string{
				"WARNING: the descriptors of 7 processes could not be read (run as root, or with CAP_SYS_PTRACE): holders may be missing, so 'no suspect holders' is not proven.\n",
				"  WARNING: holders may be missing: the descriptors of 7 processes could not be read.\n",
				"  no suspect holders found, NOT PROVEN (0 readable processes hold the device)\n",
			},
			absent: []string{"  no suspect holders ("},
		},
		{
			name:   "shielded only",
			s:      node(0, 1),
			want:   []string{"note: a security policy hides the descriptors of PID 1 even from CAP_SYS_PTRACE"},
			absent: []string{"WARNING", "NOT PROVEN"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b strings.Builder
			writeTable(&b, NewReport(tc.s, devicePath))
			out := b.String()
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("missing %q in:\n%s", w, out)
				}
			}
			for _, a := range tc.absent {
				if strings.Contains(out, a) {
					t.Errorf("unexpected %q in:\n%s", a, out)
				}
			}
			if n := strings.Count(out, "WARNING: holders may be missing"); tc.s.FDScanDenied > 0 && n != len(tc.s.GPUs) {
				t.Errorf("the warning is under %d GPUs, want every one of %d:\n%s", n, len(tc.s.GPUs), out)
			}
		})
	}
}

// TestReportJSONFields pins the names scripts read.
func TestReportJSONFields(t *testing.T) {
	t.Parallel()
	b, err := json.Marshal(NewReport(node(7, 1), devicePath))
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Unreadable *int  `json:"fdscan_unreadable_processes"`
		Shielded   []int `json:"fdscan_shielded_pids"`
		GPUs       []struct {
			Owners []map[string]any `json:"owners"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.Unreadable == nil || *got.Unreadable != 7 || len(got.Shielded) != 1 || got.Shielded[0] != 1 {
		t.Errorf("fdscan_unreadable_processes %v, fdscan_shielded_pids %v; want 7, [1]:\n%s", got.Unreadable, got.Shielded, b)
	}
	dead, live := got.GPUs[0].Owners[0], got.GPUs[1].Owners[0]
	want := map[string]any{"pid": 4000.0, "comm": "sleep", "start_time": 123456.0}
	if r, _ := dead["reused_by"].(map[string]any); fmt.Sprint(r) != fmt.Sprint(want) || dead["alive"] != false {
		t.Errorf("dead owner %v: want alive false and reused_by %v", dead, want)
	}
	if _, ok := dead["leader_exited"]; ok {
		t.Errorf("leader_exited on a dead owner: %v", dead)
	}
	if live["leader_exited"] != true || live["alive"] != true || live["reused_by"] != nil {
		t.Errorf("live owner %v: want alive and leader_exited true, no reused_by", live)
	}

	// A complete scan still says 0, and omits what does not apply.
	b, err = json.Marshal(NewReport(node(0), devicePath))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"fdscan_unreadable_processes":0`) || strings.Contains(string(b), "fdscan_shielded_pids") {
		t.Errorf("complete scan: %s", b)
	}
}
