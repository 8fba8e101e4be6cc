package deploy

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	amconfig "github.com/prometheus/alertmanager/config"
	"github.com/prometheus/common/model"
	"sigs.k8s.io/yaml"
)

const composeFile = "../../docker-compose.yml"

// The profiles of docker-compose.yml; each must run the whole stack.
var composeProfiles = []string{"gpu", "sim"}

// Capabilities a compose service may add; see the kubernetes test too.
var allowedCaps = []string{"KILL", "SYS_PTRACE", "DAC_READ_SEARCH", "NET_ADMIN"}

// loadCompose loads docker-compose.yml as `docker compose` would, with
// every profile enabled, paths resolved, and no environment: the file's
// defaults must be enough.
func loadCompose(t *testing.T) *types.Project {
	t.Helper()
	opts, err := cli.NewProjectOptions([]string{composeFile},
		cli.WithWorkingDirectory("../.."),
		cli.WithProfiles(composeProfiles),
		cli.WithResolvedPaths(true),
		cli.WithEnv(nil),
		cli.WithoutEnvironmentResolution,
	)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := opts.LoadProject(ctx)
	if err != nil {
		t.Fatalf("loading %s: %v", composeFile, err)
	}
	if len(p.DisabledServices) != 0 {
		t.Fatalf("services in no profile of %v: %v", composeProfiles, p.DisabledServiceNames())
	}
	return p
}

// inProfile reports whether a service runs under the profile.
func inProfile(s types.ServiceConfig, profile string) bool {
	return len(s.Profiles) == 0 || slices.Contains(s.Profiles, profile)
}

// resolve returns the services that answer to host on the default
// network under the profile: by name or by network alias.
func resolve(p *types.Project, profile, host string) []types.ServiceConfig {
	var out []types.ServiceConfig
	for _, name := range p.ServiceNames() {
		s := p.Services[name]
		if !inProfile(s, profile) {
			continue
		}
		if s.Name == host {
			out = append(out, s)
			continue
		}
		for _, n := range s.Networks {
			if n != nil && slices.Contains(n.Aliases, host) {
				out = append(out, s)
				break
			}
		}
	}
	return out
}

// listens reports whether a service declares the container port.
func listens(s types.ServiceConfig, port uint32) bool {
	for _, p := range s.Ports {
		if p.Target == port {
			return true
		}
	}
	for _, e := range s.Expose {
		if e == strconv.Itoa(int(port)) {
			return true
		}
	}
	return false
}

// addressErrors says why host:port does not reach exactly one service
// that listens on port, under every profile.
func addressErrors(p *types.Project, where, hostport string) []error {
	host, portStr, err := net.SplitHostPort(hostport)
	if err != nil {
		return []error{fmt.Errorf("%s: %q: %w", where, hostport, err)}
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return []error{fmt.Errorf("%s: %q: bad port", where, hostport)}
	}
	var errs []error
	for _, profile := range composeProfiles {
		got := resolve(p, profile, host)
		if len(got) != 1 {
			errs = append(errs, fmt.Errorf("%s: %s names %d services under profile %s, want 1", where, host, len(got), profile))
			continue
		}
		if !listens(got[0], uint32(port)) {
			errs = append(errs, fmt.Errorf("%s: service %s (profile %s) does not listen on %d", where, got[0].Name, profile, port))
		}
	}
	return errs
}

func checkAddress(t *testing.T, p *types.Project, where, hostport string) {
	t.Helper()
	for _, err := range addressErrors(p, where, hostport) {
		t.Error(err)
	}
}

// mountSource returns the host path bind-mounted at target, or "".
func mountSource(s types.ServiceConfig, target string) string {
	for _, v := range s.Volumes {
		if v.Type == types.VolumeTypeBind && v.Target == target {
			return v.Source
		}
	}
	return ""
}

