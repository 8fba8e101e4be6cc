package cli

import (
	"fmt"
	"os"
	"regexp"
	"strings"

	"github.com/alecthomas/kingpin/v2"
)

var unknownFlag = regexp.MustCompile(`unknown long flag '--([^'=]+)`)

// ParseError is what to print when app cannot parse its command line: the
// parser's error, the flag meant when an unknown one is close to a real one
// (--sim-root: did you mean --sim.root?), and, for a name it does not
// know, where the help is. The
// caller exits 2, as for every error in its input.
func ParseError(app *kingpin.Application, err error) string {
	msg := err.Error()
	if m := unknownFlag.FindStringSubmatch(msg); m != nil {
		if best := closestFlag(app, m[1]); best != "" {
			msg += "; did you mean --" + best + "?"
		}
	}
	// A bad value says what it wants already; an unknown name does not.
	if strings.HasPrefix(msg, "unknown ") || strings.HasPrefix(msg, "expected command") || strings.Contains(msg, "unexpected ") {
		msg += fmt.Sprintf(" (%s --help lists the flags)", app.Name)
	}
	return msg
}

// closestFlag is the flag of app, on any command, nearest to name: the same
// words with other separators, or at most two edits away.
func closestFlag(app *kingpin.Application, name string) string {
	var names []string
	model := app.Model()
	for _, f := range model.Flags {
		names = append(names, f.Name)
	}
	var walk func(cmds []*kingpin.CmdModel)
	walk = func(cmds []*kingpin.CmdModel) {
		for _, c := range cmds {
			for _, f := range c.Flags {
				names = append(names, f.Name)
			}
			walk(c.Commands)
		}
	}
	walk(model.Commands)
	norm := func(s string) string {
		return strings.NewReplacer("-", "", ".", "", "_", "").Replace(strings.ToLower(s))
	}
	best, bestDist := "", 3
	for _, n := range names {
		if norm(n) == norm(name) {
			return n
		}
		if d := editDistance(n, name); d < bestDist {
			best, bestDist = n, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// HelpOnStdout gives app -h for --help and prints what a user asked to
// read (--help, `help COMMAND`, --version) on standard output, as
// Prometheus and node_exporter do, so that `gpu-orphan clean --help | grep
// act` finds it. Errors stay on standard error: kingpin's own, and the
// ParseError line that each main prints.
func HelpOnStdout(app *kingpin.Application) {
	app.HelpFlag.Short('h')
	app.UsageWriter(os.Stdout)
	app.ErrorWriter(os.Stderr)
}
