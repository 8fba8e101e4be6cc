package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// refusingURL is a metrics URL on a TCP port that this test holds bound
// but does not listen on: a connection to it is refused, and no other
// process can take the port meanwhile.
func refusingURL(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d/metrics", sa.(*syscall.SockaddrInet4).Port)
}

// TestDeadOwnersUnreachableSaysSo: when the exporter cannot be asked, the
// reason is one plain sentence with its cause in a few words and what to
// do, never Go's raw error (`Get "URL": dial tcp ...: connect: ...`)
// (issue 23, paper cut 7). Each case asks a real socket.
func TestDeadOwnersUnreachableSaysSo(t *testing.T) {
	t.Parallel()
	notFound := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(notFound.Close)
	garbage := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "<html>not { metrics") }))
	t.Cleanup(garbage.Close)
	// Accepts and never answers.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { silent.Close() })
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	refused := refusingURL(t)

	for _, tc := range []struct{ url, want string }{
		{refused, "no exporter answers at " + refused + " (connection refused); start gpu-orphan-exporter, or pass --exporter.url"},
		// The resolver's words vary with the machine ("no such host",
		// "server misbehaving"): only the name is sure to be there.
		{"http://no-such-host.invalid:10835/metrics", "no exporter answers at http://no-such-host.invalid:10835/metrics (*: no-such-host.invalid); start gpu-orphan-exporter, or pass --exporter.url"},
		{"http://" + silent.Addr().String() + "/metrics", "no exporter answers at http://" + silent.Addr().String() + "/metrics (no answer within 3s); start gpu-orphan-exporter, or pass --exporter.url"},
		{notFound.URL + "/metrics", notFound.URL + "/metrics answered 404 Not Found, not metrics; pass gpu-orphan-exporter's metrics URL as --exporter.url"},
		{garbage.URL, garbage.URL + " serves no Prometheus metrics (*); pass gpu-orphan-exporter's metrics URL as --exporter.url"},
		{"127.0.0.1:10835", `--exporter.url "127.0.0.1:10835" is not a URL (first path segment in URL cannot contain colon); give gpu-orphan-exporter's, such as http://127.0.0.1:10835/metrics`},
		{"localhost:10835", `--exporter.url "localhost:10835" is not a URL (it needs http:// or https://); give gpu-orphan-exporter's, such as http://127.0.0.1:10835/metrics`},
	} {
		t.Run(tc.url, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			_, _, err := askExporter(context.Background(), tc.url)
			if err == nil {
				t.Fatal("no error")
			}
			msg := err.Error()
			// A * in want stands for any words.
			prefix, suffix, _ := strings.Cut(tc.want, "*")
			if !strings.HasPrefix(msg, prefix) || !strings.HasSuffix(msg[len(prefix):], suffix) {
				t.Errorf("error\n  %q\nwant\n  %q", msg, tc.want)
			}
			for _, raw := range []string{`Get "`, "dial tcp", "connect:", "\n"} {
				if strings.Contains(msg, raw) {
					t.Errorf("error %q has Go's raw %q", msg, raw)
				}
			}
			if d := time.Since(start); d > askTimeout+2*time.Second {
				t.Errorf("took %s", d)
			}
		})
	}
}

// TestPSExporterRefused: the real `gpu-orphan ps`, with a dead owner and no
// exporter at --exporter.url, says so in one sentence on the owner's line.
func TestPSExporterRefused(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 512, 1)
	t.Cleanup(w.Kill)
	w.Hold()
	w.KillParent(t)
	url := refusingURL(t)
	_, stdout, stderr := runBin(t, "--backend=sim", "--sim.root="+root, "ps", "--exporter.url="+url)
	want := fmt.Sprintf("  left by PID %d: unknown: no exporter answers at %s (connection refused); start gpu-orphan-exporter, or pass --exporter.url\n", w.PID, url)
	if !strings.Contains(stdout, want) {
		t.Errorf("ps does not say\n%s\nstdout:\n%s\nstderr:\n%s", want, stdout, stderr)
	}
	if strings.Contains(stdout, "dial tcp") || strings.Contains(stdout, `Get "`) {
		t.Errorf("ps prints Go's raw error:\n%s", stdout)
	}
}