// mountedFile returns the host file a container path comes from: a bind
// mount of it or of a directory above it, or a secret or config.
func mountedFile(p *types.Project, s types.ServiceConfig, file string) (string, bool) {
	for _, v := range s.Volumes {
		if v.Type != types.VolumeTypeBind {
			continue
		}
		if rel, err := filepath.Rel(v.Target, file); err == nil && !strings.HasPrefix(rel, "..") {
			return filepath.Join(v.Source, rel), true
		}
	}
	for _, sec := range s.Secrets {
		if sec.Target == file || "/run/secrets/"+sec.Target == file || (sec.Target == "" && "/run/secrets/"+sec.Source == file) {
			return p.Secrets[sec.Source].File, true
		}
	}
	for _, c := range s.Configs {
		if c.Target == file {
			return p.Configs[c.Source].File, true
		}
	}
	return "", false
}

func TestComposeFilesExist(t *testing.T) {
	p := loadCompose(t)
	for _, name := range p.ServiceNames() {
		s := p.Services[name]
		for _, v := range s.Volumes {
			switch v.Type {
			case types.VolumeTypeBind:
				if _, err := os.Stat(v.Source); err != nil {
					t.Errorf("service %s: bind mount of %s: %v", name, p.RelativePath(v.Source), err)
				}
			case types.VolumeTypeVolume:
				if _, ok := p.Volumes[v.Source]; !ok {
					t.Errorf("service %s: volume %s is not declared", name, v.Source)
				}
			}
		}
		for _, sec := range s.Secrets {
			if _, ok := p.Secrets[sec.Source]; !ok {
				t.Errorf("service %s: secret %s is not declared", name, sec.Source)
			}
		}
		for _, c := range s.Configs {
			if _, ok := p.Configs[c.Source]; !ok {
				t.Errorf("service %s: config %s is not declared", name, c.Source)
			}
		}
		if s.Build != nil {
			dockerfile := s.Build.Dockerfile
			if dockerfile == "" {
				dockerfile = "Dockerfile"
			}
			if !filepath.IsAbs(dockerfile) {
				dockerfile = filepath.Join(s.Build.Context, dockerfile)
			}
			if _, err := os.Stat(dockerfile); err != nil {
				t.Errorf("service %s: Dockerfile: %v", name, err)
			}
		}
		if s.Image == "" && s.Build == nil {
			t.Errorf("service %s: neither image nor build", name)
		}
	}
	for name, sec := range p.Secrets {
		if _, err := os.Stat(sec.File); err != nil {
			t.Errorf("secret %s: %v", name, err)
		}
	}
	for name, c := range p.Configs {
		if c.File == "" {
			continue
		}
		if _, err := os.Stat(c.File); err != nil {
			t.Errorf("config %s: %v", name, err)
		}
	}
}

func TestComposePortsAndDependencies(t *testing.T) {
	p := loadCompose(t)
	for _, profile := range composeProfiles {
		published := map[string]string{}
		for _, name := range p.ServiceNames() {
			s := p.Services[name]
			if !inProfile(s, profile) {
				continue
			}
			for _, port := range s.Ports {
				if port.Published == "" {
					continue
				}
				key := port.Published + "/" + port.Protocol
				if other, ok := published[key]; ok {
					t.Errorf("profile %s: port %s is published by %s and %s", profile, key, other, name)
				}
				published[key] = name
				if port.HostIP != "127.0.0.1" {
					t.Errorf("service %s: port %s is published on %q; keep it on 127.0.0.1", name, key, port.HostIP)
				}
			}
			for dep := range s.DependsOn {
				d, ok := p.Services[dep]
				if !ok {
					t.Errorf("service %s depends on %s, which does not exist", name, dep)
					continue
				}
				if !inProfile(d, profile) {
					t.Errorf("profile %s: service %s depends on %s, which is not in the profile", profile, name, dep)
				}
			}
		}
		// Each profile runs the whole stack, under the same names.
		for _, host := range []string{"exporter", "remediator", "prometheus", "alertmanager", "grafana"} {
			if n := len(resolve(p, profile, host)); n != 1 {
				t.Errorf("profile %s: %d services answer to %s, want 1", profile, n, host)
			}
		}
	}
}

