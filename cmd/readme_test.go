package cmd

import (
	"bufio"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

const readmePath = "../README.md"

var (
	// A flag in the README: `--name`, inside code spans, tables or prose.
	readmeLong = regexp.MustCompile(`--([a-z][a-z0-9.-]*[a-z0-9])`)
	// A short flag in the README: `-o table`, `[-o ...]`.
	readmeShort = regexp.MustCompile("(?:^|[\\s`\\[])-([a-zA-Z])(?:[\\s`\\]=]|$)")
	// A flag in kingpin's --help-man, on the line after .TP:
	// \fB-o, --output=table\fR or \fB--act\fR.
	manFlag = regexp.MustCompile(`^\\fB(?:-([a-zA-Z]), )?--([a-zA-Z0-9][a-zA-Z0-9._-]*)`)
)

// binFlags is one binary's flags, every command's together, as its
// --help-man lists them (hidden flags and commands are not listed).
type binFlags struct {
	long  []string
	short map[string]string // long name -> short letter
}

func helpFlags(t *testing.T, bin string) binFlags {
	t.Helper()
	out, err := exec.Command(bin, "--help-man").Output()
	if err != nil {
		t.Fatalf("%s --help-man: %v", bin, err)
	}
	f := binFlags{short: map[string]string{}}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	afterTP := false
	for sc.Scan() {
		line := sc.Text()
		if afterTP {
			if m := manFlag.FindStringSubmatch(line); m != nil {
				if !slices.Contains(f.long, m[2]) {
					f.long = append(f.long, m[2])
				}
				if m[1] != "" {
					f.short[m[2]] = m[1]
				}
			}
		}
		afterTP = line == ".TP"
	}
	if len(f.long) < 3 {
		t.Fatalf("%s --help-man: found only the flags %v", bin, f.long)
	}
	return f
}

// readmeSection is the README's part about one binary: from its bold
// name to the next binary or heading.
type readmeSection struct {
	text string
	// tableFlags are the flags named in the first column of its table; nil
	// when it has no table (its flags are in the prose).
	tableFlags []string
}

func readmeSections(t *testing.T) (common []string, sections map[string]readmeSection) {
	t.Helper()
	b, err := os.ReadFile(readmePath)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n## Binaries and flags\n")
	if !ok {
		t.Fatalf("%s has no section 'Binaries and flags'", readmePath)
	}
	if i := strings.Index(rest, "\n## "); i >= 0 {
		rest = rest[:i]
	}
	sections = map[string]readmeSection{}
	var name string
	var cur readmeSection
	flush := func() {
		if name != "" {
			sections[name] = cur
		}
	}
	for line := range strings.Lines(rest) {
		if bin, ok := strings.CutPrefix(line, "**`"); ok {
			flush()
			name, _, _ = strings.Cut(bin, "`")
			cur = readmeSection{}
		}
		if name == "" {
			if strings.HasPrefix(line, "Every binary has") {
				for _, m := range readmeLong.FindAllStringSubmatch(line, -1) {
					common = append(common, m[1])
				}
			}
			continue
		}
		cur.text += line
		if cells := strings.Split(line, "|"); len(cells) > 2 && strings.HasPrefix(line, "|") {
			for _, m := range readmeLong.FindAllStringSubmatch(cells[1], -1) {
				cur.tableFlags = append(cur.tableFlags, m[1])
			}
		}
	}
	flush()
	if len(common) == 0 {
		t.Fatalf("%s: no 'Every binary has --...' line", readmePath)
	}
	return common, sections
}

// shippedBinaries are the Makefile's BINARIES, the ones `make build` ships
// (cmd/ may hold developer tools besides).
func shippedBinaries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "BINARIES"); ok {
			_, list, ok := strings.Cut(rest, "=")
			if bins := strings.Fields(list); ok && len(bins) > 0 {
				for _, bin := range bins {
					if _, err := os.Stat(bin); err != nil {
						t.Fatalf("the Makefile's BINARIES names %s: %v", bin, err)
					}
				}
				return bins
			}
		}
	}
	t.Fatal("no BINARIES line in the Makefile")
	return nil
}

// TestReadmeFlags: the README names every flag of every shipped binary, and only
// flags that exist. It reads each binary's real --help-man, so a flag added,
// renamed or dropped in the code fails here until the README follows.
// A binary with a table must name each flag in its first column; the
// others name theirs in their paragraph. The flags that every binary has
// are named once, in the sentence that says so.
func TestReadmeFlags(t *testing.T) {
	t.Parallel()
	bins := shippedBinaries(t)
	common, sections := readmeSections(t)
	for _, name := range bins {
		t.Run(name, func(t *testing.T) {
			sec, ok := sections[name]
			if !ok {
				t.Fatalf("%s has no paragraph **`%s`** under 'Binaries and flags'", readmePath, name)
			}
			flags := helpFlags(t, testenv.Bin(t, name))
			for _, c := range common {
				if !slices.Contains(flags.long, c) {
					t.Errorf("%s says every binary has --%s; %s has not", readmePath, c, name)
				}
			}
			named := func(flag string) bool {
				if sec.tableFlags != nil {
					return slices.Contains(sec.tableFlags, flag)
				}
				if strings.Contains(sec.text, "--"+flag) {
					return true
				}
				short, ok := flags.short[flag]
				return ok && slices.ContainsFunc(readmeShort.FindAllStringSubmatch(sec.text, -1),
					func(m []string) bool { return m[1] == short })
			}
			for _, f := range flags.long {
				if !slices.Contains(common, f) && !named(f) {
					where := "paragraph"
					if sec.tableFlags != nil {
						where = "table's first column"
					}
					t.Errorf("%s --%s is missing from the %s of **`%s`** in %s", name, f, where, name, readmePath)
				}
			}
			for _, m := range readmeLong.FindAllStringSubmatch(sec.text, -1) {
				// kingpin turns a boolean flag off with --no-NAME.
				negated, isNegation := strings.CutPrefix(m[1], "no-")
				if !slices.Contains(flags.long, m[1]) && !(isNegation && slices.Contains(flags.long, negated)) {
					t.Errorf("%s names --%s under **`%s`**, but %s has no such flag", readmePath, m[1], name, name)
				}
			}
		})
	}
}
