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
	"syscall"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/freeport"
	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
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
	// empty list takes a free one: for the exporter and the remediator, a
	// socket on 127.0.0.1:0 that the stack listens on and hands down
	// (--web.systemd-socket); for Prometheus and Alertmanager, which bind
	// their own, a port below the kernel's ephemeral range, another one if
	// it is taken first (freeport).
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

	// The exporter and the remediator serve on sockets the stack holds
	// from the start and hands down; Prometheus and Alertmanager bind their
	// own ports (startBound).
	expL, err := listen("exporter", cfg.Ports.Exporter)
	if err != nil {
		return err
	}
	defer expL.Close() // once handed down, or when the start fails first
	remL, err := listen("remediator", cfg.Ports.Remediator)
	if err != nil {
		return err
	}
	defer remL.Close()
	exp, rem := expL.Addr().String(), remL.Addr().String()
	s.URLs = URLs{Exporter: "http://" + exp, Remediator: "http://" + rem}

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
	vars := map[string]string{"RULES": s.RulesCopy, "EXPORTER": exp, "REMEDIATOR": rem,
		"NODE": cfg.NodeName, "TOKEN_FILE": s.TokenFile}
	promConfig, amConfig := filepath.Join(dir, "prometheus.yml"), filepath.Join(dir, "alertmanager.yml")
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
	ready := map[string]string{}
	for _, st := range []struct {
		name, log string
		l         *net.TCPListener
		args      []string
		ready     string
	}{
		{"gpu-orphan-exporter", "exporter.log", expL, concat(source,
			[]string{"--collector.interval=" + collectorInterval}, logLevel),
			s.URLs.Exporter + "/metrics"},
		{"gpu-orphan-remediator", "remediator.log", remL, concat([]string{"--role=node"}, act,
			[]string{"--node.name=" + cfg.NodeName}, source, []string{
				"--auth.token-file=" + s.TokenFile, "--store.path=" + filepath.Join(dir, "remediator.db"),
				// /actions opens in a browser without the token: the stack
				// listens on 127.0.0.1 only.
				"--web.ui.open", "--collector.interval=" + collectorInterval,
				"--remediate.min-age=" + minAge, "--remediate.grace=" + grace, "--remediate.verify-timeout=" + verifyTimeout,
				"--limit.cooldown=" + Cooldown.String(),
			}, logLevel),
			s.URLs.Remediator + "/-/ready"},
	} {
		cmd := exec.Command(s.bin(st.name), append([]string{freeport.SystemdSocketFlag}, st.args...)...)
		f, err := freeport.Pass(cmd, st.l)
		if err != nil {
			return fmt.Errorf("%s: %w", st.name, err)
		}
		d, err := startDaemon(st.name, filepath.Join(s.Logs, st.log), cmd)
		f.Close()
		if err != nil {
			return err
		}
		s.add(d)
		ready[st.name] = st.ready
	}

	// Alertmanager first: Prometheus's configuration names its address.
	am, err := s.startBound(ctx, "alertmanager", "Alertmanager", cfg.Alertmanager, cfg.Ports.Alertmanager, func(addr string) []string {
		return concat([]string{
			"--config.file=" + amConfig, "--storage.path=" + filepath.Join(dir, "alertmanager-data"),
			"--web.listen-address=" + addr, "--cluster.listen-address=", "--web.external-url=http://" + addr,
		}, logLevel)
	})
	if err != nil {
		return err
	}
	s.URLs.Alertmanager = "http://" + am
	vars["ALERTMANAGER"] = am
	if err := fill(prometheusTmpl, promConfig, vars); err != nil {
		return err
	}
	prom, err := s.startBound(ctx, "prometheus", "Prometheus", cfg.Prometheus, cfg.Ports.Prometheus, func(addr string) []string {
		return concat([]string{
			"--config.file=" + promConfig, "--storage.tsdb.path=" + filepath.Join(dir, "prometheus-data"),
			"--web.listen-address=" + addr, "--web.external-url=http://" + addr,
		}, logLevel)
	})
	if err != nil {
		return err
	}
	s.URLs.Prometheus = "http://" + prom
	ready["alertmanager"] = s.URLs.Alertmanager + "/-/ready"
	ready["prometheus"] = s.URLs.Prometheus + "/-/ready"

	s.mu.Lock()
	daemons := slices.Clone(s.daemons)
	s.mu.Unlock()
	for _, d := range daemons {
		if err := s.waitReady(ctx, ready[d.name]); err != nil {
			return err
		}
		s.emit(Event{Stage: StageUp, Text: fmt.Sprintf("%s (pid %d) %s", d.name, d.pid(), ready[d.name])})
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
		if left := s.killRemaining(); len(left) > 0 {
			s.stopErr = fmt.Errorf("processes %v of the stack survived SIGKILL", left)
		}
		if s.lock != nil {
			os.Remove(s.lock.Name())
			s.lock.Close()
		}
	})
	return s.stopErr
}

