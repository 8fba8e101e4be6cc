// Command gpu-orphan-sim runs a simulated GPU node: a stand-in for NVML on
// machines without a GPU, with workloads that are real processes.
package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"syscall"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"
	"github.com/prometheus/common/version"
	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
)

const help = `A simulated GPU node for gpu-orphan on machines without a GPU.

It keeps NVML's measured accounting: a CUDA context lives while any process
holds its descriptor, and NVML keeps naming the context's creator as the
owner even after the creator died, while a forked child that inherited the
descriptor keeps the memory in use. A mapping of the device holds nothing:
only descriptors keep a context.

  gpu-orphan-sim init --root /tmp/node --gpus 8
  gpu-orphan-sim run --root /tmp/node --gpu 0 --mib 4096 --children 2 &
  gpu-orphan-sim status --root /tmp/node

Two flags of run copy the worst that real CUDA processes do to a scanner of
/proc. --visible all opens and maps every GPU's device node, as a multi-GPU
CUDA process opens every visible device, though its context (and NVML's
listing) is on one GPU only. --zombie-leader ends the main thread alone, as
pthread_exit does in a PyTorch process: the process lives on in its other
threads and keeps its context, while /proc/PID shows it as a zombie (Z)
whose fd and maps are empty; /proc/PID/task/TID/fd still holds them.

Three more copy measured job shapes. --helper adds a double-forked helper,
printed as 'helper PID' after the ready line: its parent is PID 1 (or the
nearest subreaper), it stays in the job's group and session, and it shares
the job's own open descriptors, so it alone keeps the context. --child-comm
renames the children as prctl(PR_SET_NAME) does: /proc/PID/comm changes,
/proc/PID/exe does not. --closing-children N makes the first N children close
every inherited descriptor but keep their mapping: they keep no context.

Two commands start holders of the device that NVML does not list, since they
have no context. launch is a cuInit-only process such as torchrun: it prints
'launcher PID' and starts its command, a rank that makes its own context, in
a session of its own, without its descriptors:

  gpu-orphan-sim launch --root /tmp/node --gpu 0 -- gpu-orphan-sim run --root /tmp/node --gpu 0 --mib 4096

mps is the MPS control daemon (nvidia-cuda-mps-control -d): it prints 'ready
CONTROL_PID SERVER_PID' once its server, an NVML owner of 66 MiB that dies
with it, is up; both show as nvidia-cuda-mps in /proc/PID/comm, as the real
ones do. Its clients are ordinary run workloads: NVML lists each with its own
memory, and keeps listing a killed client's PID while its workers live.

Point gpu-orphan at the node with its simulated driver to read it.`

// Values of run --visible.
const (
	visibleOwn = "own"
	visibleAll = "all"
)

func main() { os.Exit(run()) }

