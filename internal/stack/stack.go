// Package stack starts the whole loop on one machine and follows an orphan
// through it: a simulated GPU node (or the real driver),
// gpu-orphan-exporter, a real Prometheus evaluating the project's alert
// rules, a real Alertmanager, and gpu-orphan-remediator acting on its
// webhook, all on loopback ports, with their configurations, data and logs
// under one directory.
//
// `make run` narrates a Loop (cmd/gpu-orphan-demo, with Narrator);
// `make e2e` asserts the same stages (test/e2e/). Prometheus and Alertmanager
// are talked to over HTTP only.
package stack

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Backends.
const (
	BackendSim  = "sim"
	BackendNVML = "nvml"
)

// The remediator's timing for a loop of seconds. Its minimum age must stay
// below the rules' age threshold (Config.AgeThreshold).
const (
	collectorInterval = "500ms"
	minAge            = "2s"
	grace             = "2s"
	verifyTimeout     = "15s"
)

var (
	//go:embed prometheus.yml.tmpl
	prometheusTmpl string
	//go:embed alertmanager.yml.tmpl
	alertmanagerTmpl string

	placeholder = regexp.MustCompile(`@[A-Z_]+@`)
)

// Config says what to start, and where.
type Config struct {
	// Dir holds everything of one run: the configurations, the token, the
	// data of Prometheus, Alertmanager and the remediator, the simulated
	// node, and logs/. Start clears what a previous run left there, and
	// locks Dir/run.pid so that two runs cannot share it.
	Dir string
	// BinDir holds gpu-orphan-exporter, gpu-orphan-remediator and
	// gpu-orphan-sim.
	BinDir string
	// Prometheus and Alertmanager are their executables (FindTools).
	Prometheus, Alertmanager string
	// RulesFile is alerts/gpu-orphan.rules.yml. Prometheus evaluates a copy
	// (RulesCopy) whose GPUOrphanMemory fires after AgeThreshold seconds
	// (3 if 0) with no live owner, held For (2s if 0).
	RulesFile    string
	AgeThreshold int
	For          time.Duration
	// Backend is BackendSim (the default: a node of SimGPUs GPUs, 2 if 0,
	// under Dir/node) or BackendNVML (the real driver).
	Backend string
	SimGPUs int
	// NodeName is the node label of the scrape targets and the
	// remediator's --node.name.
	NodeName string
	// DryRun runs the remediator without --act.
	DryRun bool
	// Ports lists, per daemon, the ports to try on 127.0.0.1, in order; an
	// empty list takes a free one.
	Ports Ports
	// LogLevel is every daemon's --log.level; empty leaves their default.
	LogLevel string
	// OnEvent hears what the stack and its loops do; it may be nil.
	OnEvent func(Event)
}

// Ports are the candidate ports of each daemon.
type Ports struct {
	Exporter, Remediator, Prometheus, Alertmanager []int
}

// URLs are where the daemons answer.
type URLs struct {
	Exporter, Remediator, Prometheus, Alertmanager string
}

// Stack is a running loop. Stop it.
type Stack struct {
	cfg Config
	// URLs are the daemons' base URLs, http://127.0.0.1:PORT.
	URLs URLs
	// TokenFile holds the bearer token the remediator's API and webhook
	// require; Token is its content.
	TokenFile, Token string
	// RulesCopy is the shortened rule file Prometheus evaluates.
	RulesCopy string
	// SimRoot is the simulated node's directory (BackendSim).
	SimRoot string
	// Logs is the directory of the daemons' logs.
	Logs string

	lock *os.File

	mu        sync.Mutex
	daemons   []*daemon // in start order
	workloads []*Workload
	sessions  []int // of every process it started
	stopOnce  sync.Once
	stopErr   error
}

// FindTools finds Prometheus and Alertmanager in PATH: Debian names them
// prometheus and prometheus-alertmanager (scripts/deps.sh installs them).
func FindTools() (prometheus, alertmanager string, err error) {
	find := func(names ...string) (string, error) {
		for _, n := range names {
			if p, err := exec.LookPath(n); err == nil {
				return p, nil
			}
		}
		return "", fmt.Errorf("%s not found in PATH: install Debian's prometheus and prometheus-alertmanager "+
			"with scripts/deps.sh (make deps)", strings.Join(names, " or "))
	}
	if prometheus, err = find("prometheus"); err != nil {
		return "", "", err
	}
	alertmanager, err = find("alertmanager", "prometheus-alertmanager")
	return prometheus, alertmanager, err
}

