package exporter

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/promslog"

	"github.com/gpu-orphan/gpu-orphan/internal/slurm"
)

// TestSlurmDrain: gpu_orphan_slurm_node_drained is 1 with the reason only
// for a drain that gpu-orphan set; a failed read says nothing of the drain;
// scrapes read the latest answer and never ask sinfo themselves.
func TestSlurmDrain(t *testing.T) {
	const head = `
# HELP gpu_orphan_slurm_node_drained 1 while Slurm keeps this node drained (or draining) with a reason that gpu-orphan's prolog or epilog set (it starts "gpu-orphan: "), with that reason; 0 when not drained by gpu-orphan.
# TYPE gpu_orphan_slurm_node_drained gauge
`
	const ok = `
# HELP gpu_orphan_slurm_read_success 1 if sinfo answered for this node at the latest read, 0 if not.
# TYPE gpu_orphan_slurm_read_success gauge
gpu_orphan_slurm_read_success 1
`
	for _, tc := range []struct {
		name  string
		state slurm.NodeState
		err   error
		want  string
	}{
		{name: "drained by gpu-orphan", state: slurm.NodeState{State: "drained", Reason: "gpu-orphan: GPU 0 holds 40 GiB with no owner"},
			want: head + `gpu_orphan_slurm_node_drained{reason="gpu-orphan: GPU 0 holds 40 GiB with no owner"} 1` + ok},
		{name: "drained by a person", state: slurm.NodeState{State: "drained", Reason: "bad DIMM"}, want: head + `gpu_orphan_slurm_node_drained{reason=""} 0` + ok},
		{name: "resumed", state: slurm.NodeState{State: "idle", Reason: "gpu-orphan: GPU 0 holds 40 GiB with no owner"},
			want: head + `gpu_orphan_slurm_node_drained{reason=""} 0` + ok},
		{name: "sinfo failed", err: errors.New("slurm_load_node: Unable to contact slurm controller"), want: `
# HELP gpu_orphan_slurm_read_success 1 if sinfo answered for this node at the latest read, 0 if not.
# TYPE gpu_orphan_slurm_read_success gauge
gpu_orphan_slurm_read_success 0
`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reads := 0
			d := NewSlurmDrain(SlurmConfig{Node: "n1", MaxAge: time.Hour, Logger: promslog.NewNopLogger()})
			d.read = func(context.Context) (slurm.NodeState, error) { reads++; return tc.state, tc.err }
			if err := testutil.CollectAndCompare(d, strings.NewReader("")); err != nil {
				t.Fatalf("before sinfo answered: %v", err)
			}
			d.refresh(context.Background())
			for range 3 {
				if err := testutil.CollectAndCompare(d, strings.NewReader(tc.want)); err != nil {
					t.Fatal(err)
				}
			}
			if reads != 1 {
				t.Errorf("sinfo was asked %d times for 3 scrapes after one refresh, want 1", reads)
			}
			if problems, err := testutil.CollectAndLint(d); err != nil || len(problems) > 0 {
				t.Errorf("lint: %v %v", problems, err)
			}
		})
	}
}