// killRemaining kills what is left in the stack's sessions until none is
// left, for up to killWait stretched by the machine's slowness, and returns
// the survivors. SIGKILL takes effect when its target next runs, which on
// a loaded machine is not at once, and a shell may fork once more between
// the listing and its own kill: one listing and one round of kills is not
// proof that nothing is left.
func (s *Stack) killRemaining() []int {
	deadline := time.Now().Add(slowness.Scale(killWait, slowness.Factor()))
	for {
		left := s.Remaining()
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		for _, pid := range left {
			_ = syscall.Kill(pid, syscall.SIGKILL) // it may have exited since
		}
		time.Sleep(20 * time.Millisecond)
	}
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
// last saw, for the error. The timeout is what the wait takes on an idle
// machine: it is stretched by the machine's slowness (the load per CPU,
// slowness.Factor), measured again at each poll.
func (s *Stack) poll(ctx context.Context, timeout time.Duration, what string, cond func() (bool, string)) error {
	start, factor := time.Now(), slowness.Factor()
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
		factor = max(factor, slowness.Factor())
		if timeout > 0 && time.Since(start) > slowness.Scale(timeout, factor) {
			given := ""
			if factor > 1 {
				given = fmt.Sprintf(" (%s on this machine, %.1f times slower than idle)", slowness.Scale(timeout, factor).Round(100*time.Millisecond), factor)
			}
			return fmt.Errorf("%w after %s%s waiting for %s; last seen: %s", ErrTimeout, timeout, given, what, last)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last seen: %s)", what, context.Cause(ctx), last)
		case <-tick.C:
		}
	}
}

// ErrTimeout is returned when a stage does not come in time.
var ErrTimeout = errors.New("timed out")

// add records a daemon the stack started, for Stop.
func (s *Stack) add(d *daemon) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.daemons = append(s.daemons, d)
	s.sessions = append(s.sessions, d.pid())
}

// forget drops a daemon that exited before it served.
func (s *Stack) forget(d *daemon) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.daemons = slices.DeleteFunc(s.daemons, func(x *daemon) bool { return x == d })
	s.sessions = slices.DeleteFunc(s.sessions, func(sid int) bool { return sid == d.pid() })
}

// waitReady waits for url to answer 200.
func (s *Stack) waitReady(ctx context.Context, url string) error {
	return s.poll(ctx, 30*time.Second, url+" to answer 200", func() (bool, string) {
		code := statusOf(ctx, url, "")
		return code == http.StatusOK, fmt.Sprintf("status %d", code)
	})
}

// listen listens on 127.0.0.1: on the first of ports that is free, or on
// any port (127.0.0.1:0) when there are none. The socket is handed to the
// daemon (freeport.Pass), so no other process can take its port between
// the choice and the daemon's start.
func listen(what string, ports []int) (*net.TCPListener, error) {
	if len(ports) == 0 {
		return freeport.Listen("127.0.0.1")
	}
	for _, p := range ports {
		if l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p))); err == nil {
			return l.(*net.TCPListener), nil
		}
	}
	return nil, inUse(what, ports)
}

func inUse(what string, ports []int) error {
	var list []string
	for _, p := range ports {
		list = append(list, strconv.Itoa(p))
	}
	return fmt.Errorf("%s: port %s in use (another gpu-orphan, or a make run still running?): ss -ltnp 'sport = :%d'",
		what, strings.Join(list, " and "), ports[0])
}

// freeAttempts bounds the ports that startBound tries when none are set.
const freeAttempts = 5

// startBound starts a daemon that binds its own port (Prometheus,
// Alertmanager: neither takes a socket handed down), with args(addr), and
// waits until it answers. The port is the first of ports that is free,
// or, when there are none, one below the kernel's ephemeral range
// (freeport.Reserve), where no outgoing connection takes ports. Another
// process may still bind it between the check and the daemon's bind: a
// daemon that exits saying its address is in use is started again on the
// next port, up to len(ports) or freeAttempts times. It returns the
// address the daemon serves on.
func (s *Stack) startBound(ctx context.Context, name, what, bin string, ports []int, args func(addr string) []string) (string, error) {
	log := filepath.Join(s.Logs, name+".log")
	n := len(ports)
	if n == 0 {
		n = freeAttempts
	}
	var tried []int
	for i := range n {
		var addr string
		var release func()
		if len(ports) == 0 {
			p, err := freeport.Reserve("127.0.0.1")
			if err != nil {
				return "", fmt.Errorf("%s: %w", what, err)
			}
			addr, release = p.Addr, p.Release
			tried = append(tried, p.Port)
		} else {
			// A port that is taken now is not worth a start.
			addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[i]))
			l, err := net.Listen("tcp", addr)
			if err != nil {
				continue
			}
			l.Close()
			release = func() {}
		}
		d, err := startDaemon(name, log, exec.Command(bin, args(addr)...))
		if err != nil {
			release()
			return "", err
		}
		s.add(d)
		err = s.waitReady(ctx, "http://"+addr+"/-/ready")
		release()
		if err == nil {
			return addr, nil
		}
		if d.exited() == nil || !freeport.InUse(tail(log, 20)) {
			return "", err
		}
		// Taken between the check and its bind: it served nothing.
		s.forget(d)
	}
	if len(ports) == 0 {
		return "", fmt.Errorf("%s: ports %v were each taken before it could bind them", what, tried)
	}
	return "", inUse(what, ports)
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
