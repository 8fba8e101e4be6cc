package freeport

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/exporter-toolkit/web"
)

// helperEnv makes the test binary a daemon served by exporter-toolkit on
// the socket that Pass hands it (--web.systemd-socket), answering its PID.
const helperEnv = "FREEPORT_TEST_SERVE"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		systemd, addrs, config := true, []string{":1"}, ""
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprint(w, os.Getpid())
		}), ReadHeaderTimeout: 10 * time.Second}
		err := web.ListenAndServe(srv, &web.FlagConfig{WebSystemdSocket: &systemd, WebListenAddresses: &addrs, WebConfigFile: &config},
			slog.New(slog.NewTextHandler(os.Stderr, nil)))
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	os.Exit(m.Run())
}

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		in     string
		lo, hi int
		ok     bool
	}{
		{"32768\t60999\n", 32768, 60999, true},
		{"1024 65535", 1024, 65535, true},
		{"32768", 0, 0, false},
		{"60999 32768", 0, 0, false},
		{"0 100", 0, 0, false},
		{"1024 70000", 0, 0, false},
		{"a b", 0, 0, false},
	} {
		lo, hi, err := ParseRange(tc.in)
		if (err == nil) != tc.ok || lo != tc.lo || hi != tc.hi {
			t.Errorf("ParseRange(%q) = %d, %d, %v", tc.in, lo, hi, err)
		}
	}
	if _, _, err := EphemeralRange(); err != nil {
		t.Errorf("this machine's range: %v", err)
	}
}

func TestCandidates(t *testing.T) {
	for _, tc := range []struct {
		lo, hi      int
		first, last int
	}{
		{32768, 60999, 16384, 32767}, // Linux's default
		{49152, 65535, 16384, 49151}, // IANA's
		{10000, 65535, 5000, 9999},
		{1100, 60000, 60001, 65535}, // too few below: above
		{1024, 65535, 0, 0},         // none left
	} {
		first, last, err := Candidates(tc.lo, tc.hi)
		if first != tc.first || last != tc.last || (err != nil) != (tc.first == 0) {
			t.Errorf("Candidates(%d, %d) = %d, %d, %v; want %d, %d", tc.lo, tc.hi, first, last, err, tc.first, tc.last)
		}
	}
}

// TestReserve: the ports are outside the ephemeral range, bindable, and
// never handed out twice while reserved.
func TestReserve(t *testing.T) {
	lo, hi, err := EphemeralRange()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	var held []*Port
	defer func() {
		for _, p := range held {
			p.Release()
		}
	}()
	for range 50 {
		p, err := Reserve("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, p)
		if p.Port >= lo && p.Port <= hi {
			t.Errorf("port %d is in the ephemeral range %d-%d", p.Port, lo, hi)
		}
		if seen[p.Port] {
			t.Errorf("port %d reserved twice", p.Port)
		}
		seen[p.Port] = true
		if p.Addr != "127.0.0.1:"+strconv.Itoa(p.Port) {
			t.Errorf("address %s for port %d", p.Addr, p.Port)
		}
		l, err := net.Listen("tcp", p.Addr)
		if err != nil {
			t.Errorf("reserved port %d cannot be bound: %v", p.Port, err)
			continue
		}
		l.Close()
	}

	// With one port to pick from: refused while reserved (by any process:
	// the abstract socket is the machine's) and while another program
	// binds it; picked once released.
	p := held[0]
	if got, err := reserve("127.0.0.1", p.Port, p.Port); err == nil {
		t.Errorf("a reserved port was reserved again: %s", got.Addr)
	}
	p.Release()
	p.Release() // twice is harmless
	l, err := net.Listen("tcp", p.Addr)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := reserve("127.0.0.1", p.Port, p.Port); err == nil {
		t.Errorf("a bound port was reserved: %s", got.Addr)
	} else if !InUse(err.Error()) {
		t.Errorf("error %q does not say the port is in use", err)
	}
	l.Close()
	again, err := reserve("127.0.0.1", p.Port, p.Port)
	if err != nil {
		t.Fatalf("a released, unbound port: %v", err)
	}
	again.Release()
}

// TestInUse: the words of a bind that failed, as Go (hence Prometheus and
// Alertmanager) write them.
func TestInUse(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, err = net.Listen("tcp", l.Addr().String())
	if err == nil || !InUse(err.Error()) {
		t.Errorf("binding a bound port: %v", err)
	}
	for _, line := range []string{
		`time=2026-01-02T10:00:00Z level=ERROR source=main.go:1 msg="Unable to start web listener" err="listen tcp 127.0.0.1:9093: bind: address already in use"`,
		`ts=2026-01-02T10:00:00Z caller=main.go:1 level=error msg="Error starting web server, exiting gracefully" err="listen tcp 127.0.0.1:9090: bind: address already in use"`,
	} {
		if !InUse(line) {
			t.Errorf("InUse(%q) = false", line)
		}
	}
	if InUse("listen tcp 127.0.0.1:9090: bind: permission denied") {
		t.Error("InUse of another error")
	}
}

// TestPass: a daemon served by exporter-toolkit with --web.systemd-socket
// serves on the socket Pass handed it, as the process that was started
// (LISTEN_PID is its PID), and the port stays taken from the first moment.
func TestPass(t *testing.T) {
	l, err := Listen("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	cmd := exec.Command(os.Args[0], SystemdSocketFlag)
	cmd.Env = append(os.Environ(), helperEnv+"=1", "LISTEN_PID=1", "LISTEN_FDS=7")
	var log bytes.Buffer
	cmd.Stderr = &log
	defer func() {
		if t.Failed() {
			t.Logf("the daemon's log:\n%s", log.String())
		}
	}()
	f, err := Pass(cmd, l)
	if err != nil {
		t.Fatal(err)
	}
	if Program(cmd) != os.Args[0] {
		t.Errorf("Program = %q, want %q", Program(cmd), os.Args[0])
	}
	if _, err := net.Listen("tcp", addr); err == nil || !InUse(err.Error()) {
		t.Errorf("the port is free between Pass and Start: %v", err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	defer func() { cmd.Process.Kill(); cmd.Wait() }() // before the log is read
	// No polling: the socket listens already, and the request waits in its
	// backlog until the daemon serves.
	c := &http.Client{Timeout: time.Minute}
	resp, err := c.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if got := strings.TrimSpace(string(b)); got != strconv.Itoa(cmd.Process.Pid) {
		t.Errorf("served by PID %s, want the started process %d", got, cmd.Process.Pid)
	}

	// A second Pass of the same command, or of one with ExtraFiles, is refused.
	l2, _ := Listen("127.0.0.1")
	defer l2.Close()
	if _, err := Pass(cmd, l2); err == nil {
		t.Error("Pass of a started command")
	}
	c2 := exec.Command("true")
	c2.ExtraFiles = []*os.File{os.Stdin}
	if _, err := Pass(c2, l2); err == nil {
		t.Error("Pass of a command with ExtraFiles")
	}
}
