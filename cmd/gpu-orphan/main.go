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
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
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
	cli.HelpOnStdout(app)

	ps := app.Command("ps", "Show, per GPU, used memory split by owner liveness, and the suspect holders (always scans /proc/*/fd).")
	psOutput := cli.Enum(ps.Flag("output", "Output format: table or json.").Short('o').Default("table"), "table", "json")
	psStore := ps.Flag("store.path", "The node agent's audit database, read (never written) for its record of which holders inherited a dead owner's context: the agent saw them fork, ps did not. Without it every such holder shows as unproven.").Default(defaultStorePath).String()
	psExporter := ps.Flag("exporter.url", "The node's gpu-orphan-exporter metrics, asked who each dead owner was: it remembers owners while they live, and ps starts after the death. Empty: do not ask.").Default(defaultExporterURL).String()

	clean := app.Command("clean", "Clean up one GPU by hand: take a fresh snapshot, print the plan (which process groups, and why), then with --act signal them (SIGTERM, SIGKILL after the grace) through pidfds and verify that the memory came back. Replaces `kill -- -$PGID` scripts. "+
		"It applies the remediator's rules: it never signals its own process group or session (run it from another terminal, or with `setsid -w`), and it acts only from the PID namespace that --path.procfs shows. "+
		fmt.Sprintf("With --min-age it measures ages as the remediator does, from its own first snapshot (it has no history from before it ran), and waits for them, looking again every %s; a --min-age above %s is the remediator's. ", pollInterval, maxMinAge)+
		cleanExitHelp)
	cleanGPU := clean.Flag("gpu", "The GPU: its index or UUID.").Required().String()
	cleanStore := clean.Flag("store.path", "Also record the action in this audit database (the remediator's --store.path). "+
		"Its directory is created (0700) when missing and checked, as the remediator does; with --act, a store that cannot be opened means nothing is signalled.").String()
	cleanFlags := remediateflag.AddCleanFlags(clean)

	rep := app.Command("report", "Who leaves orphaned GPU memory behind: per user, Slurm job, command, node or source, the orphaned-memory events, the GiB·hours held with no live owner before the cleanup, the memory given back, and the last time; from the remediator's audit database, or from a remediator's API (a dispatcher's covers the fleet).")
	var ro reportOptions
	rep.Flag("since", "How far back, as a Prometheus duration: 7d, 12h, 2w.").Default("7d").StringVar(&ro.since)
	rep.Flag("by", "Group by user, slurm_job, comm (the dead owner's command), node, or source (what started the cleanup: webhook, cli, prolog, epilog, dispatch). "+
		"An epilog's cleanup counts for its job and the job's user; a prolog's, for the dead owners it cleaned up after.").
		Default("user").HintOptions("user", "slurm_job", "comm", "node", "source").StringVar(&ro.by)
	cli.EnumVar(rep.Flag("output", "Output format: table, json or csv.").Short('o').Default("table"), &ro.output, "table", "json", "csv")
	rep.Flag("store.path", "The remediator's audit database, opened read-only.").Default(defaultStorePath).IsSetByUser(&ro.storeSet).StringVar(&ro.storePath)
	rep.Flag("url", "A remediator's base URL (http(s)://host:10836) to read GET /api/v1/actions from instead; a dispatcher's holds its agents' results.").StringVar(&ro.url)
	rep.Flag("auth.token-file", "The bearer token for --url (the remediator's --auth.token-file).").StringVar(&ro.tokenFile)
	cli.DurationVar(rep.Flag("url.timeout", "Deadline of one request to --url.").Default("30s"), &ro.timeout)

	prolog := app.Command("prolog", hooks.PrologHelp)
	var prologOpts hooks.Options
	addHookFlags(prolog, &prologOpts, "prolog", "30s", "5s")
	cli.DurationVar(prolog.Flag("min-age", "How long a dead owner must have been dead before the holders of its context are signalled, as the remediator's --remediate.min-age; "+
		"ages start at the remediator's recorded lineage, else at the prolog's first look.").Default("0s"), &prologOpts.MinAge)
	epilog := app.Command("epilog", hooks.EpilogHelp)
	var epilogOpts hooks.Options
	addHookFlags(epilog, &epilogOpts, "epilog", "60s", "5s")

	if msg := cli.NoCommand(app, args); msg != "" {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %s\n", msg)
		return cli.ExitUsage
	}
	cmd, err := app.Parse(args)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %s\n", cli.ParseError(app, err))
		return 2
	}
	logger := promslog.New(logConfig)
	switch cmd {
	case ps.FullCommand():
		return runPS(logger, backend, *psOutput, *psExporter, *psStore)
	case rep.FullCommand():
		return runReport(ro)
	case clean.FullCommand():
		return runClean(logger, backend, cleanFlags, *cleanGPU, *cleanStore)
	case prolog.FullCommand():
		return hooks.RunProlog(logger, backend, &prologOpts)
	case epilog.FullCommand():
		return hooks.RunEpilog(logger, backend, &epilogOpts)
	}
	return 2
}
