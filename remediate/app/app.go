// Package app is the remediator: it wires the audit store, authentication,
// the role (a node's cleanup, or the fleet's dispatcher), the queue runner
// and the HTTP API, serves until its context ends, and shuts down so that
// running cleanups finish. cmd/gpu-orphan-remediator parses the flags into
// Options and calls Run.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/api"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/engine"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
	"github.com/gpu-orphan/gpu-orphan/remediate/ui"
)

// Role is what the remediator does with the alerts it accepts.
type Role string

const (
	// RoleNode acts on this node.
	RoleNode Role = "node"
	// RoleDispatcher routes each alert to the remediator of its node.
	RoleDispatcher Role = "dispatcher"
)

// Options configure the remediator. Each field has the flag of the same
// meaning in cmd/gpu-orphan-remediator.
type Options struct {
	// Web is exporter-toolkit's serving configuration: listen addresses,
	// systemd socket activation, and the web config file (TLS, basic auth,
	// client certificates).
	Web *web.FlagConfig
	// Auth is the bearer token's file and the failure limit; a token, a
	// web config or Auth.InsecureNone is required.
	Auth         intake.AuthConfig
	MaxBodyBytes int64

	Role Role
	// NodeName is this node's name, as alerts carry it in NodeLabel.
	NodeName             string
	NodeLabel, UUIDLabel string
	// StorePath is the audit database; its directory is created if need
	// be (store.MakeDir, which also checks it), once everything else
	// checked out.
	StorePath string
	// UIOpen serves the /actions page without authentication, for a
	// trusted network; otherwise it is behind the API's.
	UIOpen bool
	// ExternalURL is the URL browsers use to reach the remediator, when
	// another than its listen address (a proxy, a DNS name): the origin
	// allowed to send state-changing requests besides the request's own,
	// and with UIOpen a name the page is served under.
	ExternalURL *url.URL

	// The node's cleanup.
	Backend cli.Backend
	// Interval is the background snapshot's, which runs the age clocks.
	Interval time.Duration
	// ProcessEvents follows the kernel's process events, the proof of
	// descent at fork (cli.FollowForks).
	ProcessEvents bool
	Decide        decide.Config
	Act           bool
	Grace         time.Duration
	VerifyTimeout time.Duration
	Limits        limits.Config

	// Dispatch is the dispatcher's routing and fleet limits.
	Dispatch Dispatch
	// Dispatcher wires RoleDispatcher. Only gpu-orphan-dispatcher sets it
	// (package remediate/app/dispatcher), so that the node agent does not
	// link the dispatcher's Kubernetes client.
	Dispatcher RoleFunc

	Logger *slog.Logger
}

// Dispatch configures RoleDispatcher.
type Dispatch struct {
	// URLTemplate builds a node's base URL from {{.Node}}, for the nodes
	// that the targets file names with an empty URL only.
	URLTemplate string
	// TargetsFile is the allow-list: a JSON object of node name to base
	// URL, read again when it changes.
	TargetsFile string
	// TokenFile holds the bearer token sent to node agents.
	TokenFile   string
	MaxNodes    int
	MaxFraction float64
	Window      time.Duration
	// Timeout bounds one request to a node agent.
	Timeout     time.Duration
	MaxAttempts int
	// Kubernetes is the second allow-list, the agents' EndpointSlices;
	// on when its Service is set. The targets file wins for the nodes it
	// names.
	Kubernetes Kubernetes
}

// Kubernetes configures the discovery of node agents in the cluster.
type Kubernetes struct {
	// Service is the node agents' Service; empty turns discovery off.
	Service string
	// Namespace is the Service's; empty means the pod's own.
	Namespace string
	// PortName is the EndpointSlice port of the agents, served with
	// Scheme (http or https).
	PortName, Scheme string
	// Kubeconfig is for running outside a cluster; empty means the
	// in-cluster configuration.
	Kubeconfig string
	// SyncTimeout bounds the first list at start-up.
	SyncTimeout time.Duration
	// DaemonSet is the agents' DaemonSet: an endpoint is an agent only if
	// it names a pod of it on its node; empty means Service's name.
	DaemonSet string
	// Lease, when set, is the Lease in Namespace where the dispatcher
	// replicas keep the fleet limit's window together (package
	// dispatch/lease); it needs no Service.
	Lease string
}

