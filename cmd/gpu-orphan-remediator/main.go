// Command gpu-orphan-remediator is the node agent: it receives
// Alertmanager's webhook notifications and gives orphaned GPU memory back
// on its node, killing the holders (verified, rate-limited, audited). The
// fleet's dispatcher is gpu-orphan-dispatcher; --role=dispatcher still runs
// it, for one release (dispatcher.go). The flags are parsed here; the
// remediator itself is package remediate/app.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
)

func main() { os.Exit(run()) }

func run() int {
	if args, ok := dispatcherArgs(os.Args[1:]); ok {
		return execDispatcher(args)
	}
	hostname, _ := os.Hostname()
	a := kingpin.New("gpu-orphan-remediator", `Receives Alertmanager's webhook notifications (POST /api/v1/alerts, payload version 4) and gives orphaned GPU memory back on this node: for each firing alert whose `+"`node`"+` label is --node.name and whose `+"`uuid`"+` label names one of this node's GPUs, it takes a fresh snapshot, and if memory with no live owner is still there and older than --remediate.min-age, it kills the suspect holders (SIGTERM, then SIGKILL after --remediate.grace, through pidfds), verifies that the memory came back, and records everything in --store.path. Without --act it only records the plan (dry run).

The fleet's single webhook target, which routes each alert to the agent of the node it names, is gpu-orphan-dispatcher.`)
	var o app.Options
	o.Web = kingpinflag.AddFlags(a, ":10836")
	server := remediateflag.AddServerFlags(a, &o)
	cli.EnumVar(a.Flag("role", "node: act on this node. dispatcher (deprecated, for one release): run gpu-orphan-dispatcher with the other arguments.").Default(string(app.RoleNode)), &o.Role, app.RoleNode, app.RoleDispatcher)
	a.Flag("node.name", "This node's name, as alerts carry it in the node label.").Default(hostname).StringVar(&o.NodeName)
	cli.DurationVar(a.Flag("collector.interval", "How often to take a background snapshot, which measures how long memory has had no live owner.").Default("5s"), &o.Interval)
	cli.ProcessEventsFlag(a).BoolVar(&o.ProcessEvents)
	backend := cli.AddBackendFlags(a)
	backend.AddDaemonFlags(a)
	goRuntime := cli.AddRuntimeFlags(a)
	remediation := remediateflag.AddRemediatorFlags(a)
	def := limits.DefaultConfig()
	cli.Float64Var(a.Flag("limit.rate", "Cleanups per hour on this node (token bucket).").Default(fmt.Sprint(def.Rate)), &o.Limits.Rate)
	cli.IntVar(a.Flag("limit.burst", "Token bucket size.").Default(fmt.Sprint(def.Burst)), &o.Limits.Burst)
	cli.IntVar(a.Flag("limit.concurrency", "Cleanups running at once on this node.").Default(fmt.Sprint(def.MaxConcurrent)), &o.Limits.MaxConcurrent)
	a.Version(version.Print("gpu-orphan-remediator"))
	cli.HelpOnStdout(a)
	if _, err := a.Parse(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: %s\n", cli.ParseError(a, err))
		return 2
	}
	if err := server.Finish(); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: %s\n", err)
		return 2
	}
	goRuntime.Apply()
	o.Backend = *backend
	o.Decide = remediation.DecideConfig()
	o.Act, o.Grace, o.VerifyTimeout = remediation.Act, remediation.Grace, remediation.VerifyTimeout

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := app.Run(ctx, o)
	if err != nil {
		o.Logger.Error("Remediator failed", "err", err)
		// The log line is for log pipelines; the person who started it
		// reads a plain last line.
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: %v\n", err)
	}
	return cli.ExitCode(err)
}