func TestComposeServices(t *testing.T) {
	p := loadCompose(t)
	flags := flagChecker{}
	nodeNames := map[string]bool{}
	for _, name := range p.ServiceNames() {
		s := p.Services[name]
		if s.Privileged {
			t.Errorf("service %s is privileged", name)
		}
		for _, c := range s.CapAdd {
			if !slices.Contains(allowedCaps, strings.TrimPrefix(c, "CAP_")) {
				t.Errorf("service %s adds capability %s; allowed: %v", name, c, allowedCaps)
			}
		}
		if len(s.CapAdd) > 0 && !slices.Contains(s.CapDrop, "ALL") {
			t.Errorf("service %s adds capabilities without dropping ALL", name)
		}
		argv := []string(s.Command)
		if len(s.Entrypoint) > 0 {
			argv = append(slices.Clone([]string(s.Entrypoint)), argv...)
		}
		if len(argv) == 0 || !strings.HasPrefix(argv[0], "gpu-orphan") {
			continue
		}
		flags.check(t, "service "+name, argv)
		if s.Pid != "host" {
			t.Errorf("service %s: pid %q, want host: NVML's PIDs are the host's", name, s.Pid)
		}
		backend, _ := flagValue(argv, "backend")
		gpu := s.Deploy != nil && s.Deploy.Resources.Reservations != nil &&
			slices.ContainsFunc(s.Deploy.Resources.Reservations.Devices, func(d types.DeviceRequest) bool {
				return d.Driver == "nvidia" && slices.Contains(d.Capabilities, "gpu")
			})
		switch {
		case inProfile(s, "gpu") && !inProfile(s, "sim"):
			if backend != "nvml" || !gpu {
				t.Errorf("service %s (profile gpu): --backend=%s, nvidia device reserved %v; want nvml and true", name, backend, gpu)
			}
		case inProfile(s, "sim") && !inProfile(s, "gpu"):
			root, _ := flagValue(argv, "sim.root")
			if backend != "sim" || gpu || root == "" || mountedVolume(s, root) != "sim-node" {
				t.Errorf("service %s (profile sim): --backend=%s --sim.root=%s (volume %q), GPU reserved %v; want sim, the sim-node volume, no GPU",
					name, backend, root, mountedVolume(s, root), gpu)
			}
		}
		if filepath.Base(argv[0]) != "gpu-orphan-remediator" {
			continue
		}
		// The shipped configuration is a dry run.
		if slices.Contains(argv, "--act") || slices.ContainsFunc(argv, func(a string) bool { return strings.HasPrefix(a, "--act=") }) {
			t.Errorf("service %s: --act is on; the shipped configuration must be a dry run", name)
		}
		for _, c := range []string{"KILL", "SYS_PTRACE"} {
			if !slices.Contains(s.CapAdd, c) {
				t.Errorf("service %s: cannot kill without cap_add %s", name, c)
			}
		}
		if tf, ok := flagValue(argv, "auth.token-file"); !ok {
			t.Errorf("service %s: no --auth.token-file", name)
		} else if _, ok := mountedFile(p, s, tf); !ok {
			t.Errorf("service %s: --auth.token-file=%s is not mounted", name, tf)
		}
		node, _ := flagValue(argv, "node.name")
		nodeNames[node] = true
	}
	if len(nodeNames) != 1 {
		t.Errorf("remediators disagree on --node.name: %v", nodeNames)
	}
	// The node label Prometheus sets must be the remediators' node name.
	for _, sc := range loadPrometheusConfig(t, p).ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			if node, ok := st.Labels["node"]; ok && !nodeNames[node] {
				t.Errorf("prometheus.yml job %s: node label %q is not the remediators' --node.name %v", sc.JobName, node, nodeNames)
			}
		}
	}
}

// mountedVolume returns the named volume mounted at target, or "".
func mountedVolume(s types.ServiceConfig, target string) string {
	for _, v := range s.Volumes {
		if v.Type == types.VolumeTypeVolume && v.Target == target {
			return v.Source
		}
	}
	return ""
}

