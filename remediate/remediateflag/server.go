package remediateflag

import (
	"fmt"
	"math"
	"net/url"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

// Server holds what the flags of both serving binaries, the node agent
// (gpu-orphan-remediator) and gpu-orphan-dispatcher, set in app.Options
// once parsed: serving, authentication, the alerts' labels, the audit
// store, the breaker and the log.
type Server struct {
	o           *app.Options
	maxBody     uint64
	externalURL string
	storeSet    bool
	log         *promslog.Config
}

// DefaultStorePath is --store.path when it is not given, whoever runs the
// binary: the remediator's, which `gpu-orphan report`, `prolog` and
// `epilog` read by default too.
const DefaultStorePath = "/var/lib/gpu-orphan/remediator.db"

// AddServerFlags registers the flags that both serving binaries share,
// into o, but for the listen address and the web config (o.Web), whose
// default port each binary gives; call Finish after parsing.
func AddServerFlags(a *kingpin.Application, o *app.Options) *Server {
	s := &Server{o: o, log: &promslog.Config{}}
	a.Flag("auth.token-file", "File holding the bearer token that callers must send (Authorization: Bearer ...). Client certificates verified through --web.config.file are accepted too. On a node agent it is also the fleet's secret: gpu-orphan-dispatcher, with the same token in --dispatch.token-file, signs each request for --node.name with a key derived from it, and never sends the token.").StringVar(&o.Auth.TokenFile)
	a.Flag("auth.insecure-none", "Accept requests without any authentication. Only for local experiments. A request without a credential is then served only under the remediator's own names (--web.external-url's host, the listen address's), IP addresses and localhost (DNS rebinding): a webhook URL with a name needs that name in --web.external-url.").BoolVar(&o.Auth.InsecureNone)
	cli.Float64Var(a.Flag("auth.failures-per-minute", "Failed authentications allowed per source and minute before it gets 429.").Default("10"), &o.Auth.FailuresPerMinute)
	cli.BytesVar(a.Flag("web.max-body-bytes", "Largest webhook body accepted; larger ones get 413. Bytes, or a size with a unit: 1MiB.").Default("1MiB"), &s.maxBody)
	a.Flag("alert.node-label", "The alert label that names the node.").Default("node").StringVar(&o.NodeLabel)
	a.Flag("alert.uuid-label", "The alert label that names the GPU by UUID.").Default("uuid").StringVar(&o.UUIDLabel)
	a.Flag("store.path", "The audit database (SQLite, WAL). Every decision is written here before it is acknowledged. "+
		"Not given, it is "+DefaultStorePath+", for root and for any other user alike (its directory is created, 0700; "+
		"a user who may not create it must give --store.path), and the start-up log says so. Its directory must belong to the "+
		"remediator's user and be writable by no one else, and the database and its -wal and -shm are never followed if they "+
		"are symbolic links: either is refused at start, in one line that says what to run.").
		Default(DefaultStorePath).IsSetByUser(&s.storeSet).StringVar(&o.StorePath)
	a.Flag("web.external-url", "The URL under which browsers reach the remediator, when it is not the listen address (a proxy, a DNS name), e.g. https://gpu-17.example.com:10836. State-changing requests (the webhook, the breaker reset) from a browser page are accepted from this origin and the request's own only; with --web.ui.open (and --auth.insecure-none), /actions (and every request without a credential) is served under this name, the listen address's, IP addresses and localhost only (a defence against DNS rebinding). The pages' session cookie is bound to it; an https URL makes the cookie Secure and __Host-.").StringVar(&s.externalURL)
	a.Flag("web.ui.open", "Serve the /actions page (who leaks most, the latest actions, the breaker) without authentication, for a trusted network. Without it the page needs the API's bearer token or client certificate.").BoolVar(&o.UIOpen)
	def := limits.DefaultConfig()
	cli.DurationVar(a.Flag("limit.cooldown", "Per-GPU pause after a cleanup that sent signals.").Default(def.Cooldown.String()), &o.Limits.Cooldown)
	cli.IntVar(a.Flag("limit.breaker-failures", "Failed cleanups within --limit.breaker-window that open the circuit breaker (then nothing acts until POST /api/v1/breaker/reset).").Default(fmt.Sprint(def.BreakerFailures)), &o.Limits.BreakerFailures)
	cli.DurationVar(a.Flag("limit.breaker-window", "Window for --limit.breaker-failures.").Default(def.BreakerWindow.String()), &o.Limits.BreakerWindow)
	promslogflag.AddFlags(a, s.log)
	return s
}

// Finish sets the options that need more than a flag's value: the body
// limit, the external URL (checked) and the logger, and logs the audit
// database's path when it is the default. Its error is a usage error.
func (s *Server) Finish() error {
	s.o.MaxBodyBytes = int64(min(s.maxBody, math.MaxInt64))
	if s.externalURL != "" {
		u, err := url.Parse(s.externalURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("invalid --web.external-url %q: want an absolute http or https URL, e.g. https://gpu-17.example.com:10836", s.externalURL)
		}
		s.o.ExternalURL = u
	}
	s.o.Logger = promslog.New(s.log)
	// A node agent admits the dispatcher's requests signed for its own
	// name, with the key that its token derives for it; the dispatcher
	// has no node name, and never sends the token to agents.
	s.o.Auth.FleetNode = s.o.NodeName
	if !s.storeSet {
		// Not silently: a database under /var/lib is a surprise to whoever
		// tried the binary by hand as root.
		s.o.Logger.Info("No --store.path given: the audit database is the default", "store", s.o.StorePath)
	}
	return nil
}