// Run serves until ctx ends, then lets running cleanups finish (their
// grace and verification, plus 5 s) before it returns. Everything that can
// be checked without the audit store (authentication, the token files, the
// backend, the dispatcher's routes) is checked before the store is
// created, so a start that fails leaves no database behind.
func Run(ctx context.Context, o Options) error {
	logger := o.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	webConfigFile := ""
	if o.Web != nil && o.Web.WebConfigFile != nil {
		webConfigFile = *o.Web.WebConfigFile
	}
	if o.Auth.TokenFile == "" && webConfigFile == "" && !o.Auth.InsecureNone {
		return cli.Usagef("authentication is required: give --auth.token-file (and/or client certificates through --web.config.file), or --auth.insecure-none for a local experiment")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(versioncollector.NewCollector("gpu_orphan_remediator"), collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := remediate.NewMetrics(reg)
	authConfig := o.Auth
	// The pages' session cookies are this remediator's only; without
	// authentication, requests are served under its own names only.
	authConfig.Session = intake.SessionScope{Role: string(o.Role), Node: o.NodeName, Listeners: listenAddresses(o), ExternalURL: o.ExternalURL}
	authConfig.Hosts = webHosts(o)
	auth, err := intake.NewAuth(authConfig, metrics, logger)
	if err != nil {
		return err
	}
	if o.Role == RoleDispatcher && o.Dispatch.TokenFile != "" {
		// The agents refuse a short or example token; say so at start.
		if _, err := intake.ReadTokenFile("--dispatch.token-file", o.Dispatch.TokenFile); err != nil {
			return err
		}
	}
	if o.Auth.InsecureNone {
		logger.Warn("Authentication is OFF (--auth.insecure-none): anyone who reaches this port can trigger cleanups")
	}

	// The role's checks, then the store, then the role's wiring to it.
	var (
		wire    func(st *store.Store) (Wiring, error)
		release func()
	)
	switch o.Role {
	case RoleNode:
		wire, release, err = nodeRole(ctx, o, metrics, reg, logger)
	case RoleDispatcher:
		if o.Dispatcher == nil {
			return errors.New("the dispatcher is its own binary: run gpu-orphan-dispatcher")
		}
		wire, release, err = o.Dispatcher(ctx, o, metrics, reg, logger)
	default:
		err = cli.Usagef("unknown role %q: want %s or %s", o.Role, RoleNode, RoleDispatcher)
	}
	if err != nil {
		return err
	}
	if release != nil {
		// Closed last: verifications of running actions still read the
		// driver while the engine drains at shutdown.
		defer release()
	}
	// The directory is created 0700 and checked (owner, mode, not a link)
	// by the same code as the prolog's, the epilog's and the CLI's.
	if err := store.MakeDir(o.StorePath); err != nil {
		return err
	}
	st, err := store.Open(ctx, o.StorePath)
	if err != nil {
		return err
	}
	defer st.Close()
	// An alert whose action left its memory held gets another attempt on
	// its next notification once the GPU's cooldown has passed; the
	// cooldown is measured from the record, so it holds across restarts.
	st.SetRetry(store.RetryPolicy{MaxAttempts: store.DefaultMaxAttempts, Cooldown: o.Limits.Cooldown})
	// The store's actions by source, the prolog's, the epilog's and the
	// CLI's included: those short-lived processes have no /metrics.
	recorded := []string{remediate.SourceWebhook, remediate.SourceCLI, remediate.SourceProlog, remediate.SourceEpilog}
	if o.Role == RoleDispatcher {
		recorded = []string{remediate.SourceDispatch}
	}
	reg.MustRegister(remediate.NewRecordedCollector(st, recorded, logger))
	r, err := wire(st)
	if err != nil {
		return err
	}
	return serve(ctx, o, st, r, auth, reg, metrics, logger)
}

// serve runs the queue and the HTTP API until ctx ends.
func serve(ctx context.Context, o Options, st *store.Store, r Wiring, auth *intake.Auth, reg *prometheus.Registry, metrics *remediate.Metrics, logger *slog.Logger) error {
	eng := engine.New(st, r.Exec, 0, metrics, logger)
	if err := eng.Recover(ctx); err != nil {
		return fmt.Errorf("marking interrupted actions: %w", err)
	}
	status := api.Status{Role: string(o.Role), Node: o.NodeName}
	if o.Role == RoleNode {
		status.Act, status.Policy = o.Act, o.Decide.Policy
	}
	webhook := intake.NewHandler(intake.Config{Recorder: st, Classify: r.Classify, Reject: r.Reject, MaxBodyBytes: o.MaxBodyBytes, Wake: eng.Wake,
		Resolved: r.Resolved, Metrics: metrics, Logger: logger})
	router, err := api.NewRouter(api.Config{
		Webhook: webhook, Auth: auth, Store: st, Breaker: r.Breaker, Registry: reg, Logger: logger, ExternalURL: o.ExternalURL,
		Ready: func() error {
			if err := eng.StoreErr(); err != nil {
				return fmt.Errorf("audit store: %w", err)
			}
			if r.Ready != nil {
				return r.Ready()
			}
			return nil
		},
		Status: func(ctx context.Context) api.Status {
			s := status
			s.BreakerOpen = r.Breaker.BreakerOpen()
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
	uiConfig := ui.Config{Store: st, Breaker: r.Breaker, Role: string(o.Role), SignedIn: auth.SignedIn, Logger: logger}
	if o.Role == RoleNode {
		uiConfig.Act, uiConfig.Policy = o.Act, o.Decide.Policy
		if uiConfig.Policy == "" {
			uiConfig.Policy = remediate.PolicyDeadOwner
		}
	}
	if o.UIOpen {
		uiConfig.Hosts = webHosts(o)
	}
	// The pages: open under the Host check with --web.ui.open, else behind
	// the API's authentication, where a browser signs in with the token
	// through a form (POST /actions/login) and gets a session cookie.
	page := ui.Handler(uiConfig)
	if !o.UIOpen {
		page = auth.WrapPage(page, uiConfig.Denied)
	}
	login, err := auth.Login(o.ExternalURL, uiConfig.Denied)
	if err != nil {
		return fmt.Errorf("--web.external-url: %w", err)
	}
	logout, err := auth.Logout(o.ExternalURL, uiConfig.Denied)
	if err != nil {
		return fmt.Errorf("--web.external-url: %w", err)
	}
	root := http.NewServeMux()
	root.Handle("GET /actions", page)
	root.Handle("GET /actions/{id}", page)
	root.HandleFunc("GET /actions/{$}", ui.TrailingSlash)
	root.Handle("POST /actions/login", login)
	root.Handle("POST /actions/logout", logout)
	root.Handle("/", router)

	// Running cleanups get the grace period plus the verification time to
	// finish on shutdown.
	drain := o.Grace + o.VerifyTimeout + 5*time.Second
	engCtx, stopEngine := context.WithCancel(context.WithoutCancel(ctx))
	engDone := make(chan struct{})
	go func() { eng.Run(engCtx, drain); close(engDone) }()

	logger.Info("Starting gpu-orphan-remediator", "version", version.Info(), "role", o.Role, "node", o.NodeName,
		"act", o.Act, "policy", o.Decide.Policy, "store", o.StorePath, "gomaxprocs", runtime.GOMAXPROCS(0))
	server := &http.Server{Handler: root, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- web.ListenAndServe(server, o.Web, logger) }()
	select {
	case err = <-errc:
	case <-ctx.Done():
		logger.Info("Shutting down: finishing running actions")
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		// Connections still open at the deadline end with the process.
		if err := server.Shutdown(shutdownCtx); err != nil {
			logger.Error("HTTP server did not shut down cleanly", "err", err)
		}
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

// webHosts are the names the open /actions page, and with
// --auth.insecure-none every request without a credential, is served
// under: the external URL's host and the listen addresses' (IP addresses
// and localhost are added by intake.HostAllowed).
func webHosts(o Options) []string {
	hosts := []string{}
	if o.ExternalURL != nil && o.ExternalURL.Hostname() != "" {
		hosts = append(hosts, o.ExternalURL.Hostname())
	}
	for _, a := range listenAddresses(o) {
		if h, _, err := net.SplitHostPort(a); err == nil && h != "" {
			hosts = append(hosts, h)
		}
	}
	return hosts
}

// listenAddresses are --web.listen-address's values.
func listenAddresses(o Options) []string {
	if o.Web == nil || o.Web.WebListenAddresses == nil {
		return nil
	}
	return *o.Web.WebListenAddresses
}