// prometheusConfig is the part of prometheus.yml the checks read.
type prometheusConfig struct {
	RuleFiles []string `json:"rule_files"`
	Alerting  struct {
		Alertmanagers []struct {
			StaticConfigs []staticConfig `json:"static_configs"`
		} `json:"alertmanagers"`
	} `json:"alerting"`
	ScrapeConfigs []struct {
		JobName       string         `json:"job_name"`
		StaticConfigs []staticConfig `json:"static_configs"`
	} `json:"scrape_configs"`
}

type staticConfig struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels"`
}

// prometheusConfigPath returns the host file that the prometheus
// service's --config.file comes from.
func prometheusConfigPath(t *testing.T, p *types.Project) string {
	t.Helper()
	s := p.Services["prometheus"]
	cfg, ok := flagValue(s.Command, "config.file")
	if !ok {
		cfg = "/etc/prometheus/prometheus.yml"
	}
	host, ok := mountedFile(p, s, cfg)
	if !ok {
		t.Fatalf("prometheus: --config.file=%s is not mounted", cfg)
	}
	return host
}

// loadPrometheusConfig reads the prometheus service's configuration. The
// Prometheus config package would bring every service discovery's SDK
// into the test; promtool checks the whole file when it is installed.
func loadPrometheusConfig(t *testing.T, p *types.Project) prometheusConfig {
	t.Helper()
	data, err := os.ReadFile(prometheusConfigPath(t, p))
	if err != nil {
		t.Fatal(err)
	}
	var cfg prometheusConfig
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		t.Fatalf("prometheus.yml: %v", err)
	}
	return cfg
}

func TestComposePrometheus(t *testing.T) {
	p := loadCompose(t)
	cfg := loadPrometheusConfig(t, p)
	jobs := map[string]bool{}
	for _, sc := range cfg.ScrapeConfigs {
		jobs[sc.JobName] = true
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				checkAddress(t, p, "prometheus.yml job "+sc.JobName, target)
			}
			if strings.HasPrefix(sc.JobName, "gpu-orphan-") && st.Labels["node"] == "" {
				t.Errorf("prometheus.yml job %s: no node target label; the alerts and the remediator need it", sc.JobName)
			}
		}
	}
	// The alert rules select these jobs.
	for _, job := range []string{"gpu-orphan-exporter", "gpu-orphan-remediator"} {
		if !jobs[job] {
			t.Errorf("prometheus.yml: no job %s", job)
		}
	}
	for _, am := range cfg.Alerting.Alertmanagers {
		for _, st := range am.StaticConfigs {
			for _, target := range st.Targets {
				checkAddress(t, p, "prometheus.yml alertmanagers", target)
			}
		}
	}

	// The rule files are ./alerts, mounted.
	s := p.Services["prometheus"]
	if len(cfg.RuleFiles) == 0 {
		t.Error("prometheus.yml: no rule_files")
	}
	for _, rf := range cfg.RuleFiles {
		host, ok := mountedFile(p, s, rf)
		if !ok {
			t.Errorf("prometheus.yml: rule_files %s is not mounted", rf)
			continue
		}
		if filepath.Dir(host) != filepath.Join(p.WorkingDir, "alerts") {
			t.Errorf("prometheus.yml: rule_files %s comes from %s, not alerts/", rf, host)
		}
		matches, err := filepath.Glob(host)
		if err != nil || len(matches) == 0 {
			t.Errorf("prometheus.yml: rule_files %s matches no file of %s", rf, p.RelativePath(filepath.Dir(host)))
		}
		for _, m := range matches {
			if strings.HasSuffix(m, "_test.yml") {
				t.Errorf("prometheus.yml: rule_files %s loads the promtool test %s", rf, m)
			}
		}
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Log("promtool not installed: prometheus.yml checked by the test only")
		return
	}
	out, err := exec.Command(promtool, "check", "config", "--syntax-only", prometheusConfigPath(t, p)).CombinedOutput()
	if err != nil {
		t.Errorf("promtool check config: %v\n%s", err, out)
	}
}

