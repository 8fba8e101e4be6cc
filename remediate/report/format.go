package report

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/gpu-orphan/gpu-orphan/internal/termsafe"
)

// Formats are the output formats of Write.
var Formats = []string{"table", "json", "csv"}

// Write prints the report as a table for people, or as JSON or CSV (with a
// header; times in RFC 3339, bytes and GiB·hours as plain numbers).
func Write(w io.Writer, r Report, format string) error {
	switch format {
	case "table":
		return writeTable(w, r)
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	case "csv":
		return writeCSV(w, r)
	}
	return fmt.Errorf("unknown format %q: want one of %s", format, strings.Join(Formats, ", "))
}

func writeTable(w io.Writer, r Report) error {
	span := fmt.Sprintf("%s to %s", r.Since.UTC().Format("2006-01-02 15:04"), r.Until.UTC().Format("2006-01-02 15:04 MST"))
	if len(r.Rows) == 0 {
		_, err := fmt.Fprintf(w, "No orphaned-memory events from %s.\n", span)
		return err
	}
	events := "events"
	if r.Events == 1 {
		events = "event"
	}
	fmt.Fprintf(w, "Orphaned GPU memory by %s, %s: %d %s.\n\n", r.By, span, r.Events, events)
	// Numbers align right; the key, padded here, stays on the left.
	head := strings.ToUpper(string(r.By))
	width := utf8.RuneCountInString(head)
	for _, row := range r.Rows {
		width = max(width, utf8.RuneCountInString(termsafe.Escape(row.Key)))
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\tEVENTS\tGIB·HOURS\tFREED\tLAST\t\n", width, head)
	for _, row := range r.Rows {
		// Keys are names that users and processes chose (a comm, a user
		// name): their control characters are escaped, as in gpu-orphan ps.
		fmt.Fprintf(tw, "%-*s\t%d\t%s\t%s\t%s\t\n", width, termsafe.Escape(row.Key), row.Events, gibHours(row.GiBHours), humanBytes(row.FreedBytes),
			row.Last.UTC().Format("2006-01-02 15:04:05"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if r.Attempts > r.Events {
		// Retries: a restart interrupted an action, or the memory stayed
		// held after one and the alert's next notification tried again.
		_, err := fmt.Fprintf(w, "\n%d attempts for the %d %s: some needed more than one (GET /api/v1/actions shows each attempt's first_action_id).\n",
			r.Attempts, r.Events, events)
		return err
	}
	return nil
}

func writeCSV(w io.Writer, r Report) error {
	cw := csv.NewWriter(w)
	if err := cw.Write([]string{string(r.By), "events", "gib_hours", "freed_bytes", "last"}); err != nil {
		return err
	}
	for _, row := range r.Rows {
		if err := cw.Write([]string{termsafe.Escape(row.Key), strconv.Itoa(row.Events), strconv.FormatFloat(row.GiBHours, 'g', -1, 64),
			strconv.FormatUint(row.FreedBytes, 10), row.Last.UTC().Format(time.RFC3339)}); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// gibHours prints GiB·hours with about three significant digits.
func gibHours(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 1:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
	return strconv.FormatFloat(v, 'g', 2, 64)
}

func humanBytes(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d B", n)
}
