package sim

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// WriteStatus prints, for humans, each GPU's memory and live contexts, and
// whether each context's creator still exists.
func WriteStatus(w io.Writer, root string) error {
	n, err := Load(root)
	if err != nil {
		return err
	}
	ctxs, err := listContexts(n)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "node %s, PID namespace %s\n", n.Root, n.PIDNamespace)
	f, err := readFaults(n.Root)
	if err != nil {
		fmt.Fprintf(w, "faults: %v\n", err)
	} else if f.Error != "" || f.Delay > 0 {
		fmt.Fprintf(w, "faults: error %q on gpu %d, delay %v\n", f.Error, f.GPU, f.Delay)
	}
	for _, g := range n.GPUs {
		fmt.Fprintf(w, "GPU %d %s %s, device %s\n", g.Index, g.UUID, g.Name, n.DevicePath(g.Minor))
		r := reading(g, ctxs, f.leaked(g.Index))
		if r.Unsupported != "" {
			fmt.Fprintf(w, "  unsupported: %s\n", r.Unsupported)
			continue
		}
		m := r.Memory
		fmt.Fprintf(w, "  memory MiB: total %d, reserved %d, used %d, free %d\n",
			m.Total/gpu.MiB, m.Reserved/gpu.MiB, m.Used/gpu.MiB, m.Free/gpu.MiB)
		if b := f.leaked(g.Index); b > 0 {
			fmt.Fprintf(w, "  leaked (fault): %d MiB used with no process holding it\n", b/gpu.MiB)
		}
		for _, c := range ctxs {
			if c.GPU == g.Index {
				fmt.Fprintf(w, "  context of pid %d (%s): %d MiB, %s\n",
					c.PID, creatorState(c), c.UsedBytes/gpu.MiB, filepath.Base(c.Path))
			}
		}
	}
	return nil
}

// creatorState says whether the process NVML names as the owner exists.
func creatorState(c Context) string {
	st, err := readProcStat(c.PID)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return "gone; an inherited descriptor holds the context"
	case err != nil:
		return "unknown: " + err.Error()
	case st.StartTime != c.StartTime:
		return "gone; its PID now names another process"
	case st.State == "Z" && !leaderExited(c.PID):
		return "zombie; an inherited descriptor holds the context"
	case st.State == "Z":
		return "alive (its main thread exited; other threads run)"
	default:
		return "alive"
	}
}

// leaderExited reports whether pid's main thread exited while another
// thread runs: a process lives while any of its threads does.
func leaderExited(pid int) bool {
	fs, err := proc.NewFS("")
	if err != nil {
		return false
	}
	p, err := fs.Process(pid)
	return err == nil && p.LeaderExited
}
