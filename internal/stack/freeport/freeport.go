// Package freeport gives the daemons that the tests and `make run` start
// loopback ports that nothing else can take from under them.
//
// A port found free by listening on 127.0.0.1:0 and closing again lies in
// the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999
// by default), from which the kernel also takes the local port of every
// outgoing connection on the machine: between the close and the child's
// own bind, any connect() may take it ("Alertmanager: port 36785 in use").
// So there are two ways, best first:
//
//   - A daemon that can take a listening socket gets one that the parent
//     holds and never closes (Pass): ours, and anything served by
//     exporter-toolkit with --web.systemd-socket. The port may be any,
//     127.0.0.1:0 included.
//   - A daemon that binds its own port (Prometheus, Alertmanager) gets one
//     below the ephemeral range, which only explicit binds use (Reserve);
//     its starter retries on another when one is taken first all the same
//     (InUse), a bounded number of times.
package freeport

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
)

// RangeFile holds the kernel's ephemeral port range.
const RangeFile = "/proc/sys/net/ipv4/ip_local_port_range"

// EphemeralRange is the kernel's ephemeral port range, low and high
// included.
func EphemeralRange() (lo, hi int, err error) {
	b, err := os.ReadFile(RangeFile)
	if err != nil {
		return 0, 0, err
	}
	return ParseRange(string(b))
}

// ParseRange parses the content of ip_local_port_range: "32768\t60999\n".
func ParseRange(s string) (lo, hi int, err error) {
	f := strings.Fields(s)
	if len(f) != 2 {
		return 0, 0, fmt.Errorf("%s: %q: want two ports", RangeFile, s)
	}
	if lo, err = strconv.Atoi(f[0]); err == nil {
		hi, err = strconv.Atoi(f[1])
	}
	if err != nil || lo < 1 || hi > 65535 || lo > hi {
		return 0, 0, fmt.Errorf("%s: %q: not a port range", RangeFile, s)
	}
	return lo, hi, nil
}

// Ports outside the ephemeral range, below it by preference.
const (
	// minPort keeps clear of the well-known ports and of the usual
	// services' (Prometheus's 9090, the exporter's 10835, ...).
	minPort = 16384
	// minCandidates is the fewest ports worth picking among.
	minCandidates = 256
)

// avoid are ports that a `make run` beside the tests uses.
var avoid = []int{19090, 19093}

// Candidates is the span of ports Reserve picks from for the ephemeral
// range lo-hi: the ports below it, from 16384 (or half of lo, when lo is
// lower) up; else, when the range starts too low to leave enough, those
// above it.
func Candidates(lo, hi int) (first, last int, err error) {
	first = min(minPort, lo/2)
	if first < 1024 {
		first = 1024
	}
	if lo-first >= minCandidates {
		return first, lo - 1, nil
	}
	if 65535-hi >= minCandidates {
		return hi + 1, 65535, nil
	}
	return 0, 0, fmt.Errorf("the ephemeral port range %d-%d (%s) leaves fewer than %d ports outside it", lo, hi, RangeFile, minCandidates)
}

// Port is a port reserved by Reserve.
type Port struct {
	// Addr is HOST:PORT.
	Addr string
	Port int
	// lock is the abstract socket that reserves Port among the Reserve
	// calls of every process on the machine.
	lock net.Listener
}

// Release ends the reservation. Call it once the daemon has bound the
// port, or given up; it may be called more than once.
func (p *Port) Release() {
	if p != nil && p.lock != nil {
		p.lock.Close()
		p.lock = nil
	}
}

// attempts bounds the ports Reserve tries.
const attempts = 100

// Reserve picks a port of host (an IP address: "127.0.0.1") outside the
// kernel's ephemeral range (Candidates), at random, that can be bound now
// and that no other Reserve on this machine holds (in this process or
// another: go test runs packages in parallel), and holds it until Release.
// The reservation is an abstract unix socket named after the port, which
// the kernel frees with the process, however it ends. It keeps other
// Reserve calls away, not other programs: the daemon given the port must
// still fail clearly when it is taken (InUse), and its starter retry.
func Reserve(host string) (*Port, error) {
	lo, hi, err := EphemeralRange()
	if err != nil {
		return nil, err
	}
	first, last, err := Candidates(lo, hi)
	if err != nil {
		return nil, err
	}
	return reserve(host, first, last)
}