func run() int {
	app := kingpin.New("gpu-orphan-sim", help)
	app.Version(version.Print("gpu-orphan-sim"))
	cli.HelpOnStdout(app)
	logConfig := &promslog.Config{Level: promslog.NewLevel(), Format: promslog.NewFormat()}
	app.Flag(promslogflag.LevelFlagName, promslogflag.LevelFlagHelp).Default("info").
		HintOptions(promslog.LevelFlagOptions...).SetValue(logConfig.Level)
	app.Flag(promslogflag.FormatFlagName, promslogflag.FormatFlagHelp).Default("logfmt").
		HintOptions(promslog.FormatFlagOptions...).SetValue(logConfig.Format)

	initCmd := app.Command("init", "Create a node: DIR/node.json, one device node per GPU in DIR/dev, and DIR/contexts.")
	initRoot := initCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()
	initGPUs := cli.Int(initCmd.Flag("gpus", fmt.Sprintf("Number of GPUs, 1 to %d.", sim.MaxGPUs)).Required())
	initForce := initCmd.Flag("force", "Replace a node that DIR already holds.").Bool()

	runCmd := app.Command("run", "Run a workload: create a CUDA context on a GPU, start children that inherit it, print "+
		"'ready PID CHILD1 ...' on one line, and sleep until killed. Exits 1 when the GPU is out of memory.")
	runRoot := runCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()
	runGPU := cli.Int(runCmd.Flag("gpu", "Index of the GPU.").Required())
	runMiB := cli.Uint64(runCmd.Flag("mib", "MiB to allocate.").Required())
	runChildren := cli.Int(runCmd.Flag("children", fmt.Sprintf("Forked workers (0 to %d) that inherit the context, like DataLoader workers.", sim.MaxChildren)).Default("0"))
	runIgnore := runCmd.Flag("ignore-sigterm", "Make the children ignore SIGTERM; the workload itself still dies of it.").Bool()
	runVisible := cli.Enum(runCmd.Flag("visible", "Device nodes that the workload and its children open and map: own (its GPU's) or all "+
		"(every GPU's, as a multi-GPU CUDA process opens every visible device; the context stays on --gpu).").Default(visibleOwn), visibleOwn, visibleAll)
	runZombie := runCmd.Flag("zombie-leader", "After the ready line, end the main thread alone, as pthread_exit does: the process "+
		"lives on in its other threads, holding the context, while /proc/PID shows it as a zombie with no fd or maps.").Bool()
	runHelper := runCmd.Flag("helper", "Also start a double-forked helper that shares the workload's descriptors, reparented to PID 1 "+
		"(or the nearest subreaper) in the workload's group and session; prints 'helper PID' after the ready line.").Bool()
	runChildComm := runCmd.Flag("child-comm", fmt.Sprintf("Name the children give themselves with prctl(PR_SET_NAME), at most %d bytes: "+
		"/proc/PID/comm shows it, /proc/PID/exe still names this binary.", sim.MaxCommLen)).PlaceHolder("NAME").String()
	runRespawn := runCmd.Flag("respawn-on-sigterm", "Make each child, on SIGTERM, start a replacement that holds its descriptors "+
		"and exit, as a self-healing worker pool does; the replacement dies of SIGTERM.").Bool()
	runClosing := cli.Int(runCmd.Flag("closing-children", "How many of the children (the first ones) close every inherited descriptor "+
		"after mapping the device, and keep the mapping: they hold no context.").Default("0"))

	launchCmd := app.Command("launch", "Run a cuInit-only process such as torchrun: open and map the GPU's device node, make no "+
		"context, print 'launcher PID', then run CMD (a rank, such as gpu-orphan-sim run) in its own session without these "+
		"descriptors and exit with its status; without CMD, sleep until killed. NVML does not list it.")
	launchRoot := launchCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()
	launchGPU := cli.Int(launchCmd.Flag("gpu", "Index of the GPU.").Required())
	launchVisible := cli.Enum(launchCmd.Flag("visible", "Device nodes that the launcher opens and maps: own (its GPU's) or all "+
		"(every GPU's).").Default(visibleOwn), visibleOwn, visibleAll)
	launchArgv := launchCmd.Arg("command", "The rank to start, after --.").PlaceHolder("CMD ARGS").Strings()

	mpsCmd := app.Command("mps", "Run an MPS control daemon (nvidia-cuda-mps-control -d): open and map the GPU's device node with "+
		"no context (NVML does not list it), start the server, an NVML owner that dies with it, print 'ready CONTROL_PID "+
		"SERVER_PID', and sleep until killed. Clients are ordinary run workloads on the same GPU.")
	mpsRoot := mpsCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()
	mpsGPU := cli.Int(mpsCmd.Flag("gpu", "Index of the GPU.").Required())
	mpsComm := mpsCmd.Flag("control-comm", fmt.Sprintf("The control daemon's name in /proc/PID/comm, at most %d bytes (default %s, the real one's).",
		sim.MaxCommLen, sim.MPSComm)).PlaceHolder("NAME").String()
	mpsServerMiB := cli.Uint64(mpsCmd.Flag("server-mib", "MiB the server's own context holds.").Default(strconv.Itoa(sim.DefaultMPSServerMiB)))

	mpsServerCmd := app.Command(sim.MPSServerCommand, "The MPS server; started by mps only.").Hidden()
	mpsServerRoot := mpsServerCmd.Flag("root", "Directory of the node.").Required().String()
	mpsServerGPU := mpsServerCmd.Flag("gpu", "Index of the GPU.").Required().Int()
	mpsServerMiBFlag := mpsServerCmd.Flag("mib", "MiB to allocate.").Required().Uint64()

	childCmd := app.Command(sim.ChildCommand, "A workload's child; started by run only.").Hidden()
	childIgnore := childCmd.Flag(sim.IgnoreSIGTERMFlag[2:], "Ignore SIGTERM.").Bool()
	childOthers := childCmd.Flag(sim.OtherDevicesFlag[2:], "Device nodes of other GPUs inherited after the fixed descriptors.").Int()
	childComm := childCmd.Flag(sim.CommFlag[2:], "Name to give this process.").String()
	childClose := childCmd.Flag(sim.CloseDescriptorsFlag[2:], "Close the inherited descriptors after mapping the device.").Bool()
	childRespawn := childCmd.Flag(sim.RespawnFlag[2:], "On SIGTERM, start a replacement with the inherited descriptors and exit.").Bool()
	childForkHelper := childCmd.Flag(sim.ForkHelperFlag[2:], "Start a helper with the inherited descriptors, report its PID and exit.").Bool()

	statusCmd := app.Command("status", "Print each GPU's memory and live contexts, and whether their creators still exist.")
	statusRoot := statusCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()

	if msg := cli.NoCommand(app, os.Args[1:]); msg != "" {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %s\n", msg)
		return cli.ExitUsage
	}
	cmd, err := app.Parse(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %s\n", cli.ParseError(app, err))
		return 2
	}
	zombieLeader := cmd == runCmd.FullCommand() && *runZombie
	// Commands that rename themselves, or start a process that must die
	// with this thread, stay on the main thread.
	switch {
	case zombieLeader, cmd == childCmd.FullCommand(), cmd == mpsCmd.FullCommand(), cmd == mpsServerCmd.FullCommand():
	default:
		runtime.UnlockOSThread()
	}

	code := 0
	switch cmd {
	case initCmd.FullCommand():
		err = sim.InitWithOptions(*initRoot, sim.InitOptions{GPUs: *initGPUs, Force: *initForce})
	case runCmd.FullCommand():
		err = runWorkload(sim.WorkloadConfig{
			Root:             *runRoot,
			GPU:              *runGPU,
			MiB:              *runMiB,
			Children:         *runChildren,
			IgnoreSIGTERM:    *runIgnore,
			AllVisible:       *runVisible == visibleAll,
			ChildComm:        *runChildComm,
			ClosingChildren:  *runClosing,
			Helper:           *runHelper,
			RespawnOnSIGTERM: *runRespawn,
			Logger:           promslog.New(logConfig),
		}, zombieLeader)
	case launchCmd.FullCommand():
		code, err = runLauncher(sim.LauncherConfig{Root: *launchRoot, GPU: *launchGPU, AllVisible: *launchVisible == visibleAll}, *launchArgv)
	case mpsCmd.FullCommand():
		err = runMPS(sim.MPSConfig{Root: *mpsRoot, GPU: *mpsGPU, ServerMiB: *mpsServerMiB, ControlComm: *mpsComm, Logger: promslog.New(logConfig)})
	case mpsServerCmd.FullCommand():
		err = sim.RunMPSServer(sim.MPSServerConfig{Root: *mpsServerRoot, GPU: *mpsServerGPU, MiB: *mpsServerMiBFlag})
	case childCmd.FullCommand():
		err = sim.RunChild(sim.ChildConfig{
			IgnoreSIGTERM:    *childIgnore,
			OtherDevices:     *childOthers,
			Comm:             *childComm,
			CloseDescriptors: *childClose,
			ForkHelper:       *childForkHelper,
			RespawnOnSIGTERM: *childRespawn,
		})
	case statusCmd.FullCommand():
		err = sim.WriteStatus(os.Stdout, *statusRoot)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %v\n", err)
		return 1
	}
	return code
}

