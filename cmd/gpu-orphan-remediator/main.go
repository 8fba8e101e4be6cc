// Command gpu-orphan-remediator receives Alertmanager's webhook
// notifications and gives orphaned GPU memory back: on a node it kills the
// holders (verified, rate-limited, audited); as a dispatcher it routes each
// alert to the agent of the node it names.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/api"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/engine"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

func main() { os.Exit(run()) }

type flags struct {
	web          *web.FlagConfig
	tokenFile    *string
	insecureNone *bool
	authFailures *float64
	maxBody      *int64
	role         *string
	nodeName     *string
	nodeLabel    *string
	uuidLabel    *string
	storePath    *string
	interval     *time.Duration
	backend      *cli.Backend
	remediation  *remediateflag.Remediation
	limits       limits.Config
	dispatch     struct {
		urlTemplate, targetsFile, tokenFile *string
		maxNodes                            *int
		maxFraction                         *float64
		window                              *time.Duration
		timeout                             *time.Duration
		maxAttempts                         *int
	}
}

func run() int {
	hostname, _ := os.Hostname()
	app := kingpin.New("gpu-orphan-remediator", `Receives Alertmanager's webhook notifications (POST /api/v1/alerts, payload version 4) and gives orphaned GPU memory back.

--role=node (default) acts on this node: for each firing alert whose `+"`node`"+` label is --node.name and whose `+"`uuid`"+` label names one of this node's GPUs, it takes a fresh snapshot, and if memory with no live owner is still there and older than --remediate.min-age, it kills the suspect holders (SIGTERM, then SIGKILL after --remediate.grace, through pidfds), verifies that the memory came back, and records everything in --store.path. Without --act it only records the plan (dry run).

--role=dispatcher is the single webhook target of a fleet: it routes each alert to the agent of the node it names, under fleet-wide limits.`)
	var f flags
	f.web = kingpinflag.AddFlags(app, ":9836")
	f.tokenFile = app.Flag("auth.token-file", "File holding the bearer token that callers must send (Authorization: Bearer ...). Client certificates verified through --web.config.file are accepted too.").String()
	f.insecureNone = app.Flag("auth.insecure-none", "Accept requests without any authentication. Only for local experiments.").Bool()
	f.authFailures = app.Flag("auth.failures-per-minute", "Failed authentications allowed per source and minute before it gets 429.").Default("10").Float64()
	f.maxBody = app.Flag("web.max-body-bytes", "Largest webhook body accepted; larger ones get 413.").Default("1048576").Int64()
	f.role = app.Flag("role", "node: act on this node. dispatcher: route alerts to node agents.").Default("node").Enum("node", "dispatcher")
	f.nodeName = app.Flag("node.name", "This node's name, as alerts carry it in the node label.").Default(hostname).String()
	f.nodeLabel = app.Flag("alert.node-label", "The alert label that names the node.").Default("node").String()
	f.uuidLabel = app.Flag("alert.uuid-label", "The alert label that names the GPU by UUID.").Default("uuid").String()
	f.storePath = app.Flag("store.path", "The audit database (SQLite, WAL). Every decision is written here before it is acknowledged.").Default("/var/lib/gpu-orphan/remediator.db").String()
	f.interval = app.Flag("collector.interval", "How often to take a background snapshot, which measures how long memory has had no live owner.").Default("5s").Duration()
	f.backend = cli.AddBackendFlags(app)
	f.remediation = remediateflag.AddRemediatorFlags(app)
	def := limits.DefaultConfig()
	app.Flag("limit.cooldown", "Per-GPU pause after a cleanup that sent signals.").Default(def.Cooldown.String()).DurationVar(&f.limits.Cooldown)
	app.Flag("limit.rate", "Cleanups per hour on this node (token bucket).").Default(fmt.Sprint(def.Rate)).Float64Var(&f.limits.Rate)
	app.Flag("limit.burst", "Token bucket size.").Default(fmt.Sprint(def.Burst)).IntVar(&f.limits.Burst)
	app.Flag("limit.concurrency", "Cleanups running at once on this node.").Default(fmt.Sprint(def.MaxConcurrent)).IntVar(&f.limits.MaxConcurrent)
	app.Flag("limit.breaker-failures", "Failed cleanups within --limit.breaker-window that open the circuit breaker (then nothing acts until POST /api/v1/breaker/reset).").Default(fmt.Sprint(def.BreakerFailures)).IntVar(&f.limits.BreakerFailures)
	app.Flag("limit.breaker-window", "Window for --limit.breaker-failures.").Default(def.BreakerWindow.String()).DurationVar(&f.limits.BreakerWindow)
	f.dispatch.urlTemplate = app.Flag("dispatch.url-template", "Dispatcher: node agent base URL, with {{.Node}} for the node label, e.g. https://{{.Node}}:9836.").String()
	f.dispatch.targetsFile = app.Flag("dispatch.targets-file", `Dispatcher: JSON file mapping node names to agent base URLs, e.g. {"gpu-a": "https://10.0.0.5:9836"}.`).String()
	f.dispatch.tokenFile = app.Flag("dispatch.token-file", "Dispatcher: bearer token sent to node agents.").String()
	f.dispatch.maxNodes = app.Flag("dispatch.max-nodes", "Dispatcher: most distinct nodes remediated per --dispatch.window.").Default("5").Int()
	f.dispatch.maxFraction = app.Flag("dispatch.max-fraction", "Dispatcher: most nodes remediated per window, as a fraction of the known nodes (the stricter limit wins).").Default("0.1").Float64()
	f.dispatch.window = app.Flag("dispatch.window", "Dispatcher: the fleet limit's window.").Default("1h").Duration()
	f.dispatch.timeout = app.Flag("dispatch.timeout", "Dispatcher: timeout of one request to a node agent.").Default("10s").Duration()
	f.dispatch.maxAttempts = app.Flag("dispatch.max-attempts", "Dispatcher: attempts to reach a node agent that is unreachable or answers 5xx (with backoff of 2s, 4s, ... up to 64s between them) before the alert's action is recorded as failed.").Default("8").Int()
	logConfig := &promslog.Config{}
	promslogflag.AddFlags(app, logConfig)
	app.Version(version.Print("gpu-orphan-remediator"))
	app.HelpFlag.Short('h')
	if _, err := app.Parse(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: %v\n", err)
		return 2
	}
	logger := promslog.New(logConfig)
	if err := serve(&f, logger); err != nil {
		logger.Error("Remediator failed", "err", err)
		return 1
	}
	return 0
}

