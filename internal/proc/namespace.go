package proc

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// PIDNamespace names the PID namespace the procfs shows, e.g.
// "pid:[4026531836]". It reads <root>/1/ns/pid: PID 1 of a procfs's own
// namespace always lives in it, whereas <root>/self is the reader, who may
// sit in another namespace when the host's /proc is mounted in a container.
// PIDs read through this FS name processes of that namespace only.
//
// Reading PID 1's link needs ptrace access to it, which some hosts deny
// even to root. Then two other facts still tell: kernel threads (kthreadd
// is PID 2, child of PID 0) show only in the initial namespace, and a
// reader whose NSpid has one entry lives in the procfs's own namespace.
func (fs FS) PIDNamespace() (string, error) {
	ns, err := os.Readlink(filepath.Join(fs.root, "1", "ns", "pid"))
	if err == nil {
		return ns, nil
	}
	if st, serr := os.ReadFile(filepath.Join(fs.root, "2", "stat")); serr == nil && strings.HasPrefix(string(st), "2 (kthreadd) S 0 ") {
		return initPIDNamespace, nil
	}
	if nspid, nerr := fs.SelfNSpid(); nerr == nil && len(nspid) == 1 {
		if self, lerr := os.Readlink(filepath.Join(fs.root, "self", "ns", "pid")); lerr == nil {
			return self, nil
		}
	}
	return "", fmt.Errorf("pid namespace: %w", err)
}

// initPIDNamespace is the kernel's fixed name of the initial PID namespace
// (PROC_PID_INIT_INO).
const initPIDNamespace = "pid:[4026531836]"

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
