package hooks

import (
	"os/user"
	"strconv"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// jobRef is the job on the hook's records (Action.Job): its ID, and its
// user by UID and by name. The name is the node's (os/user, as the
// snapshot names processes' users); the UID as a number when the node
// cannot name it, so that `gpu-orphan report --by user` still tells the
// users apart.
func (h *hook) jobRef() *remediate.JobRef {
	j := &remediate.JobRef{SlurmJob: h.job.ID}
	if h.job.UID < 0 {
		return j
	}
	uid := h.job.UID
	j.UID, j.User = &uid, userName(uid)
	return j
}

// userName is the name of uid on this node, or uid as a number.
func userName(uid int) string {
	n := strconv.Itoa(uid)
	if u, err := user.LookupId(n); err == nil && u.Username != "" {
		return u.Username
	}
	return n
}
