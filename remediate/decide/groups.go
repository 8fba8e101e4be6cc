package decide

import (
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// GroupLister lists the live processes of a process group, a zombie leader
// whose other threads run among them.
type GroupLister interface {
	Members(pgid int) ([]proc.Process, error)
}

// ProcGroups lists process groups by scanning every PID of a procfs.
type ProcGroups struct {
	FS proc.FS
}

var _ GroupLister = ProcGroups{}

// Members lists the process group through proc.FS.GroupMembers.
func (g ProcGroups) Members(pgid int) ([]proc.Process, error) { return g.FS.GroupMembers(pgid) }