// Start starts the stack and returns once every daemon answers and
// Prometheus scrapes both targets. When it fails, what it started is
// stopped.
func Start(ctx context.Context, cfg Config) (*Stack, error) {
	if cfg.AgeThreshold == 0 {
		cfg.AgeThreshold = 3
	}
	if cfg.For == 0 {
		cfg.For = 2 * time.Second
	}
	if cfg.Backend == "" {
		cfg.Backend = BackendSim
	}
	if cfg.SimGPUs == 0 {
		cfg.SimGPUs = 2
	}
	if cfg.Backend != BackendSim && cfg.Backend != BackendNVML {
		return nil, fmt.Errorf("backend must be %s or %s, not %q", BackendSim, BackendNVML, cfg.Backend)
	}
	for _, b := range []string{"gpu-orphan-exporter", "gpu-orphan-remediator", "gpu-orphan-sim"} {
		if _, err := os.Stat(filepath.Join(cfg.BinDir, b)); err != nil {
			return nil, fmt.Errorf("%w: run make build", err)
		}
	}
	for _, t := range []string{cfg.Prometheus, cfg.Alertmanager} {
		if _, err := os.Stat(t); t == "" || err != nil {
			return nil, fmt.Errorf("no Prometheus or Alertmanager at %q: run make deps", t)
		}
	}

	s := &Stack{cfg: cfg, Logs: filepath.Join(cfg.Dir, "logs")}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	lock, err := lockDir(filepath.Join(cfg.Dir, "run.pid"))
	if err != nil {
		return nil, err
	}
	s.lock = lock
	if err := s.start(ctx); err != nil {
		return nil, errors.Join(err, s.Stop())
	}
	return s, nil
}

