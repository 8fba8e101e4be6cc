package cmd

import (
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/gpu-orphan/gpu-orphan"

// layers ranks the module's top-level directories. A package may import
// packages of its own top-level directory and of lower ranks only, so
// imports run down: cmd -> remediate, exporter -> internal. remediate and
// exporter share a rank and so import neither each other nor cmd: the
// exporter links no decision code. Rank 0 is for directories outside the
// arrows, which import nothing of the module and are imported by nothing:
// alerts/ holds rule files and their test.
var layers = map[string]int{
	"cmd":       3,
	"remediate": 2,
	"exporter":  2,
	"internal":  1,
	"alerts":    0,
}

// layer is the top-level directory of a package of the module, and
// whether it is one (not the standard library or another module).
func layer(importPath string) (string, bool) {
	rel, ok := strings.CutPrefix(importPath, module+"/")
	if !ok {
		return "", false
	}
	top, _, _ := strings.Cut(rel, "/")
	return top, true
}

// allowed says whether a package of layer from may import one of layer to.
func allowed(from, to string) bool {
	return from == to || layers[to] > 0 && layers[from] > layers[to]
}

// TestImportsRunDown checks every import of the module's packages, and of
// their tests, over `go list`: none runs up or across.
func TestImportsRunDown(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("go", "list", "-f",
		`{{.ImportPath}}|{{join .Imports ","}}|{{join .TestImports ","}}|{{join .XTestImports ","}}`, "./...")
	cmd.Dir = ".."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list ./...: %v\n%s", err, stderr(err))
	}
	packages := 0
	for _, line := range strings.Split(strings.TrimSuffix(string(out), "\n"), "\n") {
		fields := strings.Split(line, "|")
		if len(fields) != 4 {
			t.Fatalf("go list printed %q, want a package and three import lists", line)
		}
		pkg := fields[0]
		from, ok := layer(pkg)
		if !ok {
			t.Fatalf("go list ./... listed %s, outside %s", pkg, module)
		}
		if _, known := layers[from]; !known {
			t.Errorf("%s: top-level directory %s/ has no rank in layers; give it one", pkg, from)
			continue
		}
		packages++
		for i, kind := range []string{"imports", "(test) imports", "(external test) imports"} {
			for _, imp := range strings.Split(fields[i+1], ",") { // "" for none: not the module's
				to, ok := layer(imp)
				if !ok {
					continue
				}
				if _, known := layers[to]; !known {
					t.Errorf("%s %s %s, whose top-level directory %s/ has no rank in layers", pkg, kind, imp, to)
					continue
				}
				if !allowed(from, to) {
					t.Errorf("%s %s %s: %s/ may import only its own packages and those below it (%s)", pkg, kind, imp, from, below(from))
				}
			}
		}
	}
	if packages < 10 {
		t.Fatalf("go list ./... listed %d packages of the module; the check ran on too few", packages)
	}
}

// below names the layers that from may import besides its own.
func below(from string) string {
	var names []string
	for name, rank := range layers {
		if rank > 0 && rank < layers[from] {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return "none"
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

func stderr(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(ee.Stderr)
	}
	return ""
}

// TestLayersRule: the rule itself, on the arrows the issue names.
func TestLayersRule(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		from, to string
		ok       bool
	}{
		{"cmd", "remediate", true},
		{"cmd", "exporter", true},
		{"cmd", "internal", true},
		{"remediate", "internal", true},
		{"exporter", "internal", true},
		{"remediate", "remediate", true},
		{"internal", "internal", true},
		{"internal", "remediate", false},
		{"internal", "exporter", false},
		{"internal", "cmd", false},
		{"remediate", "cmd", false},
		{"exporter", "cmd", false},
		{"exporter", "remediate", false},
		{"remediate", "exporter", false},
		{"alerts", "internal", false},
		{"cmd", "alerts", false},
		{"alerts", "alerts", true},
	} {
		if got := allowed(tc.from, tc.to); got != tc.ok {
			t.Errorf("allowed(%s -> %s) = %t, want %t", tc.from, tc.to, got, tc.ok)
		}
	}
}

// TestNodeAgentLinksNoKubernetes: the node agent, on every GPU node, links
// no Kubernetes client (client-go is the dispatcher's, 46 MB of its
// binary); gpu-orphan-dispatcher does, which shows the check sees it.
func TestNodeAgentLinksNoKubernetes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		binary string
		links  bool
	}{
		{"gpu-orphan-remediator", false},
		{"gpu-orphan-dispatcher", true},
	} {
		cmd := exec.Command("go", "list", "-deps", "./cmd/"+tc.binary)
		cmd.Dir = ".."
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps ./cmd/%s: %v\n%s", tc.binary, err, stderr(err))
		}
		var k8s []string
		for _, pkg := range strings.Fields(string(out)) {
			if strings.HasPrefix(pkg, "k8s.io/") {
				k8s = append(k8s, pkg)
			}
		}
		if links := slices.Contains(k8s, "k8s.io/client-go/kubernetes"); links != tc.links {
			t.Errorf("%s links k8s.io/client-go/kubernetes: %t, want %t", tc.binary, links, tc.links)
		}
		if !tc.links && len(k8s) > 0 {
			t.Errorf("%s links %d packages of k8s.io, want none: %v", tc.binary, len(k8s), k8s)
		}
	}
}