func serve(f *flags, logger *slog.Logger) error {
	if *f.tokenFile == "" && *f.web.WebConfigFile == "" && !*f.insecureNone {
		return errors.New("authentication is required: give --auth.token-file (and/or client certificates through --web.config.file), or --auth.insecure-none for a local experiment")
	}
	if *f.insecureNone {
		logger.Warn("Authentication is OFF (--auth.insecure-none): anyone who reaches this port can trigger cleanups")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	reg := prometheus.NewRegistry()
	reg.MustRegister(versioncollector.NewCollector("gpu_orphan_remediator"), collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := remediate.NewMetrics(reg)

	if err := os.MkdirAll(filepath.Dir(*f.storePath), 0o750); err != nil {
		return fmt.Errorf("creating the directory of --store.path: %w", err)
	}
	st, err := store.Open(ctx, *f.storePath)
	if err != nil {
		return err
	}
	defer st.Close()
	auth, err := intake.NewAuth(intake.AuthConfig{TokenFile: *f.tokenFile, InsecureNone: *f.insecureNone, FailuresPerMinute: *f.authFailures}, metrics, logger)
	if err != nil {
		return err
	}

	var (
		exec     engine.Executor
		classify intake.Classifier
		breaker  api.Breaker
		resolved func(store.Alert)
		ready    = func() error { return nil }
		status   = api.Status{Role: *f.role, Node: *f.nodeName}
	)
	switch *f.role {
	case "node":
		opened, err := f.backend.Open(logger)
		if err != nil {
			return err
		}
		// Closed last: verifications of running actions still read it
		// while the engine drains at shutdown.
		defer opened.Driver.Close()
		node, loop, limiter, err := nodeRole(ctx, f, opened, st, metrics, logger)
		if err != nil {
			return err
		}
		exec, breaker = node, limiter
		classify = nodeClassifier(*f.nodeLabel, *f.uuidLabel, *f.nodeName, loop)
		ready = func() error {
			if s := loop.loop.Latest(); s == nil || !s.Healthy() {
				return errors.New("no healthy snapshot of the GPUs yet")
			}
			return nil
		}
		status.Act, status.Policy = f.remediation.Act, f.remediation.Policy
	case "dispatcher":
		d, fleet, err := dispatcherRole(ctx, f, st, metrics, logger)
		if err != nil {
			return err
		}
		exec, breaker = d, fleet
		classify = dispatchClassifier(*f.nodeLabel, *f.uuidLabel, d)
		// Resolved alerts go on to the node, to cancel its queued work.
		resolved = func(a store.Alert) {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), *f.dispatch.timeout)
				defer cancel()
				d.ForwardResolved(ctx, a.Node, a.GPUUUID, a.Fingerprint, a.StartsAt)
			}()
		}
	}
	eng := engine.New(st, exec, 0, metrics, logger)
	if err := eng.Recover(ctx); err != nil {
		return fmt.Errorf("marking interrupted actions: %w", err)
	}
	webhook := intake.NewHandler(intake.Config{Recorder: st, Classify: classify, MaxBodyBytes: *f.maxBody, Wake: eng.Wake,
		Resolved: resolved, Metrics: metrics, Logger: logger})
	router, err := api.NewRouter(api.Config{
		Webhook: webhook, Auth: auth, Store: st, Breaker: breaker, Registry: reg, Logger: logger,
		Ready: func() error {
			if err := eng.StoreErr(); err != nil {
				return fmt.Errorf("audit store: %w", err)
			}
			return ready()
		},
		Status: func(ctx context.Context) api.Status {
			s := status
			s.BreakerOpen = breaker.BreakerOpen()
			if err := eng.StoreErr(); err != nil {
				s.StoreError = err.Error()
			}
			s.QueueDepth, _ = st.QueueDepth(ctx)
			return s
		},
	})
	if err != nil {
		return err
	}

	// Running cleanups get the grace period plus the verification time to
	// finish on shutdown.
	drain := f.remediation.Grace + f.remediation.VerifyTimeout + 5*time.Second
	engCtx, stopEngine := context.WithCancel(context.Background())
	engDone := make(chan struct{})
	go func() { eng.Run(engCtx, drain); close(engDone) }()

	logger.Info("Starting gpu-orphan-remediator", "version", version.Info(), "role", *f.role, "node", *f.nodeName,
		"act", f.remediation.Act, "policy", f.remediation.Policy, "store", *f.storePath)
	server := &http.Server{Handler: router, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- web.ListenAndServe(server, f.web, logger) }()
	select {
	case err = <-errc:
	case <-ctx.Done():
		logger.Info("Shutting down: finishing running actions")
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		server.Shutdown(shutdownCtx)
		cancel()
	}
	// Let running cleanups finish their ladder and verification; an action
	// cut short here is marked interrupted at the next start.
	stopEngine()
	<-engDone
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// nodeClassifier accepts alerts for this node and one of its GPUs.
func nodeClassifier(nodeLabel, uuidLabel, nodeName string, loop interface {
	KnownGPU(uuid string) bool
}) intake.Classifier {
	return func(labels map[string]string) (string, string, string) {
		node, uuid := labels[nodeLabel], labels[uuidLabel]
		switch {
		case uuid == "":
			return node, uuid, "no " + uuidLabel + " label"
		case node == "":
			return node, uuid, "no " + nodeLabel + " label"
		case node != nodeName:
			return node, uuid, "for another node"
		case !loop.KnownGPU(uuid):
			return node, uuid, "uuid names no GPU of this node"
		}
		return node, uuid, ""
	}
}

// dispatchClassifier accepts alerts that name a node it can route to.
func dispatchClassifier(nodeLabel, uuidLabel string, d *dispatch.Dispatcher) intake.Classifier {
	return func(labels map[string]string) (string, string, string) {
		node, uuid := labels[nodeLabel], labels[uuidLabel]
		switch {
		case uuid == "" || !strings.HasPrefix(uuid, "GPU-") && !strings.HasPrefix(uuid, "MIG-"):
			return node, uuid, "no valid " + uuidLabel + " label"
		case !d.Known(node):
			return node, uuid, "no route to the node"
		}
		return node, uuid, ""
	}
}
