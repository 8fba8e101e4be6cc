// Command gpu-orphan is the operator's command line: it shows which GPU
// memory has no live owner and who holds it (replacing
// `fuser -v /dev/nvidia*`), and cleans it up safely.
package main

import (
	"fmt"
	"os"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"
	"github.com/prometheus/common/version"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	app := kingpin.New("gpu-orphan", "Find GPU memory that no live process owns, and the processes that hold it.")
	backend := cli.AddBackendFlags(app)
	// A command line speaks through its output; logs only warn by default.
	logConfig := &promslog.Config{Level: promslog.NewLevel(), Format: promslog.NewFormat()}
	app.Flag(promslogflag.LevelFlagName, promslogflag.LevelFlagHelp).Default("warn").
		HintOptions(promslog.LevelFlagOptions...).SetValue(logConfig.Level)
	app.Flag(promslogflag.FormatFlagName, promslogflag.FormatFlagHelp).Default("logfmt").
		HintOptions(promslog.FormatFlagOptions...).SetValue(logConfig.Format)
	app.Version(version.Print("gpu-orphan"))
	app.HelpFlag.Short('h')

	ps := app.Command("ps", "Show, per GPU, used memory split by owner liveness, and the suspect holders (always scans /proc/*/fd).")
	psOutput := cli.Enum(ps.Flag("output", "Output format: table or json.").Short('o').Default("table"), "table", "json")
	psExporter := ps.Flag("exporter.url", "The node's gpu-orphan-exporter metrics, asked who each dead owner was: it remembers owners while they live, and ps starts after the death. Empty: do not ask.").Default(defaultExporterURL).String()

	clean := app.Command("clean", "Clean up one GPU by hand: take a fresh snapshot, print the plan (which process groups, and why), then with --act signal them (SIGTERM, SIGKILL after the grace) through pidfds and verify that the memory came back. Replaces `kill -- -$PGID` scripts.")
	cleanGPU := clean.Flag("gpu", "The GPU: its index or UUID.").Required().String()
	cleanStore := clean.Flag("store.path", "Also record the action in this audit database (the remediator's --store.path).").String()
	cleanFlags := remediateflag.AddCleanFlags(clean)

	cmd, err := app.Parse(args)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
		return 2
	}
	logger := promslog.New(logConfig)
	switch cmd {
	case ps.FullCommand():
		return runPS(logger, backend, *psOutput, *psExporter)
	case clean.FullCommand():
		return runClean(logger, backend, cleanFlags, *cleanGPU, *cleanStore)
	}
	return 2
}
