// Command gpu-orphan-demo is `make run`: the whole loop on this machine,
// narrated as it happens. It starts the stack of internal/stack, makes an
// orphan on the simulated node (a job whose parent is killed with SIGKILL
// while its forked children keep its GPU memory), tells what each part of
// the loop does about it, and keeps the stack running until Ctrl+C. It is
// a developer's tool, not one of the shipped binaries.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/version"
	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/stack"
)

const help = `The whole loop on this machine, narrated: orphan -> alert -> cleanup -> memory back.

It starts gpu-orphan-exporter, gpu-orphan-remediator (with --act), Prometheus
with the project's own alerts/gpu-orphan.rules.yml (a copy whose
GPUOrphanMemory thresholds are shortened to seconds) and Alertmanager, which
sends GPUOrphanMemory to the remediator's webhook with a bearer token.
Everything lives under --run.dir. On the simulated node it then starts a job
whose two forked children keep its GPU memory, kills the job's parent with
SIGKILL, and tells what each part of the loop does about it. Ctrl+C stops
everything it started.

  make run                  # a simulated node: no GPU needed
  make run BACKEND=nvml     # a GPU node: the real driver
  RUN_ONCE=1 make run       # exit 0 once the memory is back (CI smoke)

Each flag can also be set by the environment variable its help names.`

func main() { os.Exit(run()) }

// options are the demo's flags.
type options struct {
	backend            string
	dir, binDir, rules string
	once, act          bool
	timeout            seconds
	node               string
	gpu, mib, children int
	expPort, remPort   int
	promPort, amPort   int
	freePorts          bool
	daemonLogLevel     string
}

