package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
)

// Crowd is a node's worth of other processes: `sleep`s holding files, a
// pipe and a socket, as docs/facts.md's measurement machine had (~2,000
// processes, ~48,000 descriptors). Some of them may also hold a target.
type Crowd struct {
	Dir     string
	Target  string // the file that Holders hold, if any
	Holders []int
	cmds    []*exec.Cmd
}

// StartCrowd starts n processes with fds descriptors each (stdio included);
// every holdEvery-th also holds a file named "target" in Dir, when
// holdEvery > 0. The processes die with the test binary.
func StartCrowd(n, fds, holdEvery int) (*Crowd, error) {
	dir, err := os.MkdirTemp("", "gpu-orphan-crowd-")
	if err != nil {
		return nil, err
	}
	c := &Crowd{Dir: dir}
	var target *os.File
	if holdEvery > 0 {
		c.Target = filepath.Join(dir, "target")
		if target, err = os.Create(c.Target); err != nil {
			return nil, err
		}
		defer target.Close()
	}
	// Our descriptors are dup'd into every child. A pipe and a socket give
	// links that are not paths; holders swap their last file for target.
	var extra []*os.File
	for i := range fds - 3 - 2 {
		f, err := os.Create(filepath.Join(dir, "file"+strconv.Itoa(i)))
		if err != nil {
			return nil, err
		}
		defer f.Close()
		extra = append(extra, f)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer pr.Close()
	defer pw.Close()
	sp, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	sock := os.NewFile(uintptr(sp[0]), "socket")
	defer sock.Close()
	syscall.Close(sp[1])
	extra = append(extra, pr, sock)

	for i := range n {
		files := slices.Clone(extra)
		holds := holdEvery > 0 && i%holdEvery == 0
		if holds {
			files[0] = target
		}
		cmd := exec.Command("sleep", "3600")
		cmd.ExtraFiles = files
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			c.Stop()
			return nil, fmt.Errorf("start sleep %d: %w", i, err)
		}
		c.cmds = append(c.cmds, cmd)
		if holds {
			c.Holders = append(c.Holders, cmd.Process.Pid)
		}
	}
	return c, nil
}

// Stop kills and reaps the crowd and removes its files.
func (c *Crowd) Stop() {
	for _, cmd := range c.cmds {
		_ = cmd.Process.Kill()
	}
	for _, cmd := range c.cmds {
		_ = cmd.Wait()
	}
	_ = os.RemoveAll(c.Dir)
}
