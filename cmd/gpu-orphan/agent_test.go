package main

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// waitInherited waits until the node agent whose store is at storePath has
// recorded each of pids as a proven inheritor of a dead owner's context
// (its saved lineage, which `gpu-orphan clean` and the hooks read).
func waitInherited(t testing.TB, storePath string, pids ...int) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("the node agent to record %v as inheritors", pids), func() bool {
		st, err := store.OpenReadOnly(context.Background(), storePath)
		if err != nil {
			return false
		}
		defer st.Close()
		data, ok, err := st.GetState(context.Background(), "lineage")
		if err != nil || !ok {
			return false
		}
		var saved struct {
			Inherited []struct {
				Procs [][2]uint64 `json:"procs"`
			} `json:"inherited"`
		}
		if json.Unmarshal(data, &saved) != nil {
			return false
		}
		for _, pid := range pids {
			found := false
			for _, d := range saved.Inherited {
				for _, p := range d.Procs {
					found = found || int(p[0]) == pid
				}
			}
			if !found {
				return false
			}
		}
		return true
	})
}