func (s *Stack) start(ctx context.Context) error {
	cfg, dir := s.cfg, s.cfg.Dir
	// Fresh state for each run; the logs of the previous one are replaced.
	old, _ := filepath.Glob(filepath.Join(dir, "remediator.db*"))
	for _, p := range append(old, "node", "prometheus-data", "alertmanager-data", "logs") {
		if err := os.RemoveAll(filepath.Join(dir, filepath.Base(p))); err != nil {
			return err
		}
	}
	if err := os.Mkdir(s.Logs, 0o755); err != nil {
		return err
	}

	tok := make([]byte, 24)
	rand.Read(tok)
	s.Token, s.TokenFile = hex.EncodeToString(tok), filepath.Join(dir, "token")
	if err := os.WriteFile(s.TokenFile, []byte(s.Token), 0o600); err != nil {
		return err
	}

	exp, err := pickPort("exporter", cfg.Ports.Exporter)
	if err != nil {
		return err
	}
	rem, err := pickPort("remediator", cfg.Ports.Remediator, exp)
	if err != nil {
		return err
	}
	prom, err := pickPort("Prometheus", cfg.Ports.Prometheus, exp, rem)
	if err != nil {
		return err
	}
	am, err := pickPort("Alertmanager", cfg.Ports.Alertmanager, exp, rem, prom)
	if err != nil {
		return err
	}
	s.URLs = URLs{Exporter: "http://" + exp, Remediator: "http://" + rem, Prometheus: "http://" + prom, Alertmanager: "http://" + am}

	src, err := os.ReadFile(cfg.RulesFile)
	if err != nil {
		return err
	}
	rules, err := ShortenRules(src, cfg.AgeThreshold, cfg.For)
	if err != nil {
		return fmt.Errorf("%s: %w", cfg.RulesFile, err)
	}
	s.RulesCopy = filepath.Join(dir, "gpu-orphan.rules.yml")
	if err := os.WriteFile(s.RulesCopy, rules, 0o644); err != nil {
		return err
	}
	vars := map[string]string{"RULES": s.RulesCopy, "ALERTMANAGER": am, "EXPORTER": exp, "REMEDIATOR": rem,
		"NODE": cfg.NodeName, "TOKEN_FILE": s.TokenFile}
	promConfig, amConfig := filepath.Join(dir, "prometheus.yml"), filepath.Join(dir, "alertmanager.yml")
	if err := fill(prometheusTmpl, promConfig, vars); err != nil {
		return err
	}
	if err := fill(alertmanagerTmpl, amConfig, vars); err != nil {
		return err
	}

	source := []string{"--backend=nvml"}
	if cfg.Backend == BackendSim {
		s.SimRoot = filepath.Join(dir, "node")
		out, err := exec.Command(s.bin("gpu-orphan-sim"), "init", "--root", s.SimRoot, "--gpus", strconv.Itoa(cfg.SimGPUs)).CombinedOutput()
		if err != nil {
			return fmt.Errorf("gpu-orphan-sim init: %w: %s", err, out)
		}
		source = []string{"--backend=sim", "--sim.root=" + s.SimRoot}
	}
	var logLevel []string
	if cfg.LogLevel != "" {
		logLevel = []string{"--log.level=" + cfg.LogLevel}
	}
	act := []string{"--act"}
	if cfg.DryRun {
		act = nil
	}
	starts := []struct {
		name, log, bin string
		args           []string
		ready          string
	}{
		{"gpu-orphan-exporter", "exporter.log", s.bin("gpu-orphan-exporter"), concat(source,
			[]string{"--web.listen-address=" + exp, "--collector.interval=" + collectorInterval}, logLevel),
			s.URLs.Exporter + "/metrics"},
		{"gpu-orphan-remediator", "remediator.log", s.bin("gpu-orphan-remediator"), concat([]string{"--role=node"}, act,
			[]string{"--node.name=" + cfg.NodeName}, source, []string{
				"--auth.token-file=" + s.TokenFile, "--store.path=" + filepath.Join(dir, "remediator.db"),
				// /actions opens in a browser without the token: the stack
				// listens on 127.0.0.1 only.
				"--web.ui.open", "--web.listen-address=" + rem, "--collector.interval=" + collectorInterval,
				"--remediate.min-age=" + minAge, "--remediate.grace=" + grace, "--remediate.verify-timeout=" + verifyTimeout,
			}, logLevel),
			s.URLs.Remediator + "/-/ready"},
		{"alertmanager", "alertmanager.log", cfg.Alertmanager, concat([]string{
			"--config.file=" + amConfig, "--storage.path=" + filepath.Join(dir, "alertmanager-data"),
			"--web.listen-address=" + am, "--cluster.listen-address=", "--web.external-url=" + s.URLs.Alertmanager,
		}, logLevel), s.URLs.Alertmanager + "/-/ready"},
		{"prometheus", "prometheus.log", cfg.Prometheus, concat([]string{
			"--config.file=" + promConfig, "--storage.tsdb.path=" + filepath.Join(dir, "prometheus-data"),
			"--web.listen-address=" + prom, "--web.external-url=" + s.URLs.Prometheus,
		}, logLevel), s.URLs.Prometheus + "/-/ready"},
	}
	for _, st := range starts {
		d, err := startDaemon(st.name, filepath.Join(s.Logs, st.log), st.bin, st.args...)
		if err != nil {
			return err
		}
		s.mu.Lock()
		s.daemons = append(s.daemons, d)
		s.sessions = append(s.sessions, d.pid())
		s.mu.Unlock()
	}
	for i, st := range starts {
		if err := s.poll(ctx, 30*time.Second, st.ready+" to answer 200", func() (bool, string) {
			code := statusOf(ctx, st.ready, "")
			return code == http.StatusOK, fmt.Sprintf("status %d", code)
		}); err != nil {
			return err
		}
		s.emit(Event{Stage: StageUp, Text: fmt.Sprintf("%s (pid %d) %s", st.name, s.daemons[i].pid(), st.ready)})
	}
	return s.poll(ctx, 20*time.Second, "Prometheus to scrape both targets", func() (bool, string) {
		samples, err := s.Query(ctx, `up{node="`+cfg.NodeName+`"} == 1`)
		if err != nil {
			return false, err.Error()
		}
		var jobs []string
		for _, x := range samples {
			jobs = append(jobs, x.Metric["job"])
		}
		slices.Sort(jobs)
		return slices.Equal(jobs, []string{"gpu-orphan-exporter", "gpu-orphan-remediator"}), fmt.Sprint(jobs)
	})
}

func (s *Stack) bin(name string) string { return filepath.Join(s.cfg.BinDir, name) }

// Config is the stack's configuration, with defaults filled in.
func (s *Stack) Config() Config { return s.cfg }

// Err returns an error, with the end of its log, once a daemon has
// exited; nil while all run.
func (s *Stack) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.daemons {
		if err := d.exited(); err != nil {
			return err
		}
	}
	return nil
}

