package proc

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/prometheus/procfs"
)

// maxCmdline caps Process.Cmdline: enough to recognise a job in a log line
// or a label, bounded whatever argv holds.
const maxCmdline = 256

// Process reads the identity of process pid. When the process does not
// exist, or exits while it is read, errors.Is(err, ErrNotExist) holds.
// A zombie is returned without error; see Process.Zombie and FS.Alive.
func (fs FS) Process(pid int) (Process, error) {
	p, err := fs.proc.Proc(pid)
	if err != nil {
		return Process{}, fs.wrap(pid, "", err)
	}
	// cgroup and cmdline are read before stat: a thread's exit flag, once
	// set, stays, so a stat without it proves they were read before the
	// exit began (see inExit).
	cgs, err := p.Cgroups()
	if err != nil {
		return Process{}, fs.wrap(pid, "cgroup", err)
	}
	cmdline, err := readCmdline(filepath.Join(fs.root, strconv.Itoa(pid), "cmdline"))
	if err != nil {
		return Process{}, fs.wrap(pid, "cmdline", err)
	}
	st, err := p.Stat()
	if err != nil {
		return Process{}, fs.wrap(pid, "stat", err)
	}
	status, err := p.NewStatus()
	if err != nil {
		return Process{}, fs.wrap(pid, "status", err)
	}
	zombie := st.State == "Z" || st.State == "X"
	leaderExited, exiting := false, false
	if zombie || inExit(st.Flags) {
		// The main thread is exiting, or has exited: the kernel shows
		// "/" for each cgroup v1 hierarchy of such a thread (only v2
		// keeps the path), and an empty cmdline once it let go of its
		// memory. A look then would lose the Slurm job of a v1 node.
		// A thread that has not started to exit still tells.
		th, running, known := fs.runningThread(pid)
		switch {
		case running:
			cgs, cmdline = th.cgroups, th.cmdline
			leaderExited = zombie
		case known && !zombie:
			exiting = true
		}
	}

	// The effective UID, as ps and top show it: the one permissions follow.
	uid := int(status.UIDs[1])
	pr := Process{
		PID:       pid,
		PPID:      st.PPID,
		PGID:      st.PGRP,
		SID:       st.Session,
		State:     st.State,
		StartTime: st.Starttime,
		UID:       uid,
		User:      fs.users.name(uid),
		// comm is whatever bytes the process chose; labels need UTF-8.
		Comm:    strings.ToValidUTF8(st.Comm, "\uFFFD"),
		Cmdline: cmdline,
		Cgroup:  cgroupPath(cgs),
	}
	// slurmd uses one hierarchy or several: any line may carry the job.
	for _, cg := range cgs {
		if job, step := parseSlurm(cg.Path); job != "" {
			pr.SlurmJob, pr.SlurmStep = job, step
			break
		}
	}
	// A process is alive while any of its threads is.
	pr.LeaderExited, pr.Exiting = leaderExited, exiting
	pr.Exe = fs.exe(pid, pr.LeaderExited)
	for _, n := range status.NSpids {
		pr.NSpid = append(pr.NSpid, int(n))
	}
	pr.Container, pr.Pod = parseContainer(pr.Cgroup)
	if pr.Container == "" && pr.Pod == "" {
		// Hybrid hosts: the unified path may say nothing, a v1 path may.
		for _, cg := range cgs {
			if c, pod := parseContainer(cg.Path); c != "" || pod != "" {
				pr.Container, pr.Pod = c, pod
				break
			}
		}
	}
	return pr, nil
}

// Alive reads process pid and reports whether it is running: ok is false
// when it does not exist, is a zombie (every thread has exited; a main
// thread that exited while others run leaves the process alive), or is
// Exiting (every thread has begun to). When /proc cannot tell (EACCES
// under hidepid, an unparsable file), ok is true with only PID set: a
// process must not be declared dead, and its memory orphaned, on a guess.
func (fs FS) Alive(pid int) (Process, bool) {
	p, err := fs.Process(pid)
	switch {
	case err == nil:
		return p, !p.Zombie() && !p.Exiting
	case gone(err):
		return Process{PID: pid}, false
	default:
		return Process{PID: pid}, true
	}
}

func (fs FS) wrap(pid int, file string, err error) error {
	what := filepath.Join(fs.root, strconv.Itoa(pid), file)
	if gone(err) {
		return fmt.Errorf("%s: %w: %w", what, ErrNotExist, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// readCmdline reads no more of /proc/PID/cmdline than Cmdline keeps.
func readCmdline(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	// Leading NULs (an empty argv[0]) are trimmed, so read past the cap.
	buf := make([]byte, 4*maxCmdline)
	n, err := io.ReadFull(f, buf)
	if err != nil && err != io.EOF && err != io.ErrUnexpectedEOF {
		return "", err
	}
	return formatCmdline(buf[:n]), nil
}

// formatCmdline turns the NUL-separated argv of /proc/PID/cmdline into one
// line of valid UTF-8 of at most maxCmdline bytes.
func formatCmdline(b []byte) string {
	b = bytes.TrimSpace(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
	s := strings.ToValidUTF8(string(b), "\uFFFD")
	if len(s) > maxCmdline {
		// Cut on a rune boundary rather than leave half a character.
		i := maxCmdline
		for i > 0 && !utf8.RuneStart(s[i]) {
			i--
		}
		s = strings.TrimSpace(s[:i])
	}
	return s
}

// userCache maps UIDs to user names. A host has few users and a lookup may
// read /etc/passwd or ask NSS, so each UID is looked up once, misses too.
type userCache struct {
	mu    sync.Mutex
	names map[int]string
}

func newUserCache() *userCache { return &userCache{names: make(map[int]string)} }

func (c *userCache) name(uid int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n, ok := c.names[uid]; ok {
		return n
	}
	n := strconv.Itoa(uid)
	if u, err := user.LookupId(n); err == nil && u.Username != "" {
		n = u.Username
	}
	c.names[uid] = n
	return n
}

// pfExiting is PF_EXITING in the flags of /proc/PID/stat (field 9): the
// thread is in do_exit, and never runs its own code again. It is set at the
// start of the exit and never cleared.
const pfExiting = 0x4

func inExit(flags uint) bool { return flags&pfExiting != 0 }

// thread is what a running thread says of its process's identity.
type thread struct {
	cgroups []procfs.Cgroup
	cmdline string
}

// runningThread reads the cgroups and cmdline of a thread of pid, other
// than its main thread, that had not started to exit when they were read
// (running). known is false when the threads could not be listed or read
// (not gone: denied, unparsable): whether one runs is then not known.
func (fs FS) runningThread(pid int) (th thread, running, known bool) {
	tasks, err := fs.proc.AllThreads(pid)
	if err != nil {
		return thread{}, false, gone(err)
	}
	known = true
	for _, t := range tasks {
		if t.PID == pid {
			continue
		}
		cgs, err := t.Cgroups()
		if err != nil {
			known = known && gone(err)
			continue
		}
		cmdline, err := readCmdline(filepath.Join(fs.root, strconv.Itoa(pid), "task", strconv.Itoa(t.PID), "cmdline"))
		if err != nil {
			known = known && gone(err)
			continue
		}
		st, err := t.Stat()
		if err != nil {
			known = known && gone(err)
			continue
		}
		if st.State != "Z" && st.State != "X" && !inExit(st.Flags) {
			return thread{cgroups: cgs, cmdline: cmdline}, true, true
		}
	}
	return thread{}, false, known
}
