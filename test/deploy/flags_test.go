package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Flags that every binary gets from exporter-toolkit and promslog rather
// than from its own source.
var toolkitFlags = []string{"web.listen-address", "web.config.file", "web.systemd-socket", "log.level", "log.format"}

var (
	// app.Flag("name", ...) and a.Flag(prefix+"name", ...).
	flagDecl = regexp.MustCompile(`\.Flag\(\s*(prefix\s*\+\s*)?"([a-z0-9][a-z0-9.-]*)"`)
	// AddRemediationFlags passes the prefix it gives to addRemediationFlags.
	remediatePrefix = regexp.MustCompile(`addRemediationFlags\(a,\s*"([a-z.]+)"`)
)

// binaryFlags reads the long flag names a gpu-orphan binary declares, from
// its cmd/ directory and the flags it shares through internal/cli and
// remediate/remediateflag. It reads source rather than running --help, to
// keep the test fast.
func binaryFlags(t *testing.T, binary string) map[string]bool {
	t.Helper()
	dir := filepath.Join("..", "..", "cmd", binary)
	files, _ := filepath.Glob(filepath.Join(dir, "*.go"))
	if len(files) == 0 {
		t.Fatalf("no binary %s: %s has no Go files", binary, dir)
	}
	shared, _ := filepath.Glob(filepath.Join("..", "..", "internal", "cli", "*.go"))
	remediation, _ := filepath.Glob(filepath.Join("..", "..", "remediate", "remediateflag", "*.go"))
	shared = append(shared, remediation...)
	flags := map[string]bool{}
	for _, f := range toolkitFlags {
		flags[f] = true
	}
	for _, f := range append(files, shared...) {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		prefixes := []string{""}
		for _, m := range remediatePrefix.FindAllSubmatch(src, -1) {
			prefixes = append(prefixes, string(m[1]))
		}
		for _, m := range flagDecl.FindAllSubmatch(src, -1) {
			if len(m[1]) == 0 {
				flags[string(m[2])] = true
				continue
			}
			for _, p := range prefixes {
				flags[p+string(m[2])] = true
			}
		}
	}
	return flags
}

// flagChecker caches binaryFlags per binary.
type flagChecker map[string]map[string]bool

// check fails the test for every --flag in argv (argv[0] names the
// binary) that the binary does not declare.
func (c flagChecker) check(t *testing.T, where string, argv []string) {
	t.Helper()
	if len(argv) == 0 {
		t.Errorf("%s: no command", where)
		return
	}
	binary := filepath.Base(argv[0])
	if !strings.HasPrefix(binary, "gpu-orphan") {
		return
	}
	if c[binary] == nil {
		c[binary] = binaryFlags(t, binary)
	}
	for _, arg := range argv[1:] {
		name, ok := strings.CutPrefix(arg, "--")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(name, "=")
		name = strings.TrimPrefix(name, "no-")
		if !c[binary][name] {
			t.Errorf("%s: %s has no flag --%s", where, binary, name)
		}
	}
}

// flagValue returns the value of --name=value in argv.
func flagValue(argv []string, name string) (string, bool) {
	for _, arg := range argv {
		if v, ok := strings.CutPrefix(arg, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func TestFlagCheckerRejectsUnknownFlags(t *testing.T) {
	flags := binaryFlags(t, "gpu-orphan-exporter")
	for _, f := range []string{"backend", "sim.root", "web.listen-address", "collector.interval"} {
		if !flags[f] {
			t.Errorf("gpu-orphan-exporter: --%s not found in its source", f)
		}
	}
	if flags["no.such-flag"] {
		t.Error("an undeclared flag was accepted")
	}
}
