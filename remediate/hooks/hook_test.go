package hooks

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

func TestParseJobGPUs(t *testing.T) {
	t.Parallel()
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	for _, tc := range []struct {
		flag string
		env  map[string]string
		ids  []string
		all  bool
		from string
	}{
		{"", map[string]string{"SLURM_JOB_GPUS": "0,2", "CUDA_VISIBLE_DEVICES": "1"}, []string{"0", "2"}, false, "SLURM_JOB_GPUS"},
		{"", map[string]string{"CUDA_VISIBLE_DEVICES": "GPU-a,MIG-b", "GPU_DEVICE_ORDINAL": "3"}, []string{"GPU-a", "MIG-b"}, false, "CUDA_VISIBLE_DEVICES"},
		{"", map[string]string{"GPU_DEVICE_ORDINAL": "3, 3"}, []string{"3"}, false, "GPU_DEVICE_ORDINAL"},
		{"1", map[string]string{"SLURM_JOB_GPUS": "0"}, []string{"1"}, false, "--slurm.gpus"},
		{"all", nil, nil, true, "--slurm.gpus"},
		{"none", map[string]string{"SLURM_JOB_GPUS": "0"}, nil, false, "--slurm.gpus"},
		{"", nil, nil, false, "--slurm.gpus"},
	} {
		ids, all, from, err := ParseJobGPUs(tc.flag, env(tc.env))
		if err != nil || !slices.Equal(ids, tc.ids) || all != tc.all || from != tc.from {
			t.Errorf("ParseJobGPUs(%q, %v) = %v, %v, %s, %v; want %v, %v, %s", tc.flag, tc.env, ids, all, from, err, tc.ids, tc.all, tc.from)
		}
	}
}

func TestSize(t *testing.T) {
	t.Parallel()
	for b, want := range map[uint64]string{0: "0 MiB", 4104 << 20: "4 GiB", 40 << 30: "40 GiB", 1536 << 20: "1.5 GiB", 1023 << 20: "1023 MiB"} {
		if got := size(b); got != want {
			t.Errorf("size(%d) = %q, want %q", b, got, want)
		}
	}
}

// The context of a hook keeps a reserve for the record and the drain.
func TestHookContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := Context(20 * time.Second)
	defer cancel()
	d, ok := ctx.Deadline()
	if left := time.Until(d); !ok || left > 15*time.Second || left < 14*time.Second {
		t.Errorf("deadline in %v, want 15s (20s less a 5s reserve)", left)
	}
	cancel()
	if !errors.Is(ctx.Err(), context.Canceled) {
		t.Errorf("cancel: %v", ctx.Err())
	}
}
