package hooks

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// RestoreAgentLineage restores into mem the lineage that the node agent
// keeps in st, if there is one of this boot; found is false when st holds
// none. The agent keeps writing it: the commands never do.
func RestoreAgentLineage(ctx context.Context, st *store.Store, mem *snapshot.Lineage, fs proc.FS) (found bool, err error) {
	data, ok, err := st.GetState(ctx, LineageState)
	if err != nil || !ok {
		return false, err
	}
	bootID, err := fs.BootID()
	if err != nil {
		return true, err
	}
	return true, mem.RestoreState(data, bootID)
}

// DescribeGPUs says which GPUs a snapshot shows: "it has GPUs 0-1",
// "it has GPUs 0, 2-3", "it has GPU 0", "it has no GPUs".
func DescribeGPUs(s *snapshot.Snapshot) string {
	var idx []int
	for _, g := range s.GPUs {
		idx = append(idx, g.Device.Index)
	}
	slices.Sort(idx)
	idx = slices.Compact(idx)
	switch len(idx) {
	case 0:
		return "it has no GPUs"
	case 1:
		return fmt.Sprintf("it has GPU %d", idx[0])
	}
	var runs []string
	for i := 0; i < len(idx); {
		j := i
		for j+1 < len(idx) && idx[j+1] == idx[j]+1 {
			j++
		}
		if j == i {
			runs = append(runs, strconv.Itoa(idx[i]))
		} else {
			runs = append(runs, fmt.Sprintf("%d-%d", idx[i], idx[j]))
		}
		i = j + 1
	}
	return "it has GPUs " + strings.Join(runs, ", ")
}

// Hostname is the node's name in the actions it records.
func Hostname() string {
	h, _ := os.Hostname()
	return h
}
