// Command gpu-orphan-sim runs a simulated GPU node: a stand-in for NVML on
// machines without a GPU, with workloads that are real processes.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/promslog"
	"github.com/prometheus/common/version"

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

Point gpu-orphan at the node with its simulated driver to read it.`

func main() { os.Exit(run()) }

func run() int {
	app := kingpin.New("gpu-orphan-sim", help)
	app.Version(version.Print("gpu-orphan-sim"))
	app.HelpFlag.Short('h')

	initCmd := app.Command("init", "Create a node: DIR/node.json, one device node per GPU in DIR/dev, and DIR/contexts.")
	initRoot := initCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()
	initGPUs := initCmd.Flag("gpus", fmt.Sprintf("Number of GPUs, 1 to %d.", sim.MaxGPUs)).Required().Int()
	initForce := initCmd.Flag("force", "Replace a node that DIR already holds.").Bool()

	runCmd := app.Command("run", "Run a workload: create a CUDA context on a GPU, start children that inherit it, print "+
		"'ready PID CHILD1 ...' on one line, and sleep until killed. Exits 1 when the GPU is out of memory.")
	runRoot := runCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()
	runGPU := runCmd.Flag("gpu", "Index of the GPU.").Required().Int()
	runMiB := runCmd.Flag("mib", "MiB to allocate.").Required().Uint64()
	runChildren := runCmd.Flag("children", fmt.Sprintf("Forked workers (0 to %d) that inherit the context, like DataLoader workers.", sim.MaxChildren)).Default("0").Int()
	runIgnore := runCmd.Flag("ignore-sigterm", "Make the children ignore SIGTERM; the workload itself still dies of it.").Bool()

	childCmd := app.Command(sim.ChildCommand, "A workload's child; started by run only.").Hidden()
	childIgnore := childCmd.Flag(sim.IgnoreSIGTERMFlag[2:], "Ignore SIGTERM.").Bool()

	statusCmd := app.Command("status", "Print each GPU's memory and live contexts, and whether their creators still exist.")
	statusRoot := statusCmd.Flag("root", "Directory of the node.").PlaceHolder("DIR").Required().String()

	cmd, err := app.Parse(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %v; try --help\n", err)
		return 2
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
			Logger:        promslog.New(&promslog.Config{}),
		})
	case childCmd.FullCommand():
		err = sim.RunChild(*childIgnore)
	case statusCmd.FullCommand():
		err = sim.WriteStatus(os.Stdout, *statusRoot)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-sim: %v\n", err)
		return 1
	}
	return 0
}

// runWorkload never returns on success: the workload holds its context
// until a signal kills it, as a CUDA process does.
func runWorkload(cfg sim.WorkloadConfig) error {
	w, err := sim.StartWorkload(cfg)
	if err != nil {
		return err
	}
	if _, err := fmt.Println(w.ReadyLine()); err != nil {
		return err
	}
	return w.Hold(context.Background())
}
