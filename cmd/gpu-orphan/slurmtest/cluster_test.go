package slurmtest

// A one-node Slurm cluster for the tests, started once for the package
// (TestMain stops it): its own munged (key and socket in a temporary
// directory), slurmctld and slurmd in the foreground, on spare ports, under
// a node name of its own, so that it shares nothing with a Slurm that may
// run on the machine. As measured (docs/slurm.md): proctrack/cgroup with
// cgroup/v1 (a job's processes in freezer:/slurm_<node>/uid_<uid>/job_<id>/
// step_<step>), task/none, and GRES gpu:2 whose device files are character
// devices made with mknod, so that slurmd gives the prolog and the epilog
// SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES and GPU_DEVICE_ORDINAL as on a GPU
// node; the GPUs themselves are a simulated node's.

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/slurm"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

func TestMain(m *testing.M) {
	code := testenv.Main(m)
	if shared != nil {
		shared.stop()
	}
	os.Exit(code)
}

var (
	startOnce sync.Once
	shared    *cluster
	startErr  error
)

// cluster is the running one-node cluster.
type cluster struct {
	dir  string
	node string // NodeName, unique to this run
	conf string
	// simRoot is the simulated node whose two GPUs are the GRES.
	simRoot string
	// db is the audit store the prolog and the epilog record in.
	db string
	// sim and cli are gpu-orphan-sim and gpu-orphan.
	sim, cli string
	bins     map[string]string // sbatch, scontrol, ...

	mungePID      int
	ctld, slurmd  *exec.Cmd
	daemonsExited chan struct{}
	syslog        *syslogSink
}

// getCluster returns the package's cluster, starting it on first use. It
// skips the test when not root: slurmd runs as root, makes cgroups, and
// runs the prolog and the epilog as root.
func getCluster(t *testing.T) *cluster {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the Slurm tests start slurmctld and slurmd, which run as root (cgroups, the prolog and the epilog): run them as root")
	}
	startOnce.Do(func() { startErr = startCluster(t) })
	switch {
	case startErr != nil:
		t.Fatalf("starting the Slurm cluster: %v", startErr)
	case shared == nil || shared.slurmd == nil:
		t.Fatal("the Slurm cluster failed to start in an earlier test")
	}
	c := shared
	t.Cleanup(func() {
		if t.Failed() {
			c.dumpLogs(t)
		}
	})
	c.waitIdle(t)
	return c
}