// Stop stops every workload (SIGKILL to its session) and every daemon
// (SIGTERM, then SIGKILL after 10s, newest first), then kills whatever is
// left in their sessions, and releases the directory. It is safe to call
// more than once. It returns an error when a process of the stack
// survives.
func (s *Stack) Stop() error {
	s.stopOnce.Do(func() {
		s.mu.Lock()
		daemons, workloads := slices.Clone(s.daemons), slices.Clone(s.workloads)
		s.mu.Unlock()
		for _, w := range workloads {
			w.kill()
			s.emit(Event{Stage: StageStopped, Text: fmt.Sprintf("workload (pid %d)", w.PID)})
		}
		slices.Reverse(daemons)
		for _, d := range daemons {
			d.terminate()
		}
		for _, d := range daemons {
			if d.wait() {
				s.emit(Event{Stage: StageStopped, Warning: true,
					Text: fmt.Sprintf("%s (pid %d) did not stop within %s of SIGTERM: killed", d.name, d.pid(), stopTimeout)})
			}
			s.emit(Event{Stage: StageStopped, Text: fmt.Sprintf("%s (pid %d)", d.name, d.pid())})
		}
		if left := s.Remaining(); len(left) > 0 {
			s.stopErr = fmt.Errorf("processes %v of the stack survived SIGKILL", left)
		}
		if s.lock != nil {
			os.Remove(s.lock.Name())
			s.lock.Close()
		}
	})
	return s.stopErr
}

// Remaining lists the live processes of the stack: any process in the
// session of a daemon or workload it started. After Stop, none.
func (s *Stack) Remaining() []int {
	s.mu.Lock()
	sids := slices.Clone(s.sessions)
	s.mu.Unlock()
	if len(sids) == 0 {
		return nil
	}
	left, err := sessionMembers(sids...)
	if err != nil {
		return sids // cannot tell: assume the worst
	}
	return left
}

// Sessions lists the sessions of the processes the stack started: each
// daemon and workload leads one.
func (s *Stack) Sessions() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sessions)
}

func (s *Stack) emit(ev Event) {
	if ev.Seen.IsZero() {
		ev.Seen = time.Now()
	}
	if ev.At.IsZero() {
		ev.At = ev.Seen
	}
	if s.cfg.OnEvent != nil {
		s.cfg.OnEvent(ev)
	}
}

// poll calls cond every 100ms until it holds. It fails when timeout (if
// not 0) passes, ctx ends or a daemon exits; cond's string says what it
// last saw, for the error.
func (s *Stack) poll(ctx context.Context, timeout time.Duration, what string, cond func() (bool, string)) error {
	var deadline <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		deadline = t.C
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	last := ""
	for {
		ok, seen := cond()
		if ok {
			return nil
		}
		if seen != "" {
			last = seen
		}
		if err := s.Err(); err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last seen: %s)", what, context.Cause(ctx), last)
		case <-deadline:
			return fmt.Errorf("%w after %s waiting for %s; last seen: %s", ErrTimeout, timeout, what, last)
		case <-tick.C:
		}
	}
}

// ErrTimeout is returned when a stage does not come in time.
var ErrTimeout = errors.New("timed out")

// pickPort returns 127.0.0.1:PORT for the first of ports that is free, or
// any free port when there are none. taken are addresses already picked.
func pickPort(what string, ports []int, taken ...string) (string, error) {
	if len(ports) == 0 {
		for range 10 {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return "", err
			}
			addr := l.Addr().String()
			l.Close()
			if !slices.Contains(taken, addr) {
				return addr, nil
			}
		}
		return "", fmt.Errorf("%s: no free port", what)
	}
	for _, p := range ports {
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
		if slices.Contains(taken, addr) {
			continue
		}
		if l, err := net.Listen("tcp", addr); err == nil {
			l.Close()
			return addr, nil
		}
	}
	var list []string
	for _, p := range ports {
		list = append(list, strconv.Itoa(p))
	}
	return "", fmt.Errorf("%s: port %s in use (another gpu-orphan, or a make run still running?): ss -ltnp 'sport = :%d'",
		what, strings.Join(list, " and "), ports[0])
}

// fill writes tmpl with its @KEY@ placeholders replaced to dst, and fails
// if any is left.
func fill(tmpl, dst string, vars map[string]string) error {
	var pairs []string
	for k, v := range vars {
		pairs = append(pairs, "@"+k+"@", v)
	}
	out := strings.NewReplacer(pairs...).Replace(tmpl)
	if left := placeholder.FindString(out); left != "" {
		return fmt.Errorf("%s: placeholder %s not filled", dst, left)
	}
	return os.WriteFile(dst, []byte(out), 0o644)
}

func concat(parts ...[]string) []string { return slices.Concat(parts...) }
