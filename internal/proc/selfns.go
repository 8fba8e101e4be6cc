package proc

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ErrForeignPIDNamespace is wrapped by CheckOwnPIDNamespace's error when
// the caller is not in the PID namespace that the procfs shows.
var ErrForeignPIDNamespace = errors.New("not in the PID namespace that the procfs shows")

// CheckOwnPIDNamespace reports whether the calling process lives in the PID
// namespace that this procfs shows. Signals (kill, pidfd_open) take PIDs of
// the caller's own namespace, while the PIDs read here, and NVML's, are
// those of the procfs's: when the two differ, a PID read here names
// another process, or none, for the kernel calls that signal. Two facts
// prove the namespace the same:
//   - <root>/self resolves to our own getpid(). A procfs of an ancestor
//     namespace resolves it to our PID there; one of a namespace we are not
//     in (a sibling, a child) has no self for us at all.
//   - the NSpid line of <root>/self/status has one entry: our PID in the
//     procfs's namespace and in each namespace below it, down to ours.
//
// The error says what is wrong and what to do.
func (fs FS) CheckOwnPIDNamespace() error {
	return checkOwnPIDNamespace(fs.root, os.Getpid())
}

// checkOwnPIDNamespace is CheckOwnPIDNamespace for the process whose
// getpid() is pid.
func checkOwnPIDNamespace(root string, pid int) error {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s; our PIDs and the procfs's differ, so a PID read from it may name another process for kill(2) and pidfd_open(2). "+
			"Run in the PID namespace of that procfs (the host's: Kubernetes hostPID: true, docker --pid=host, no PrivatePIDs= in systemd), with --path.procfs at its /proc",
			ErrForeignPIDNamespace, fmt.Sprintf(format, args...))
	}
	self := filepath.Join(root, "self")
	target, err := os.Readlink(self)
	if errors.Is(err, os.ErrNotExist) {
		return fail("%s does not exist: this process (PID %d) is not visible in the PID namespace of %s", self, pid, root)
	}
	if err != nil {
		return fmt.Errorf("checking the PID namespace of %s: %w", root, err)
	}
	selfPID, err := strconv.Atoi(filepath.Base(target))
	if err != nil {
		return fmt.Errorf("checking the PID namespace of %s: %s points to %q, not a PID", root, self, target)
	}
	if selfPID != pid {
		return fail("%s is PID %d, but this process is PID %d in its own PID namespace", self, selfPID, pid)
	}
	f, err := os.Open(filepath.Join(self, "status"))
	if err != nil {
		return fmt.Errorf("checking the PID namespace of %s: %w", root, err)
	}
	defer f.Close()
	nspid, err := parseNSpid(f)
	if err != nil {
		return fmt.Errorf("checking the PID namespace of %s: %s/status: %w", root, self, err)
	}
	if len(nspid) != 1 {
		return fail("the NSpid line of %s/status is %v: this process sits %d PID namespaces below the one %s shows", self, nspid, len(nspid)-1, root)
	}
	return nil
}

// parseNSpid returns the PIDs of the NSpid line of a /proc/PID/status,
// outermost namespace first. A status without that line (kernels before
// 4.1) cannot prove the namespace, and is an error.
func parseNSpid(r io.Reader) ([]int, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "NSpid:")
		if !ok {
			continue
		}
		var pids []int
		for _, f := range strings.Fields(rest) {
			p, err := strconv.Atoi(f)
			if err != nil || p <= 0 {
				return nil, fmt.Errorf("bad NSpid line %q", sc.Text())
			}
			pids = append(pids, p)
		}
		if len(pids) == 0 {
			return nil, fmt.Errorf("empty NSpid line")
		}
		return pids, nil
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("no NSpid line (a kernel before 4.1?): the PID namespace cannot be checked")
}
