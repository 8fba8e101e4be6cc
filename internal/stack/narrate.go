package stack

import (
	"fmt"
	"io"
	"sync"
)

// Narrator writes events as lines for a person: the time since the loop's
// start (the parent's SIGKILL) by the event's own clock (Event.At), as
// "+  7.1s"; the stage; what happened; then its detail lines, indented.
// Its Event method is a Config.OnEvent.
type Narrator struct {
	W io.Writer
	// Color adds ANSI bold, yellow for warnings and green for the memory
	// back (for a terminal).
	Color bool
	mu    sync.Mutex
}

// Indent is the width of the time column; Info lines start after it.
const Indent = 7

// Event writes one event.
func (n *Narrator) Event(ev Event) {
	n.mu.Lock()
	defer n.mu.Unlock()
	switch ev.Stage {
	case StageUp:
		n.Info("started " + ev.Text)
		return
	case StageStopped:
		if !ev.Warning {
			n.Info("stopped " + ev.Text)
			return
		}
	}
	stamp := fmt.Sprintf("%*s", Indent, "")
	if !ev.Start.IsZero() {
		stamp = fmt.Sprintf("+%5.1fs", ev.At.Sub(ev.Start).Seconds())
	}
	text := ev.Text
	switch {
	case ev.Warning:
		text = n.paint("33", "WARNING: "+text)
	case ev.Stage == StageMemoryBack:
		text = n.paint("32", text)
	}
	fmt.Fprintf(n.W, "%s %s %s\n", stamp, n.paint("1", fmt.Sprintf("%-22s", ev.Stage)), text)
	for _, m := range ev.More {
		n.Info(m)
	}
}

// Info writes a line under the time column.
func (n *Narrator) Info(text string) { fmt.Fprintf(n.W, "%*s %s\n", Indent, "", text) }

// Bold writes a heading.
func (n *Narrator) Bold(text string) { fmt.Fprintln(n.W, n.paint("1", text)) }

func (n *Narrator) paint(code, s string) string {
	if !n.Color {
		return s
	}
	return "\x1b[" + code + "m" + s + "\x1b[0m"
}