// reserve is Reserve among the ports first to last.
func reserve(host string, first, last int) (*Port, error) {
	var lastErr error
	for range attempts {
		port := first + rand.IntN(last-first+1)
		if slices.Contains(avoid, port) {
			lastErr = fmt.Errorf("port %d is kept for make run", port)
			continue
		}
		lock, err := net.Listen("unix", lockName(port))
		if err != nil {
			lastErr = err // another Reserve holds it
			continue
		}
		addr := net.JoinHostPort(host, strconv.Itoa(port))
		l, err := net.Listen("tcp", addr)
		if err != nil {
			lock.Close()
			lastErr = err // in use by another program
			continue
		}
		l.Close()
		return &Port{Addr: addr, Port: port, lock: lock}, nil
	}
	return nil, fmt.Errorf("no free port on %s in %d-%d after %d attempts: %w", host, first, last, attempts, lastErr)
}

// lockName is the abstract socket that reserves port.
func lockName(port int) string { return "@gpu-orphan/freeport/" + strconv.Itoa(port) }

// InUse reports whether a daemon's output (its log, or an error) says that
// its listening port was in use: another process bound it first.
func InUse(output string) bool {
	return strings.Contains(output, "address already in use")
}

// Listen listens on a port the kernel picks on ip (127.0.0.1, or a
// host's address that an EndpointSlice may name), for Pass.
func Listen(ip string) (*net.TCPListener, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return nil, err
	}
	return l.(*net.TCPListener), nil
}

// SystemdSocketFlag is the flag with which a daemon served by
// exporter-toolkit (kingpinflag) serves on the socket that Pass hands it.
const SystemdSocketFlag = "--web.systemd-socket"

// passScript runs the daemon with LISTEN_PID set to its PID, which only
// the process itself knows: sh sets it to its own and becomes the daemon
// by exec, keeping its PID (and the session, Pdeathsig and descriptors
// that exec.Cmd gave it).
const passScript = `LISTEN_PID=$$; export LISTEN_PID; exec "$0" "$@"`

// Pass makes cmd, not started yet and with no ExtraFiles, inherit l as
// systemd hands a socket to a service (sd_listen_fds(3)): as descriptor
// 3, with LISTEN_FDS=1 and LISTEN_PID its PID (cmd runs through
// /bin/sh, which sets it and execs the program). A daemon served by
// exporter-toolkit takes it with SystemdSocketFlag; its
// --web.listen-address is then ignored.
//
// It returns the descriptor given to cmd: close it once cmd has started
// (or failed to), after which the socket lives in the child alone. l
// itself is closed: the socket never stops listening, so nothing else can
// take its port, and connections made before the child serves wait in the
// socket's backlog.
func Pass(cmd *exec.Cmd, l *net.TCPListener) (*os.File, error) {
	if cmd.Process != nil {
		return nil, errors.New("freeport.Pass: the command has started")
	}
	if len(cmd.ExtraFiles) != 0 {
		return nil, errors.New("freeport.Pass: the command has ExtraFiles: the socket must be descriptor 3")
	}
	if cmd.Err != nil {
		return nil, cmd.Err
	}
	f, err := l.File()
	l.Close()
	if err != nil {
		return nil, err
	}
	env := cmd.Env
	if env == nil {
		env = os.Environ()
	}
	env = slices.DeleteFunc(slices.Clone(env), func(kv string) bool {
		return strings.HasPrefix(kv, "LISTEN_PID=") || strings.HasPrefix(kv, "LISTEN_FDS=") || strings.HasPrefix(kv, "LISTEN_FDNAMES=")
	})
	cmd.Env = append(env, "LISTEN_FDS=1")
	cmd.Args = append([]string{"/bin/sh", "-c", passScript, cmd.Path}, cmd.Args[1:]...)
	cmd.Path = "/bin/sh"
	cmd.ExtraFiles = []*os.File{f}
	return f, nil
}

// Program is the program that cmd runs: after Pass, the one that /bin/sh
// becomes.
func Program(cmd *exec.Cmd) string {
	if cmd.Path == "/bin/sh" && len(cmd.Args) >= 4 && cmd.Args[2] == passScript {
		return cmd.Args[3]
	}
	return cmd.Path
}