// The main goroutine starts on the process's first thread, the thread-group
// leader whose TID is the PID; keeping it there lets --zombie-leader end
// exactly that thread. run unlocks it in every other case.
func init() { runtime.LockOSThread() }

// runWorkload never returns on success: the workload holds its context
// until a signal kills it, as a CUDA process does.
func runWorkload(cfg sim.WorkloadConfig, zombieLeader bool) error {
	w, err := sim.StartWorkload(cfg)
	if err != nil {
		return err
	}
	// os.Stdout is unbuffered: the line is out when Println returns.
	if _, err := fmt.Println(w.ReadyLine()); err != nil {
		return err
	}
	if cfg.Helper {
		if _, err := fmt.Println(w.HelperLine()); err != nil {
			return err
		}
	}
	if zombieLeader {
		exitLeader(w)
	}
	return w.Hold(context.Background())
}

// runLauncher holds the devices while the rank in argv runs, and returns
// its exit status (128 plus the signal that killed it, as a shell says);
// without argv it holds until killed.
func runLauncher(cfg sim.LauncherConfig, argv []string) (int, error) {
	l, err := sim.StartLauncher(cfg)
	if err != nil {
		return 1, err
	}
	if _, err := fmt.Println(l.Line()); err != nil {
		return 1, err
	}
	if len(argv) == 0 {
		return 0, l.Hold(context.Background())
	}
	rank, err := l.StartRank(argv, os.Stdout, os.Stderr)
	if err != nil {
		return 1, err
	}
	err = rank.Wait()
	l.Close() // after Wait: l must live, and hold, as long as the rank
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		return 1, err
	}
	ws := rank.ProcessState.Sys().(syscall.WaitStatus)
	if ws.Signaled() {
		return 128 + int(ws.Signal()), nil
	}
	return ws.ExitStatus(), nil
}

// runMPS never returns on success: the control daemon holds the device
// until a signal kills it, and its server dies with it.
func runMPS(cfg sim.MPSConfig) error {
	m, err := sim.StartMPS(cfg)
	if err != nil {
		return err
	}
	if _, err := fmt.Println(m.ReadyLine()); err != nil {
		return err
	}
	return m.Hold(context.Background())
}

// exitLeader ends the main thread alone, as pthread_exit does, and never
// returns. The process lives on in its other threads with every descriptor;
// a signal still kills all of it.
func exitLeader(w *sim.Workload) {
	// The runtime will think the vanished thread still runs its goroutine on
	// a P: that P is lost, so keep one for the other goroutines ...
	if runtime.GOMAXPROCS(0) < 2 {
		runtime.GOMAXPROCS(2)
	}
	// ... and no stop-the-world may ever wait for it: no GC, even one that
	// GOMEMLIMIT would start.
	debug.SetGCPercent(-1)
	debug.SetMemoryLimit(math.MaxInt64)
	// Something keeps w, whose files' finalizers would close the descriptors.
	// Its context is never done, so Hold never returns, nor an error.
	go func() { _ = w.Hold(context.Background()) }()
	// SYS_EXIT ends the calling thread only; exit_group would end them all.
	// It does not return, so it has no error to check.
	_, _, _ = unix.RawSyscall(unix.SYS_EXIT, 0, 0, 0)
	panic("unreachable")
}
