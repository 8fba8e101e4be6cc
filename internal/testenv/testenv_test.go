package testenv

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/exporter-toolkit/web"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/freeport"
)

// serveEnv makes the test binary a daemon as ours are: served by
// exporter-toolkit, with --web.systemd-socket, answering its PID.
const serveEnv = "TESTENV_TEST_SERVE"

func TestMain(m *testing.M) {
	if os.Getenv(serveEnv) != "" {
		systemd, addrs, config := true, []string{":1"}, ""
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprint(w, os.Getpid())
		}), ReadHeaderTimeout: 10 * time.Second}
		err := web.ListenAndServe(srv, &web.FlagConfig{WebSystemdSocket: &systemd, WebListenAddresses: &addrs, WebConfigFile: &config},
			slog.New(slog.NewTextHandler(os.Stderr, nil)))
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	os.Exit(Main(m))
}

// TestFreeAddr: loopback ports outside the kernel's ephemeral range, free,
// and not handed out twice.
func TestFreeAddr(t *testing.T) {
	lo, hi, err := freeport.EphemeralRange()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for range 20 {
		addr := FreeAddr(t)
		host, p, err := net.SplitHostPort(addr)
		port, _ := strconv.Atoi(p)
		if err != nil || host != "127.0.0.1" || port >= lo && port <= hi {
			t.Errorf("FreeAddr = %s (%v), want 127.0.0.1 and a port outside %d-%d", addr, err, lo, hi)
		}
		if seen[addr] {
			t.Errorf("%s handed out twice", addr)
		}
		seen[addr] = true
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Errorf("FreeAddr's %s: %v", addr, err)
			continue
		}
		l.Close()
	}
}

// TestPassListener: a daemon started by DaemonCmd serves on the socket
// PassListener handed it, as the process that was started; once it has
// exited, nothing listens there (the test's copy closed at the start).
func TestPassListener(t *testing.T) {
	cmd := exec.Command(os.Args[0], freeport.SystemdSocketFlag)
	cmd.Env = append(os.Environ(), serveEnv+"=1")
	addr := PassListener(t, cmd)
	DaemonCmd(t, cmd)
	c := &http.Client{Timeout: time.Minute}
	resp, err := c.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if got := strings.TrimSpace(string(b)); got != strconv.Itoa(cmd.Process.Pid) {
		t.Errorf("served by PID %s, want the daemon's %d", got, cmd.Process.Pid)
	}
	cmd.Process.Kill()
	cmd.Process.Wait()
	if conn, err := net.Dial("tcp", addr); err == nil {
		conn.Close()
		t.Errorf("%s still accepts connections after the daemon exited", addr)
	}
}

// TestBinBuildSettings: the binaries that tests start are race-built when
// the tests are, and built with the Makefile's CGO_CFLAGS unless the
// environment sets its own.
func TestBinBuildSettings(t *testing.T) {
	bin := Bin(t, "gpu-orphan-sim")
	out, err := exec.Command("go", "version", "-m", bin).CombinedOutput()
	if err != nil {
		t.Fatalf("go version -m: %v\n%s", err, out)
	}
	settings := map[string]string{}
	for line := range strings.Lines(string(out)) {
		if kv, ok := strings.CutPrefix(strings.TrimSpace(line), "build\t"); ok {
			k, v, _ := strings.Cut(kv, "=")
			if u, err := strconv.Unquote(v); err == nil {
				v = u // values with spaces are quoted
			}
			settings[k] = v
		}
	}
	if race := settings["-race"] == "true"; race != RaceEnabled {
		t.Errorf("binary built with -race=%v, tests with -race=%v", race, RaceEnabled)
	}
	want := os.Getenv("CGO_CFLAGS")
	if want == "" {
		want = cgoCFlags
	}
	if got := settings["CGO_CFLAGS"]; got != want {
		t.Errorf("binary built with CGO_CFLAGS=%q, want %q", got, want)
	}
}

// fatalTB records the failure of a helper that calls Fatalf, and ends the
// goroutine as testing.T does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// TestEventuallyStretched: a wait is given its timeout times the slowness,
// and says so when it fails; a condition that holds ends it at once.
func TestEventuallyStretched(t *testing.T) {
	t.Setenv(SlownessEnv, "4")
	run := func(cond func() bool) (time.Duration, string) {
		f := &fatalTB{TB: t}
		start := time.Now()
		done := make(chan struct{})
		go func() {
			defer close(done)
			Eventually(f, 100*time.Millisecond, "nothing", cond)
		}()
		<-done
		return time.Since(start), f.msg
	}
	took, msg := run(func() bool { return false })
	if took < 400*time.Millisecond {
		t.Errorf("gave up after %s, want 4 x 100ms", took)
	}
	if !strings.HasPrefix(msg, "timed out after 100ms waiting for nothing (stretched to 400ms") {
		t.Errorf("failure %q", msg)
	}
	calls := 0
	if _, msg := run(func() bool { calls++; return true }); msg != "" || calls != 1 {
		t.Errorf("a condition that holds: asked %d times, %q", calls, msg)
	}
}

// TestReceiveStretched: Receive waits its timeout times the slowness for a
// value, and tells a closed channel from one that stayed silent.
func TestReceiveStretched(t *testing.T) {
	t.Setenv(SlownessEnv, "4")
	silent := make(chan int)
	start := time.Now()
	_, ok, err := Receive(silent, 100*time.Millisecond)
	if took := time.Since(start); took < 400*time.Millisecond {
		t.Errorf("gave up after %s, want 4 x 100ms", took)
	}
	if ok || err == nil || !strings.HasPrefix(err.Error(), "nothing within 100ms (stretched to 400ms") {
		t.Errorf("a silent channel: ok %v, error %v", ok, err)
	}

	sent := make(chan int, 1)
	sent <- 7
	if v, ok, err := Receive(sent, time.Hour); v != 7 || !ok || err != nil {
		t.Errorf("a value sent: %d, %v, %v", v, ok, err)
	}
	close(sent)
	if _, ok, err := Receive(sent, time.Hour); ok || err != nil {
		t.Errorf("a closed channel: ok %v, error %v", ok, err)
	}
}