// routeFor returns the route an alert with the labels takes, and the
// group_interval in force there.
func routeFor(r *amconfig.Route, lset model.LabelSet, interval time.Duration) (*amconfig.Route, time.Duration) {
	if r.GroupInterval != nil {
		interval = time.Duration(*r.GroupInterval)
	}
	for _, child := range r.Routes {
		if child.AllMatchers().Matches(lset) {
			if got, iv := routeFor(child, lset, interval); got != nil {
				return got, iv
			}
		}
	}
	return r, interval
}

// checkRemediatorReceiver checks the receiver that alertname=alert is
// routed to: a webhook with a bearer token from a file, resolved
// notifications, and a timeout below the group interval. It returns the
// webhook's URL and credentials file.
func checkRemediatorReceiver(t *testing.T, cfg *amconfig.Config, alert string) (*url.URL, string) {
	t.Helper()
	route, interval := routeFor(cfg.Route, model.LabelSet{"alertname": model.LabelValue(alert)}, 5*time.Minute)
	if route == cfg.Route {
		t.Errorf("alertname=%s takes the root route, not a route of its own", alert)
	}
	var recv *amconfig.Receiver
	for i := range cfg.Receivers {
		if cfg.Receivers[i].Name == route.Receiver {
			recv = &cfg.Receivers[i]
		}
	}
	if recv == nil || len(recv.WebhookConfigs) != 1 {
		t.Fatalf("alertname=%s goes to receiver %q, which is not one webhook", alert, route.Receiver)
	}
	wh := recv.WebhookConfigs[0]
	if !wh.SendResolved() {
		t.Error("webhook: send_resolved is off; the remediator must see resolved alerts")
	}
	if wh.Timeout <= 0 || wh.Timeout >= interval {
		t.Errorf("webhook: timeout %v, want above 0 and below group_interval %v", wh.Timeout, interval)
	}
	u, err := url.Parse(string(wh.URL))
	if err != nil {
		t.Fatalf("webhook url: %v", err)
	}
	if u.Path != "/api/v1/alerts" {
		t.Errorf("webhook url %s: path %q, want /api/v1/alerts", u, u.Path)
	}
	var credentials string
	if wh.HTTPConfig != nil && wh.HTTPConfig.Authorization != nil {
		credentials = wh.HTTPConfig.Authorization.CredentialsFile
		if typ := wh.HTTPConfig.Authorization.Type; typ != "" && !strings.EqualFold(typ, "Bearer") {
			t.Errorf("webhook: authorization type %q, want Bearer", typ)
		}
	}
	if credentials == "" {
		t.Error("webhook: no http_config.authorization.credentials_file")
	}
	checkAlertExists(t, alert)
	return u, credentials
}

