package sim

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
)

// procStat is what the simulator needs from /proc/PID/stat.
type procStat struct {
	// State is field 3: "R", "S", "Z", ...
	State string
	// StartTime is field 22, in clock ticks since boot; with the PID it
	// names a process even after its PID is reused.
	StartTime uint64
}

func readProcStat(pid int) (procStat, error) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(data)
}

// parseProcStat splits after the last ')', since the command name in field
// 2 may itself hold spaces and parentheses.
func parseProcStat(data []byte) (procStat, error) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("malformed /proc stat %q", data)
	}
	fields := bytes.Fields(data[i+1:])
	// fields[0] is field 3, so field 22 is fields[19].
	if len(fields) < 20 {
		return procStat{}, fmt.Errorf("short /proc stat: %d fields", len(fields)+2)
	}
	start, err := strconv.ParseUint(string(fields[19]), 10, 64)
	if err != nil {
		return procStat{}, fmt.Errorf("parsing start time: %w", err)
	}
	return procStat{State: string(fields[0]), StartTime: start}, nil
}
