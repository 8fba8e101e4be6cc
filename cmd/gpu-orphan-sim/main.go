// Command gpu-orphan-sim runs a simulated GPU node: a stand-in for NVML on
// machines without a GPU, with workloads that are real processes.
package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/debug"

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
descriptor keeps the memory in use.

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
	app.HelpFlag.Short('h')
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

	childCmd := app.Command(sim.ChildCommand, "A workload's child; started by run only.").Hidden()
	childIgnore := childCmd.Flag(sim.IgnoreSIGTERMFlag[2:], "Ignore SIGTERM.").Bool()
	childOthers := childCmd.Flag(sim.OtherDevicesFlag[2:], "Device nodes of other GPUs inherited after the fixed descriptors.").Int()

	statusCmd := app.Command("status", "Print each GPU's memory and live contexts, and whether their creators still exist.")
	statusRoot := statusCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()

	cmd, err := app.Parse(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %v; try --help\n", err)
		return 2
	}
	zombieLeader := cmd == runCmd.FullCommand() && *runZombie
	if !zombieLeader {
		runtime.UnlockOSThread()
	}

	switch cmd {
	case initCmd.FullCommand():
		err = sim.InitWithOptions(*initRoot, sim.InitOptions{GPUs: *initGPUs, Force: *initForce})
	case runCmd.FullCommand():
		err = runWorkload(sim.WorkloadConfig{
			Root:          *runRoot,
			GPU:           *runGPU,
			MiB:           *runMiB,
			Children:      *runChildren,
			IgnoreSIGTERM: *runIgnore,
			AllVisible:    *runVisible == visibleAll,
			Logger:        promslog.New(logConfig),
		}, zombieLeader)
	case childCmd.FullCommand():
		err = sim.RunChild(sim.ChildConfig{IgnoreSIGTERM: *childIgnore, OtherDevices: *childOthers})
	case statusCmd.FullCommand():
		err = sim.WriteStatus(os.Stdout, *statusRoot)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %v\n", err)
		return 1
	}
	return 0
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
	if zombieLeader {
		exitLeader(w)
	}
	return w.Hold(context.Background())
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