func run() int {
	var o options
	app := kingpin.New("gpu-orphan-demo", help)
	app.Version(version.Print("gpu-orphan-demo"))
	cli.HelpOnStdout(app)
	cli.EnumVar(app.Flag("backend", "sim (a simulated node) or nvml (the real driver).").Envar("BACKEND").Default(stack.BackendSim),
		&o.backend, stack.BackendSim, stack.BackendNVML)
	app.Flag("run.dir", "Configurations, token, data and logs.").Envar("RUN_DIR").Default(".run").StringVar(&o.dir)
	app.Flag("run.once", "Exit 0 once the memory is back; 1 if it is not back within --run.timeout.").Envar("RUN_ONCE").BoolVar(&o.once)
	app.Flag("run.timeout", "How long the loop may take, in seconds or as a duration (on a GPU node, only with --run.once).").
		Envar("RUN_TIMEOUT").Default("120").SetValue(&o.timeout)
	app.Flag("act", "Let the remediator act; --no-act (ACT=0) makes it a dry run.").Envar("ACT").Default("true").BoolVar(&o.act)
	app.Flag("node.name", "The node label and the remediator's --node.name.").Envar("NODE_NAME").Default(hostname()).StringVar(&o.node)
	cli.IntVar(app.Flag("sim.gpu", "The simulated job's GPU.").Envar("SIM_GPU").Default("1"), &o.gpu)
	cli.IntVar(app.Flag("sim.mib", "The simulated job's memory, in MiB.").Envar("SIM_MIB").Default("4096"), &o.mib)
	cli.IntVar(app.Flag("sim.children", "The simulated job's forked children.").Default("2"), &o.children)
	app.Flag("bin.dir", "Where gpu-orphan-exporter, -remediator and -sim are; default: beside this binary.").Envar("BIN_DIR").StringVar(&o.binDir)
	app.Flag("rules.file", "The alert rules Prometheus evaluates (a shortened copy).").Default("alerts/gpu-orphan.rules.yml").StringVar(&o.rules)
	cli.IntVar(app.Flag("exporter.port", "The exporter's port; 0: 10835. A port that is set is used or fails.").Envar("EXPORTER_PORT"), &o.expPort)
	cli.IntVar(app.Flag("remediator.port", "The remediator's port; 0: 10836.").Envar("REMEDIATOR_PORT"), &o.remPort)
	cli.IntVar(app.Flag("prometheus.port", "Prometheus's port; 0: 9090, or 19090 if busy.").Envar("PROMETHEUS_PORT"), &o.promPort)
	cli.IntVar(app.Flag("alertmanager.port", "Alertmanager's port; 0: 9093, or 19093 if busy.").Envar("ALERTMANAGER_PORT"), &o.amPort)
	app.Flag("ports.free", "Free ports instead of the defaults: for a run beside another, as the end-to-end tests do. "+
		"The exporter and the remediator serve on sockets the demo holds; Prometheus and Alertmanager on ports below the kernel's ephemeral range.").
		Envar("FREE_PORTS").BoolVar(&o.freePorts)
	app.Flag("daemons.log-level", "The daemons' --log.level; empty: their default.").StringVar(&o.daemonLogLevel)
	if _, err := app.Parse(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-demo: %s\n", cli.ParseError(app, err))
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return demo(ctx, o, os.Stdout)
}

// demo runs the loop until ctx ends (Ctrl+C, SIGTERM) or, with --run.once,
// until the memory is back. A stop by signal is the demo's normal end: it
// returns 0 once everything it started is stopped, and 1 if something could
// not be stopped. (130 made `make run` end every clean Ctrl+C with
// "make: *** [Makefile:NNN: run] Error 130".)
func demo(ctx context.Context, o options, out io.Writer) (code int) {
	n := &stack.Narrator{W: out, Color: isTerminal(out)}
	fail := func(format string, args ...any) int {
		fmt.Fprintf(os.Stderr, "gpu-orphan-demo: "+format+"\n", args...)
		return 1
	}
	if o.binDir == "" {
		self, err := os.Executable()
		if err != nil {
			return fail("%v: set --bin.dir", err)
		}
		o.binDir = filepath.Dir(self)
	}
	dir, err := filepath.Abs(o.dir)
	if err != nil {
		return fail("%v", err)
	}
	prom, am, err := stack.FindTools()
	if err != nil {
		return fail("%v", err)
	}
	p := stack.Ports{
		Exporter: ports(o.expPort, 10835), Remediator: ports(o.remPort, 10836),
		Prometheus: ports(o.promPort, 9090, 19090), Alertmanager: ports(o.amPort, 9093, 19093),
	}
	if o.freePorts {
		if o.expPort != 0 || o.remPort != 0 || o.promPort != 0 || o.amPort != 0 {
			return fail("--ports.free (FREE_PORTS) and a port that is set exclude each other")
		}
		p = stack.Ports{}
	}

	n.Bold(fmt.Sprintf("gpu-orphan: the whole loop on node '%s' (%s backend)", o.node, o.backend))
	n.Info("configs, token, logs and data: " + dir)
	s, err := stack.Start(ctx, stack.Config{
		Dir: dir, BinDir: o.binDir, Prometheus: prom, Alertmanager: am, RulesFile: o.rules,
		Backend: o.backend, NodeName: o.node, DryRun: !o.act, LogLevel: o.daemonLogLevel,
		Ports:   p,
		OnEvent: n.Event,
	})
	if err != nil {
		if ctx.Err() != nil {
			// Interrupted while starting: Start stopped what it had
			// started.
			return 0
		}
		return fail("%v", err)
	}
	defer func() {
		fmt.Fprintln(out)
		if err := s.Stop(); err != nil {
			code = fail("%v", err)
		}
		n.Info("logs are in " + s.Logs)
	}()
	cfg := s.Config()

	fmt.Fprintln(out)
	n.Bold("Running (Ctrl+C stops everything):")
	n.Info("exporter      " + s.URLs.Exporter + "/metrics")
	mode := "acts (--act)"
	if !o.act {
		mode = "dry run (ACT=0)"
	}
	n.Info("remediator    " + s.URLs.Remediator + "/   " + mode)
	n.Info("actions page  " + s.URLs.Remediator + "/actions   (who leaked, what was killed and why; open without the token: the demo listens on 127.0.0.1)")
	// Debian's Prometheus serves only its classic UI, and Debian's
	// Alertmanager none at all.
	ui := ""
	if code, _ := httpGet(ctx, s.URLs.Prometheus+"/alerts"); code != http.StatusOK {
		ui = "/classic"
	}
	n.Info(fmt.Sprintf("Prometheus    %s%s/alerts   %s%s/graph?g0.expr=gpu_orphan_unowned_memory_bytes", s.URLs.Prometheus, ui, s.URLs.Prometheus, ui))
	if _, body := httpGet(ctx, s.URLs.Alertmanager+"/"); strings.Contains(body, "does not include a web") {
		n.Info(fmt.Sprintf("Alertmanager  %s/api/v2/alerts   (no web UI in this package; or: amtool --alertmanager.url=%s alert query)",
			s.URLs.Alertmanager, s.URLs.Alertmanager))
	} else {
		n.Info("Alertmanager  " + s.URLs.Alertmanager + "/#/alerts")
	}
	n.Info(fmt.Sprintf(`actions       curl -sH "Authorization: Bearer $(cat %s)" %s/api/v1/actions`, s.TokenFile, s.URLs.Remediator))
	n.Info(fmt.Sprintf("rules         %s: GPUOrphanMemory after %ds with no live owner, for: %s", s.RulesCopy, cfg.AgeThreshold, cfg.For))
	fmt.Fprintln(out)

	lc := stack.LoopConfig{GPU: o.gpu, MiB: o.mib, Children: o.children, Sole: true}
	if o.backend == stack.BackendNVML {
		lc = stack.LoopConfig{GPU: -1}
		n.Event(stack.Event{Stage: stack.StageWorkload, Warning: true, Text: "The remediator runs with --act on this GPU node: it kills " +
			"processes that hold GPU memory whose creator is dead (policy dead-owner). ACT=0 makes it a dry run."})
		n.Info("Make an orphan on a GPU (PyTorch needed), then kill its parent:")
		n.Info("  python3 shared/gpu/fork_orphan.py --gib 6 --children 2 --device 0 &   # prints: ready PARENT CHILD...")
		n.Info("  kill -9 PARENT")
		n.Info("Waiting for GPU memory with no live owner (> 1 GiB); the times below count from when it is seen.")
	}
	loop := s.NewLoop(lc)
	last := stack.StageResolvedReceived
	if o.once {
		last = stack.StageMemoryBack
	}
	loopCtx := ctx
	if o.backend == stack.BackendSim || o.once {
		var cancel context.CancelFunc
		loopCtx, cancel = context.WithTimeoutCause(ctx, time.Duration(o.timeout), errLoopTimeout)
		defer cancel()
	}
	err = loop.Run(loopCtx, last)
	switch {
	case ctx.Err() != nil:
		return 0
	case errors.Is(err, stack.ErrDryRun):
	case errors.Is(err, errLoopTimeout):
		n.Event(stack.Event{Stage: loop.Next(), Warning: true, Text: fmt.Sprintf("the loop did not finish within %s (stuck at: %s); the logs are in %s",
			time.Duration(o.timeout), loop.Next(), s.Logs)})
		if o.once {
			return 1
		}
	case err != nil:
		n.Event(stack.Event{Stage: loop.Next(), Warning: true, Text: err.Error()})
		if o.once || s.Err() != nil {
			return 1
		}
	}
	if o.once {
		n.Info("RUN_ONCE=1: stopping.")
		return 0
	}

	fmt.Fprintln(out)
	n.Bold("The loop is done; the stack keeps running. Look around (the addresses above), then Ctrl+C to stop.")
	// The hint for another orphan follows the remediator's cooldowns: it
	// is told again whenever the GPU to use, or whether it must wait,
	// changes.
	lastHint := ""
	hint := func() {
		if o.backend != stack.BackendSim {
			return
		}
		actions, err := s.Actions(ctx)
		if err != nil {
			return
		}
		now := time.Now()
		gpu, ready := stack.NextOrphan(cfg.SimGPUs, actions, stack.Cooldown, now)
		if key := fmt.Sprint(gpu, ready.After(now)); key != lastHint {
			lastHint = key
			for _, l := range stack.OrphanHint(filepath.Join(o.binDir, "gpu-orphan-sim"), s.SimRoot, cfg.SimGPUs, actions, stack.Cooldown, now) {
				n.Info(l)
			}
		}
	}
	hint()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return 0
		case <-tick.C:
			if err := s.Err(); err != nil {
				n.Event(stack.Event{Stage: stack.StageStopped, Warning: true, Text: err.Error()})
				return 1
			}
			hint()
		}
	}
}

var errLoopTimeout = errors.New("the loop's time is up")

// ports is the port that was set, or the defaults.
func ports(set int, defaults ...int) []int {
	if set != 0 {
		return []int{set}
	}
	return defaults
}

func httpGet(ctx context.Context, u string) (int, string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, ""
	}
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(b)
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil {
		return "localhost"
	}
	h, _, _ = strings.Cut(h, ".")
	return h
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// seconds is a duration given as a number of seconds (RUN_TIMEOUT=120) or
// as a Go duration (2m).
type seconds time.Duration

func (s *seconds) Set(v string) error {
	if n, err := strconv.Atoi(v); err == nil {
		*s = seconds(time.Duration(n) * time.Second)
		return nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("invalid --run.timeout %q: want seconds (120) or a duration (2m)", v)
	}
	*s = seconds(d)
	return nil
}

func (s *seconds) String() string { return time.Duration(*s).String() }
