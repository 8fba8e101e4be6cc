package cli

import (
	"errors"
	"fmt"
	"strings"

	"github.com/alecthomas/kingpin/v2"
)

// Exit statuses, the same in every binary of the project (README: Exit
// codes). The Slurm hooks keep them too: Slurm drains the node on any
// status but 0 (docs/slurm.md).
const (
	// ExitOK: it did what was asked; for ps, clean, prolog and epilog,
	// the GPUs are clean or were cleaned and the memory verified back.
	ExitOK = 0
	// ExitFailure: it ran and failed (a file, the driver, the network, the
	// audit store, a port), or the memory is still held; the last line on
	// stderr says why.
	ExitFailure = 1
	// ExitUsage: bad input, found before anything was done: an unknown
	// flag or command, no command, a value a flag does not take, a
	// required flag missing, flags that do not go together.
	ExitUsage = 2
)

// usageError is an error in the command line.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// Usagef is an error in the command line: ExitCode makes it ExitUsage.
func Usagef(format string, args ...any) error {
	return usageError{fmt.Errorf(format, args...)}
}

// IsUsage reports whether err, or an error it wraps, came from Usagef.
func IsUsage(err error) bool {
	var u usageError
	return errors.As(err, &u)
}

// ExitCode is the exit status for what run returned: ExitOK for nil,
// ExitUsage for an error in the command line (Usagef), ExitFailure for
// any other.
func ExitCode(err error) int {
	switch {
	case err == nil:
		return ExitOK
	case IsUsage(err):
		return ExitUsage
	}
	return ExitFailure
}

// NoCommand says what is wrong when args select none of app's commands and
// ask for neither --help nor --version, and "" otherwise. Kingpin would
// print the help on stdout and exit 0; the binaries print this line on
// stderr and exit ExitUsage instead, as for any other mistake, so that a
// script calling one without its command fails.
func NoCommand(app *kingpin.Application, args []string) string {
	model := app.Model()
	var cmds []string
	for _, c := range model.Commands {
		if !c.Hidden && c.Name != "help" {
			cmds = append(cmds, c.Name)
		}
	}
	if len(cmds) == 0 {
		return ""
	}
	// ParseContext only reads args: it sets no flag and runs no action.
	ctx, err := app.ParseContext(args)
	if err != nil || ctx.SelectedCommand != nil {
		return "" // Parse says what is wrong, or runs the command
	}
	for _, e := range ctx.Elements {
		f, ok := e.Clause.(*kingpin.FlagClause)
		if !ok {
			continue
		}
		switch f.Model().Name {
		case "help", "help-long", "help-man", "version", "completion-bash", "completion-script-bash", "completion-script-zsh":
			return ""
		}
	}
	return fmt.Sprintf("no command: want one of %s (%s --help says what each does)", strings.Join(cmds, ", "), app.Name)
}