// slurmTools are the Slurm commands the tests run, from Debian's packages
// (scripts/deps.sh installs them).
var slurmTools = []string{"slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "munged", "mungekey"}

func startCluster(t *testing.T) (err error) {
	c := &cluster{bins: map[string]string{}, daemonsExited: make(chan struct{}, 2)}
	shared = c
	for _, name := range slurmTools {
		p, err := exec.LookPath(name)
		if err != nil {
			for _, dir := range []string{"/usr/sbin", "/usr/bin"} {
				if _, serr := os.Stat(filepath.Join(dir, name)); serr == nil {
					p, err = filepath.Join(dir, name), nil
					break
				}
			}
		}
		if err != nil {
			return fmt.Errorf("%s is not installed: `make deps` (scripts/deps.sh) installs Debian's slurmctld, slurmd, slurm-client and munge", name)
		}
		c.bins[name] = p
	}
	c.sim, c.cli = testenv.Bin(t, "gpu-orphan-sim"), testenv.Bin(t, "gpu-orphan")
	if c.dir, err = os.MkdirTemp("", "gpu-orphan-slurm-"); err != nil {
		return err
	}
	host, err := os.Hostname()
	if err != nil {
		return err
	}
	host, _, _ = strings.Cut(host, ".")
	c.node = fmt.Sprintf("gpuorphan%d", os.Getpid())
	c.conf = filepath.Join(c.dir, "slurm.conf")
	c.simRoot = filepath.Join(c.dir, "node")
	c.db = filepath.Join(c.dir, "remediator.db")
	for _, d := range []string{"state", "spool", "log", "munge", "gres", "jobs"} {
		if err := os.MkdirAll(filepath.Join(c.dir, d), 0o700); err != nil {
			return err
		}
	}
	if err := sim.Init(c.simRoot, 2); err != nil {
		return err
	}
	// GRES device files must be character or block devices; slurmd only
	// reads their names (nvidia0, nvidia1) and numbers.
	for i := range 2 {
		dev := filepath.Join(c.dir, "gres", "nvidia"+strconv.Itoa(i))
		if err := syscall.Mknod(dev, syscall.S_IFCHR|0o600, int(1<<8|3)); err != nil {
			return fmt.Errorf("mknod %s (a GRES device file): %w", dev, err)
		}
	}
	if c.syslog, err = listenSyslog(filepath.Join(c.dir, "syslog.sock")); err != nil {
		return err
	}
	if err := c.startMunge(); err != nil {
		return err
	}
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	if err := c.writeConfig(host, ports); err != nil {
		return err
	}
	c.ctld, err = c.daemon("slurmctld", "-D", "-c", "-f", c.conf)
	if err != nil {
		return err
	}
	c.slurmd, err = c.daemon("slurmd", "-D", "-N", c.node, "-f", c.conf)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		state, reason, err := c.nodeState()
		if err == nil && state == "idle" {
			return nil
		}
		select {
		case <-c.daemonsExited:
			return fmt.Errorf("a Slurm daemon exited at start-up:\n%s", c.logTails())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("node %s not idle after 60s (state %q, reason %q, %v):\n%s", c.node, state, reason, err, c.logTails())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (c *cluster) startMunge() error {
	m := filepath.Join(c.dir, "munge")
	key := filepath.Join(m, "munge.key")
	if out, err := exec.Command(c.bins["mungekey"], "--create", "--keyfile="+key).CombinedOutput(); err != nil {
		return fmt.Errorf("mungekey: %w: %s", err, out)
	}
	// --force: munged refuses root, and a log under a world-writable /tmp.
	pidFile := filepath.Join(m, "munged.pid")
	out, err := exec.Command(c.bins["munged"], "--force", "--key-file="+key, "--socket="+filepath.Join(m, "munge.sock"),
		"--pid-file="+pidFile, "--log-file="+filepath.Join(m, "munged.log"), "--seed-file="+filepath.Join(m, "munged.seed")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("munged: %w: %s", err, out)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return fmt.Errorf("munged: %w", err)
	}
	c.mungePID, err = strconv.Atoi(strings.TrimSpace(string(b)))
	return err
}

// writeConfig writes slurm.conf, gres.conf, cgroup.conf, and the Prolog
// and Epilog as a site writes them: a script that runs gpu-orphan with its
// flags (Slurm runs them with no arguments).
func (c *cluster) writeConfig(host string, ports []int) error {
	hook := func(name string) string {
		return fmt.Sprintf("#!/bin/sh\nexec %s --backend=sim --sim.root=%s %s --store.path=%s --drain --grace=1s --verify-timeout=2s --log.syslog-socket=%s\n",
			c.cli, c.simRoot, name, c.db, c.syslog.path)
	}
	files := map[string]string{
		"slurm.conf": strings.Join([]string{
			"ClusterName=gpuorphan",
			"SlurmctldHost=" + host,
			"SlurmUser=root",
			"SlurmdUser=root",
			"AuthType=auth/munge",
			// cred_expire: a requeued job may start again that long after
			// its requeue (120 s by default).
			"AuthInfo=socket=" + filepath.Join(c.dir, "munge", "munge.sock") + ",cred_expire=5",
			"StateSaveLocation=" + filepath.Join(c.dir, "state"),
			"SlurmdSpoolDir=" + filepath.Join(c.dir, "spool"),
			"SlurmctldPidFile=" + filepath.Join(c.dir, "slurmctld.pid"),
			"SlurmdPidFile=" + filepath.Join(c.dir, "slurmd.pid"),
			"SlurmctldLogFile=" + filepath.Join(c.dir, "log", "slurmctld.log"),
			"SlurmdLogFile=" + filepath.Join(c.dir, "log", "slurmd.log"),
			fmt.Sprintf("SlurmctldPort=%d", ports[0]),
			fmt.Sprintf("SlurmdPort=%d", ports[1]),
			"ProctrackType=proctrack/cgroup",
			"TaskPlugin=task/none",
			"JobAcctGatherType=jobacct_gather/none",
			"SelectType=select/cons_tres",
			// Cores only: with memory (the default, CR_Core_Memory) and no
			// DefMemPerCPU, each job takes the whole node's memory.
			"SelectTypeParameters=CR_Core",
			"ReturnToService=2",
			"MpiDefault=none",
			"SlurmdDebug=debug",
			"KillWait=2",
			"Prolog=" + filepath.Join(c.dir, "prolog"),
			"Epilog=" + filepath.Join(c.dir, "epilog"),
			"PrologFlags=Alloc",
			"PrologEpilogTimeout=120",
			// A job whose prolog failed is requeued, not held: it may run
			// on another node, or here once the node is resumed; the
			// scheduler looks at it every 2 s once its BeginTime is past.
			"SchedulerParameters=nohold_on_prolog_fail,sched_interval=2",
			"GresTypes=gpu",
			fmt.Sprintf("NodeName=%s NodeHostname=%s CPUs=2 Gres=gpu:2 State=UNKNOWN", c.node, host),
			fmt.Sprintf("PartitionName=test Nodes=%s Default=YES MaxTime=INFINITE State=UP", c.node),
		}, "\n") + "\n",
		"gres.conf": fmt.Sprintf("NodeName=%s Name=gpu File=%s\n", c.node, filepath.Join(c.dir, "gres", "nvidia[0-1]")),
		// ConstrainDevices would need the device cgroup of real GPUs.
		"cgroup.conf": "CgroupPlugin=cgroup/v1\nConstrainDevices=no\nConstrainCores=no\nConstrainRAMSpace=no\n",
		"prolog":      hook("prolog"),
		"epilog":      hook("epilog"),
	}
	for name, content := range files {
		mode := os.FileMode(0o644)
		if name == "prolog" || name == "epilog" {
			mode = 0o755
		}
		if err := os.WriteFile(filepath.Join(c.dir, name), []byte(content), mode); err != nil {
			return err
		}
	}
	return nil
}

// daemon starts a Slurm daemon in the foreground, in a session of its own.
func (c *cluster) daemon(name string, args ...string) (*exec.Cmd, error) {
	out, err := os.Create(filepath.Join(c.dir, "log", name+".out"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(c.bins[name], args...)
	cmd.Env = append(os.Environ(), "SLURM_CONF="+c.conf)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		out.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	go func() {
		cmd.Wait()
		out.Close()
		c.daemonsExited <- struct{}{}
	}()
	return cmd, nil
}

// stop shuts the cluster down, kills what jobs left, and removes the
// cluster's cgroups and files.
func (c *cluster) stop() {
	cmd := exec.Command(c.bins["scontrol"], "shutdown")
	cmd.Env = append(os.Environ(), "SLURM_CONF="+c.conf)
	_ = cmd.Run()
	for _, d := range []*exec.Cmd{c.ctld, c.slurmd} {
		if d == nil || d.Process == nil {
			continue
		}
		select {
		case <-c.daemonsExited:
		case <-time.After(15 * time.Second):
			d.Process.Kill()
		}
	}
	if c.mungePID > 0 {
		syscall.Kill(c.mungePID, syscall.SIGTERM)
	}
	if c.syslog != nil {
		c.syslog.conn.Close()
	}
	removeCgroups(filepath.Join("/sys/fs/cgroup/freezer", "slurm_"+c.node))
	if c.dir != "" {
		os.RemoveAll(c.dir)
	}
}

// removeCgroups kills what is left in the cgroups under dir, and removes
// them, deepest first.
func removeCgroups(dir string) {
	var dirs []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error { // what it cannot walk stays
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		for range 50 {
			b, _ := os.ReadFile(filepath.Join(dirs[i], "cgroup.procs"))
			pids := strings.Fields(string(b))
			for _, p := range pids {
				if pid, err := strconv.Atoi(p); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			if err := os.Remove(dirs[i]); err == nil || errors.Is(err, os.ErrNotExist) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// run runs a Slurm command against the cluster.
func (c *cluster) run(name string, args ...string) (string, error) {
	cmd := exec.Command(c.bins[name], args...)
	cmd.Env = append(os.Environ(), "SLURM_CONF="+c.conf)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

func (c *cluster) must(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := c.run(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// nodeState is the node's state and reason as sinfo prints them: "idle",
// "drained", "mixed"...; the reason is "" without one (slurm.ParseNode, as
// the exporter reads them).
func (c *cluster) nodeState() (state, reason string, err error) {
	out, err := c.run("sinfo", "-h", "-N", "-n", c.node, "-o", "%T|%E")
	if err != nil {
		return "", "", err
	}
	s, err := slurm.ParseNode(out)
	return s.State, s.Reason, err
}

// waitIdle waits for the node to be idle: no job on it, not drained.
func (c *cluster) waitIdle(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, 60*time.Second, "node "+c.node+" idle", func() bool {
		state, _, _ := c.nodeState()
		return state == "idle"
	})
}

// resume puts a drained node back, and waits for it.
func (c *cluster) resume(t *testing.T) {
	t.Helper()
	if state, _, err := c.nodeState(); err == nil && !strings.HasPrefix(state, "drain") {
		return
	}
	c.must(t, "scontrol", "update", "nodename="+c.node, "state=resume")
	c.waitIdle(t)
}

// submit submits script as a batch job with env (NAME=VALUE) added, and
// returns its ID.
func (c *cluster) submit(t *testing.T, script string, sbatchArgs []string, env ...string) string {
	t.Helper()
	path := filepath.Join(c.dir, "jobs", fmt.Sprintf("script-%d.sh", time.Now().UnixNano()))
	if err := os.WriteFile(path, []byte("#!/bin/bash\n"+script), 0o755); err != nil {
		t.Fatal(err)
	}
	export := "ALL,SIM=" + c.sim + ",ROOT=" + c.simRoot + ",DIR=" + filepath.Join(c.dir, "jobs")
	for _, e := range env {
		export += "," + e
	}
	args := append([]string{"--parsable", "-c", "1", "-o", filepath.Join(c.dir, "jobs", "job-%j.out"), "--export=" + export}, sbatchArgs...)
	out := c.must(t, "sbatch", append(args, path)...)
	id, _, _ := strings.Cut(strings.TrimSpace(out), ";")
	if _, err := strconv.Atoi(id); err != nil {
		t.Fatalf("sbatch printed %q, want a job ID", out)
	}
	return id
}

// jobField is one field (JobState, Restarts, ...) of scontrol show job.
func (c *cluster) jobField(t *testing.T, id, field string) string {
	t.Helper()
	out := c.must(t, "scontrol", "-o", "show", "job", id)
	for f := range strings.FieldsSeq(out) {
		if v, ok := strings.CutPrefix(f, field+"="); ok {
			return v
		}
	}
	t.Fatalf("no %s in scontrol show job %s: %s", field, id, out)
	return ""
}

// waitJob waits for the job to reach state (RUNNING, COMPLETED, ...).
func (c *cluster) waitJob(t *testing.T, id, state string, within time.Duration) {
	t.Helper()
	var got string
	deadline := time.Now().Add(within)
	for {
		got = c.jobField(t, id, "JobState")
		if got == state {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s is %s after %s, want %s", id, got, within, state)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// jobLine waits for the job's output file to have a line that begins with
// word, and returns its fields after word.
func (c *cluster) jobLine(t *testing.T, id, word string) []string {
	t.Helper()
	path := filepath.Join(c.dir, "jobs", "job-"+id+".out")
	var fields []string
	testenv.Eventually(t, 60*time.Second, "job "+id+" to print its "+word+" line", func() bool {
		b, _ := os.ReadFile(path)
		for line := range strings.Lines(string(b)) {
			if f := strings.Fields(line); len(f) > 0 && f[0] == word && strings.HasSuffix(line, "\n") {
				fields = f[1:]
				return true
			}
		}
		return false
	})
	return fields
}

// release lets a job that waits for it go on.
func (c *cluster) release(t *testing.T, name string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(c.dir, "jobs", name), nil, 0o644); err != nil {
		t.Fatal(err)
	}
}

// usedMiB is GPU index's used memory on the simulated node.
func (c *cluster) usedMiB(t *testing.T, index int) uint64 {
	t.Helper()
	d, err := sim.NewDriver(c.simRoot)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rs, err := d.Read(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return rs[index].Memory.Used >> 20
}

func (c *cluster) logTails() string {
	var b strings.Builder
	for _, name := range []string{"slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"} {
		data, _ := os.ReadFile(filepath.Join(c.dir, "log", name))
		lines := strings.Split(strings.TrimSpace(string(data)), "\n")
		fmt.Fprintf(&b, "--- %s (last 25 lines)\n%s\n", name, strings.Join(lines[max(0, len(lines)-25):], "\n"))
	}
	return b.String()
}

func (c *cluster) dumpLogs(t *testing.T) {
	t.Logf("Slurm's logs:\n%s\nsyslog:\n%s", c.logTails(), strings.Join(c.syslog.all(), "\n"))
}

func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", ":0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// syslogSink is a syslog socket: the prolog's and epilog's lines, as a
// syslog daemon would get them.
type syslogSink struct {
	path  string
	conn  *net.UnixConn
	mu    sync.Mutex
	lines []string
}

func listenSyslog(path string) (*syslogSink, error) {
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return nil, err
	}
	s := &syslogSink{path: path, conn: conn}
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := conn.Read(buf)
			if err != nil {
				return
			}
			s.mu.Lock()
			s.lines = append(s.lines, strings.TrimSpace(string(buf[:n])))
			s.mu.Unlock()
		}
	}()
	return s, nil
}

func (s *syslogSink) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.lines...)
}

// hookLine waits for the line that hook (prolog, epilog) logged for the
// job, and returns it as it began: its priority, and the message after
// the tag ("job N: ...").
func (s *syslogSink) hookLine(t *testing.T, hook, job string, within time.Duration) (prio, msg string) {
	t.Helper()
	tag := "gpu-orphan-" + hook + "["
	testenv.Eventually(t, within, "the "+hook+" of job "+job+" to log its line", func() bool {
		for _, l := range s.all() {
			_, rest, ok := strings.Cut(l, tag)
			if !ok {
				continue
			}
			_, m, ok := strings.Cut(rest, "]: ")
			if ok && strings.HasPrefix(m, "job "+job+": ") {
				prio, _, _ = strings.Cut(l, ">")
				prio, msg = prio+">", m
				return true
			}
		}
		return false
	})
	return prio, msg
}
