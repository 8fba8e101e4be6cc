package slurm

import "testing"

func TestParseNode(t *testing.T) {
	for _, tc := range []struct {
		out     string
		want    NodeState
		ours    bool
		wantErr bool
	}{
		{out: "idle|none\n", want: NodeState{State: "idle"}},
		{out: "drained|gpu-orphan: GPU 0 holds 40 GiB with no owner\n", want: NodeState{State: "drained", Reason: "gpu-orphan: GPU 0 holds 40 GiB with no owner"}, ours: true},
		{out: "draining|gpu-orphan: GPU 1 holds 2 GiB with no owner\ndraining|gpu-orphan: GPU 1 holds 2 GiB with no owner\n",
			want: NodeState{State: "draining", Reason: "gpu-orphan: GPU 1 holds 2 GiB with no owner"}, ours: true},
		{out: "drained*|gpu-orphan: a|b\n", want: NodeState{State: "drained", Reason: "gpu-orphan: a|b"}, ours: true},
		// Drained by a person, or for Slurm's own reasons: not ours.
		{out: "drained|bad DIMM\n", want: NodeState{State: "drained", Reason: "bad DIMM"}},
		{out: "drained|Epilog error\n", want: NodeState{State: "drained", Reason: "Epilog error"}},
		// The reason stays after a resume, until it is cleared: not drained.
		{out: "idle|gpu-orphan: GPU 0 holds 40 GiB with no owner\n", want: NodeState{State: "idle", Reason: "gpu-orphan: GPU 0 holds 40 GiB with no owner"}},
		{out: "", wantErr: true},
		{out: "sinfo: error: no such node\n", wantErr: true},
	} {
		got, err := ParseNode(tc.out)
		if (err != nil) != tc.wantErr {
			t.Errorf("%q: err %v, want error %v", tc.out, err, tc.wantErr)
			continue
		}
		if got != tc.want || got.ByGPUOrphan() != tc.ours {
			t.Errorf("%q: %+v (ours %v), want %+v (ours %v)", tc.out, got, got.ByGPUOrphan(), tc.want, tc.ours)
		}
	}
}