// checkAlertExists fails when the alert rules exist but define no alert
// of that name.
func checkAlertExists(t *testing.T, alert string) {
	t.Helper()
	files, _ := filepath.Glob("../../alerts/*.rules.yml")
	if len(files) == 0 {
		t.Logf("no alerts/*.rules.yml yet: not checking that %s exists", alert)
		return
	}
	for _, f := range files {
		groups, err := loadRuleGroups(f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		for _, g := range groups {
			for _, r := range g.Rules {
				if r.Alert == alert {
					return
				}
			}
		}
	}
	t.Errorf("alert %s is routed but no alerts/*.rules.yml defines it", alert)
}

func TestComposeAlertmanager(t *testing.T) {
	p := loadCompose(t)
	s := p.Services["alertmanager"]
	cfgFile, ok := flagValue(s.Command, "config.file")
	if !ok {
		cfgFile = "/etc/alertmanager/alertmanager.yml"
	}
	host, ok := mountedFile(p, s, cfgFile)
	if !ok {
		t.Fatalf("alertmanager: --config.file=%s is not mounted", cfgFile)
	}
	cfg, err := amconfig.LoadFile(host)
	if err != nil {
		t.Fatalf("%s: %v", p.RelativePath(host), err)
	}
	u, credentials := checkRemediatorReceiver(t, cfg, "GPUOrphanMemory")
	checkAddress(t, p, "alertmanager.yml webhook", u.Host)
	for _, profile := range composeProfiles {
		for _, r := range resolve(p, profile, u.Hostname()) {
			if !strings.Contains(strings.Join(r.Command, " "), "gpu-orphan-remediator") {
				t.Errorf("alertmanager.yml webhook: %s (profile %s) is not a remediator", r.Name, profile)
			}
		}
	}
	if credentials != "" {
		tokenFile, ok := mountedFile(p, s, credentials)
		if !ok {
			t.Errorf("alertmanager: credentials_file %s is not mounted", credentials)
		} else {
			// Alertmanager must send the token the remediators accept.
			for _, name := range []string{"remediator", "remediator-sim"} {
				r := p.Services[name]
				tf, _ := flagValue(r.Command, "auth.token-file")
				if src, _ := mountedFile(p, r, tf); src != tokenFile {
					t.Errorf("alertmanager sends %s, but %s reads its token from %s", tokenFile, name, src)
				}
			}
		}
	}
}

// grafanaProvisioning is the part of Grafana's provisioning files the
// checks read.
type grafanaProvisioning struct {
	Datasources []struct {
		UID  string `json:"uid"`
		Type string `json:"type"`
		URL  string `json:"url"`
	} `json:"datasources"`
	Providers []struct {
		Options struct {
			Path string `json:"path"`
		} `json:"options"`
	} `json:"providers"`
}

func TestComposeGrafana(t *testing.T) {
	p := loadCompose(t)
	s := p.Services["grafana"]
	prov := mountSource(s, "/etc/grafana/provisioning")
	if prov == "" {
		t.Fatal("grafana: nothing mounted at /etc/grafana/provisioning")
	}
	read := func(rel string) grafanaProvisioning {
		data, err := os.ReadFile(filepath.Join(prov, rel))
		if err != nil {
			t.Fatal(err)
		}
		var g grafanaProvisioning
		if err := yaml.Unmarshal(data, &g); err != nil {
			t.Fatalf("%s: %v", rel, err)
		}
		return g
	}
	ds := read("datasources/prometheus.yml")
	if len(ds.Datasources) == 0 {
		t.Error("grafana: no data source")
	}
	for _, d := range ds.Datasources {
		u, err := url.Parse(d.URL)
		if err != nil || d.Type != "prometheus" {
			t.Errorf("grafana data source %+v: want a prometheus URL", d)
			continue
		}
		checkAddress(t, p, "grafana data source", u.Host)
	}
	dash := read("dashboards/dashboards.yml")
	if len(dash.Providers) == 0 {
		t.Error("grafana: no dashboard provider")
	}
	for _, pr := range dash.Providers {
		src := mountSource(s, pr.Options.Path)
		if src != filepath.Join(p.WorkingDir, "dashboards") {
			t.Errorf("grafana: dashboards provider path %s is %q, not the dashboards/ directory", pr.Options.Path, src)
		}
	}
	if home, ok := s.Environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]; ok && home != nil {
		if src, ok := mountedFile(p, s, *home); !ok {
			t.Errorf("grafana: home dashboard %s is not mounted", *home)
		} else if _, err := os.Stat(src); err != nil {
			t.Errorf("grafana: home dashboard: %v", err)
		}
	}
}

// TestCheckAddressRejects makes sure the address check can fail.
func TestCheckAddressRejects(t *testing.T) {
	p := loadCompose(t)
	if errs := addressErrors(p, "test", "exporter:10835"); len(errs) != 0 {
		t.Errorf("exporter:10835: %v", errs)
	}
	for _, addr := range []string{"exporter:10836", "nosuchservice:10835", "exporter-sim:10835", "exporter"} {
		if len(addressErrors(p, "test", addr)) == 0 {
			t.Errorf("addressErrors(%q) found nothing wrong", addr)
		}
	}
}
