package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
)

// There is no Docker engine in CI, so deploy/docker/Dockerfile is checked
// with BuildKit's own parser, and the shell of its build step is run with a
// stand-in make.

var dockerfilePath = filepath.Join("..", "..", "deploy", "docker", "Dockerfile")

// loadDockerfile parses the Dockerfile as BuildKit does, failing on any of
// BuildKit's build checks (docker build --check).
func loadDockerfile(t *testing.T) []instructions.Stage {
	t.Helper()
	f, err := os.Open(dockerfilePath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := parser.Parse(f)
	if err != nil {
		t.Fatalf("%s: %v", dockerfilePath, err)
	}
	for _, w := range res.Warnings {
		t.Errorf("%s: parser: %s", dockerfilePath, w.Short)
	}
	lint := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, loc []parser.Range) {
		line := 0
		if len(loc) > 0 {
			line = loc[0].Start.Line
		}
		t.Errorf("%s:%d: build check %s: %s", dockerfilePath, line, rule, msg)
	}})
	stages, _, err := instructions.Parse(res.AST, lint)
	if err != nil {
		t.Fatalf("%s: %v", dockerfilePath, err)
	}
	return stages
}

func stageNamed(t *testing.T, stages []instructions.Stage, name string) instructions.Stage {
	t.Helper()
	for _, s := range stages {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("%s: no stage %q", dockerfilePath, name)
	return instructions.Stage{}
}

// runs are a stage's RUN command lines (shell form), in order.
func runs(s instructions.Stage) []string {
	var out []string
	for _, c := range s.Commands {
		if r, ok := c.(*instructions.RunCommand); ok {
			out = append(out, strings.Join(r.CmdLine, " "))
		}
	}
	return out
}

var (
	goarchFromTarget = regexp.MustCompile(`\bGOARCH="?\$\{?TARGETARCH\}?"?(\s|$)`)
	ccFromScript     = regexp.MustCompile(`\bCC="?\$\(scripts/release\.sh cc "?\$\{?TARGETARCH\}?"?\)"?`)
	depsForTarget    = regexp.MustCompile(`^scripts/release\.sh deps "?\$\{?TARGETARCH\}?"?$`)
)

// buildRun is the build stage's RUN that runs `make build`.
func buildRun(t *testing.T, build instructions.Stage) string {
	t.Helper()
	for _, r := range runs(build) {
		if strings.Contains(r, "make build") {
			return r
		}
	}
	t.Fatalf("%s: the build stage runs no `make build`", dockerfilePath)
	return ""
}

// The build stage runs on the build machine and cross-compiles for
// TARGETARCH with cgo (docker buildx build --platform
// linux/amd64,linux/arm64); the image's stage runs nothing, so no stage
// needs emulation.
func TestDockerfileBuildsForTargetArch(t *testing.T) {
	stages := loadDockerfile(t)
	build := stageNamed(t, stages, "build")
	if build.Platform != "$BUILDPLATFORM" {
		t.Errorf("the build stage's FROM has --platform=%q, want $BUILDPLATFORM (cross-compile, not emulate)", build.Platform)
	}
	var args []string
	for _, c := range build.Commands {
		if a, ok := c.(*instructions.ArgCommand); ok {
			for _, kv := range a.Args {
				args = append(args, kv.Key)
			}
		}
	}
	if !slices.Contains(args, "TARGETARCH") {
		t.Errorf("the build stage declares no ARG TARGETARCH (it has %v)", args)
	}

	// The cross compiler is installed before the build, by the script
	// that chooses it for make release.
	rs := runs(build)
	deps := slices.IndexFunc(rs, func(r string) bool {
		return depsForTarget.MatchString(strings.TrimSpace(r))
	})
	if deps < 0 {
		t.Errorf("the build stage does not run `scripts/release.sh deps \"$TARGETARCH\"` (its RUNs: %q)", rs)
	}
	run := buildRun(t, build)
	if deps >= 0 && !slices.Contains(rs[deps+1:], run) {
		t.Errorf("the cross compiler is installed after the build")
	}
	for _, want := range []*regexp.Regexp{goarchFromTarget, ccFromScript, regexp.MustCompile(`\bCGO_ENABLED=1\b`), regexp.MustCompile(`\bGOOS=linux\b`)} {
		if !want.MatchString(run) {
			t.Errorf("the build RUN does not match /%s/:\n%s", want, run)
		}
	}

	for _, s := range stages {
		if s.Platform == "$BUILDPLATFORM" {
			continue
		}
		if rs := runs(s); len(rs) > 0 {
			t.Errorf("stage %q is built for the target platform and RUNs %q: an arm64 image would need emulation", s.BaseName, rs)
		}
	}
	image := stages[len(stages)-1]
	copied := false
	for _, c := range image.Commands {
		if cp, ok := c.(*instructions.CopyCommand); ok && cp.From == "build" && slices.Contains(cp.SourcePaths, "/src/bin/") {
			copied = true
		}
	}
	if !copied {
		t.Errorf("the image does not COPY --from=build /src/bin/")
	}
}

// The build step's shell, run as BuildKit would run it for each TARGETARCH,
// on an amd64 and an arm64 build machine, with a stand-in make that records
// its environment: the C compiler is gcc for the machine's own
// architecture and Debian's cross compiler for the other.
func TestDockerfileBuildStepChoosesCompiler(t *testing.T) {
	run := buildRun(t, stageNamed(t, loadDockerfile(t), "build"))
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh")
	}
	repo, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		host, target string
		wantCC       string // "" when the step must fail
	}{
		{host: "amd64", target: "amd64", wantCC: "gcc"},
		{host: "amd64", target: "arm64", wantCC: "aarch64-linux-gnu-gcc"},
		{host: "arm64", target: "arm64", wantCC: "gcc"},
		{host: "arm64", target: "amd64", wantCC: "x86_64-linux-gnu-gcc"},
		{host: "amd64", target: "riscv64"},
	} {
		t.Run(tc.host+"-to-"+tc.target, func(t *testing.T) {
			// WORKDIR /src: the build context's scripts/, and a tools
			// directory with a go that reports the host's architecture
			// and a make that writes down what it was given.
			src, tools := t.TempDir(), t.TempDir()
			if err := os.Symlink(filepath.Join(repo, "scripts"), filepath.Join(src, "scripts")); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(filepath.Join(src, "bin"), 0o755); err != nil {
				t.Fatal(err)
			}
			record := filepath.Join(t.TempDir(), "make.env")
			for name, body := range map[string]string{
				"go":   `[ "$*" = "env GOHOSTARCH" ] && echo "$FAKE_HOSTARCH" || exit 3`,
				"make": `{ echo "args=$*"; echo "GOARCH=$GOARCH"; echo "GOOS=$GOOS"; echo "CC=$CC"; echo "CGO_ENABLED=$CGO_ENABLED"; } >"$MAKE_RECORD"`,
			} {
				if err := os.WriteFile(filepath.Join(tools, name), []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command(sh, "-c", run)
			cmd.Dir = src
			cmd.Env = []string{
				"PATH=" + tools + string(os.PathListSeparator) + os.Getenv("PATH"),
				"TARGETARCH=" + tc.target, "VERSION=v9.9.9",
				"FAKE_HOSTARCH=" + tc.host, "MAKE_RECORD=" + record,
			}
			out, err := cmd.CombinedOutput()
			if tc.wantCC == "" {
				if err == nil {
					t.Fatalf("the build step succeeded for TARGETARCH=%s:\n%s", tc.target, out)
				}
				if _, err := os.Stat(record); err == nil {
					t.Errorf("make ran for TARGETARCH=%s", tc.target)
				}
				return
			}
			if err != nil {
				t.Fatalf("the build step: %v\n%s", err, out)
			}
			b, err := os.ReadFile(record)
			if err != nil {
				t.Fatalf("make did not run: %v\n%s", err, out)
			}
			got := strings.Split(strings.TrimSpace(string(b)), "\n")
			want := []string{"args=build VERSION=v9.9.9", "GOARCH=" + tc.target, "GOOS=linux", "CC=" + tc.wantCC, "CGO_ENABLED=1"}
			if !slices.Equal(got, want) {
				t.Errorf("make ran with\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
		})
	}
}

// The build context leaves out what make release and make build leave
// behind.
func TestDockerfileIgnoresBuildOutputs(t *testing.T) {
	b, err := os.ReadFile(dockerfilePath + ".dockerignore")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Fields(string(b))
	for _, want := range []string{"bin", "dist", ".git"} {
		if !slices.Contains(lines, want) {
			t.Errorf("%s.dockerignore does not leave out %s", dockerfilePath, want)
		}
	}
}
