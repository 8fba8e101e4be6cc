package stack

import (
	"bufio"
	"bytes"
	"fmt"
	"regexp"
	"time"

	"github.com/prometheus/common/model"
)

// The alert whose thresholds ShortenRules shortens.
const alertName = "GPUOrphanMemory"

var (
	ruleStart   = regexp.MustCompile(`^[ \t]*-[ \t]+(alert|record):`)
	orphanAlert = regexp.MustCompile(`-[ \t]+alert:[ \t]+` + alertName + `[ \t]*$`)
	ageCompare  = regexp.MustCompile(`gpu_orphan_unowned_memory_age_seconds[ \t]*>[ \t]*([0-9.]+)`)
	forLine     = regexp.MustCompile(`^([ \t]+)for:[ \t]*(.*?)[ \t]*(#.*)?$`)
	commentLine = regexp.MustCompile(`^[ \t]*#`)
)

// ShortenRules returns a copy of a rule file (alerts/gpu-orphan.rules.yml)
// whose GPUOrphanMemory fires within seconds instead of minutes. Only two
// things change, both in that rule: the number in
// `gpu_orphan_unowned_memory_age_seconds > N` (the exporter's age clock,
// 120 s in the shipped file) becomes age, and its `for:` (1m) becomes
// forDur. Every other byte is copied, so Prometheus evaluates the
// project's own expressions, labels and annotations. It fails when it does
// not find exactly one of each, rather than copy the file unchanged and
// leave a demo waiting three minutes.
func ShortenRules(src []byte, age int, forDur time.Duration) ([]byte, error) {
	forText := promDuration(forDur)
	var out bytes.Buffer
	fmt.Fprintf(&out, "# GENERATED TEST COPY of alerts/gpu-orphan.rules.yml by ShortenRules\n"+
		"# (internal/stack/rules.go). Only %s's time thresholds are\n"+
		"# shortened, to age > %d s and for: %s (the line marked 'shortened'\n"+
		"# names the shipped values). Edit the shipped file.\n", alertName, age, forText)
	inRule := false
	nAge, nFor := 0, 0
	oldAge := ""
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if commentLine.MatchString(line) {
			out.WriteString(line + "\n")
			continue
		}
		if ruleStart.MatchString(line) {
			inRule = orphanAlert.MatchString(line)
		}
		if inRule {
			if m := ageCompare.FindAllStringSubmatchIndex(line, -1); m != nil {
				oldAge = line[m[0][2]:m[0][3]]
				nAge += len(m)
				line = ageCompare.ReplaceAllString(line, fmt.Sprintf("gpu_orphan_unowned_memory_age_seconds > %d", age))
			}
			if m := forLine.FindStringSubmatch(line); m != nil {
				line = fmt.Sprintf("%sfor: %s  # shortened from %s; the age threshold above from > %s", m[1], forText, m[2], oldAge)
				nFor++
			}
		}
		out.WriteString(line + "\n")
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if nAge != 1 || nFor != 1 {
		return nil, fmt.Errorf("expected one age threshold and one for: in %s, found %d and %d", alertName, nAge, nFor)
	}
	return out.Bytes(), nil
}

// promDuration writes d as Prometheus reads durations: "2s", "1m30s".
func promDuration(d time.Duration) string { return model.Duration(d).String() }
