package proc

import (
	"fmt"
	"os"
	"path/filepath"
)

// PIDNamespace names the PID namespace the procfs shows, e.g.
// "pid:[4026531836]". It reads <root>/1/ns/pid: PID 1 of a procfs's own
// namespace always lives in it, whereas <root>/self is the reader, who may
// sit in another namespace when the host's /proc is mounted in a container.
// PIDs read through this FS name processes of that namespace only.
func (fs FS) PIDNamespace() (string, error) {
	ns, err := os.Readlink(filepath.Join(fs.root, "1", "ns", "pid"))
	if err != nil {
		return "", fmt.Errorf("pid namespace: %w", err)
	}
	return ns, nil
}

// SelfNSpid is the reading process's PID in each nested PID namespace,
// outermost first, from <root>/self/status (for log lines).
func (fs FS) SelfNSpid() ([]int, error) {
	self, err := fs.proc.Self()
	if err != nil {
		return nil, fmt.Errorf("%s/self: %w", fs.root, err)
	}
	st, err := self.NewStatus()
	if err != nil {
		return nil, fmt.Errorf("%s/self/status: %w", fs.root, err)
	}
	pids := make([]int, 0, len(st.NSpids))
	for _, p := range st.NSpids {
		pids = append(pids, int(p))
	}
	return pids, nil
}
