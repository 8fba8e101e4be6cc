// Command gpu-orphan-exporter exports, per GPU, the memory that no live
// process owns and the processes that hold it, for Prometheus.
package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"

	"github.com/gpu-orphan/gpu-orphan/exporter"
	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/slurm"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/statefile"
)

func main() { os.Exit(run()) }

func run() int {
	app := kingpin.New("gpu-orphan-exporter", "Exports GPU memory that no live process owns (its creator is dead, yet forked children still hold it), and the processes that hold it.\n\nOn a machine without a GPU, run it on a simulated node: gpu-orphan-sim init --root DIR --gpus 2; gpu-orphan-exporter --backend=sim --sim.root=DIR")
	webFlags := kingpinflag.AddFlags(app, ":10835")
	telemetryPath := app.Flag("web.telemetry-path", "Path under which to expose metrics.").Default("/metrics").String()
	interval := cli.Duration(app.Flag("collector.interval", "How often to take a snapshot of NVML and /proc in the background; scrapes serve the latest one.").Default("5s"))
	orphanBytes := cli.Bytes(app.Flag("orphan.threshold-bytes", "Memory with no live owner above this starts a GPU's age clock (gpu_orphan_unowned_memory_age_seconds). NVML charges about 8 MiB per live context to no process. Bytes, or a size with a unit: 256MiB, 1GiB.").Default("256MiB"))
	statePath := app.Flag("state.path", "A file in which to keep, across restarts, who each GPU's owners were and which of their "+
		"descendants held the GPU (the proof gpu_orphan_holder_info's reasons rest on). Without it, an exporter started after an "+
		"owner died does not know who it was. Written 0600; its directory is made 0700 when missing, and must belong to the "+
		"exporter's user and be writable by no one else, and the file is never followed if it is a symbolic link (either is "+
		"refused at start); a corrupt state, or one from another boot, is reported and ignored.").PlaceHolder("FILE").String()
	slurmDrain := app.Flag("collector.slurm-drain", "Report whether Slurm keeps this node drained because of gpu-orphan's prolog or epilog "+
		"(gpu_orphan_slurm_node_drained, for the GPUOrphanNodeOutOfScheduling alert): asks sinfo, at most every --slurm.max-age.").Bool()
	slurmNode := app.Flag("slurm.node", "This node's name in Slurm, for --collector.slurm-drain. Default: the host name.").PlaceHolder("NAME").String()
	slurmSinfo := app.Flag("slurm.sinfo", "The sinfo command, for --collector.slurm-drain; looked up in PATH, then in /usr/bin, /usr/local/bin and /opt/slurm/bin.").
		Default("sinfo").String()
	slurmMaxAge := cli.Duration(app.Flag("slurm.max-age", "How often to ask sinfo, in the background (it asks slurmctld); scrapes serve its latest answer.").Default("30s"))
	processEvents := cli.ProcessEventsFlag(app).Bool()
	backend := cli.AddBackendFlags(app)
	backend.AddDaemonFlags(app)
	goRuntime := cli.AddRuntimeFlags(app)
	logConfig := &promslog.Config{}
	promslogflag.AddFlags(app, logConfig)
	app.Version(version.Print("gpu-orphan-exporter"))
	cli.HelpOnStdout(app)
	if _, err := app.Parse(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: %s\n", cli.ParseError(app, err))
		return 2
	}
	if *interval <= 0 {
		fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: invalid --collector.interval %s: want a positive duration, such as 5s\n", *interval)
		return cli.ExitUsage
	}
	procs := goRuntime.Apply()
	logger := promslog.New(logConfig)

	var extra []prometheus.Collector
	var slurmRun func(context.Context)
	if *slurmDrain {
		sinfo, err := slurm.Look(*slurmSinfo, "--slurm.sinfo")
		if err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: --collector.slurm-drain: %v\n", err)
			return 2
		}
		name := *slurmNode
		if name == "" {
			if name, err = os.Hostname(); err != nil {
				fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: --collector.slurm-drain: no --slurm.node and no host name: %v\n", err)
				return 2
			}
		}
		drain := exporter.NewSlurmDrain(exporter.SlurmConfig{Sinfo: sinfo, Node: name, MaxAge: *slurmMaxAge, Logger: logger})
		slurmRun = drain.Run
		extra = append(extra, drain)
		logger.Info("Reporting whether Slurm drained this node because of gpu-orphan", "node", name, "sinfo", sinfo, "max_age", *slurmMaxAge)
	}

	if *statePath != "" {
		// A directory that another user can write, or a link at the
		// file, would have root read or replace what that user chose.
		if err := statefile.Check(*statePath); err != nil {
			logger.Error("Cannot start", "err", err)
			fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: %v\n", err)
			return cli.ExitFailure
		}
	}

	node, err := backend.Open(logger)
	if err != nil {
		logger.Error("Cannot start", "err", err)
		// The log line is for log pipelines; the person who started it
		// reads a plain last line.
		fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: %v\n", err)
		return cli.ExitFailure
	}
	defer node.Driver.Close()
	logger.Info("Starting gpu-orphan-exporter", "version", version.Info(), "backend", node.Driver.Name(), "interval", *interval, "gomaxprocs", procs)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	loop := snapshot.NewLoop(node.Taker, *interval, *orphanBytes)
	if *statePath != "" {
		path := *statePath
		cli.KeepLineage(logger, loop, node.Proc, "the state file "+path,
			func() ([]byte, bool, error) { return statefile.Load(path) },
			func(b []byte) error { return statefile.Save(path, b) })
	}
	extra = append(extra, cli.FollowForks(ctx, logger, loop, node.Proc, *processEvents))
	first := loop.Refresh(ctx, false)
	cli.LogSnapshot(logger, first)
	go loop.Run(ctx)
	if slurmRun != nil {
		go slurmRun(ctx)
	}
	go cli.LogChanges(ctx, logger, loop)

	handler, err := exporter.NewHandler(exporter.NewGatherer(exporter.NewRegistry(loop, logger, extra...), loop), *telemetryPath, logger)
	if err != nil {
		logger.Error("Cannot start", "err", err)
		return 1
	}
	server := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- web.ListenAndServe(server, webFlags, logger) }()
	select {
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			logger.Error("Serving failed", "err", err)
			fmt.Fprintf(os.Stderr, "gpu-orphan-exporter: %v\n", err)
			return cli.ExitFailure
		}
	case <-ctx.Done():
		logger.Info("Shutting down")
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		// Connections still open at the deadline end with the process.
		if err := server.Shutdown(shutdownCtx); err != nil {
			logger.Error("HTTP server did not shut down cleanly", "err", err)
		}
	}
	return 0
}
