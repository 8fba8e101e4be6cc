package procevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A real child: its fork, exec and exit arrive, with our PID as the parent.
func TestListenRealChild(t *testing.T) {
	l := listen(t)
	defer l.Close()
	got := make(chan []Event, 64)
	go func() {
		var buf []Event
		for {
			var err error
			buf, err = l.Receive(buf[:0])
			if err != nil && !errors.Is(err, ErrLost) {
				close(got)
				return
			}
			got <- append([]Event(nil), buf...)
		}
	}()
	before := monotonic(t)
	cmd := exec.Command("sleep", "0.05")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	after := monotonic(t)
	child := cmd.Process.Pid
	seen := map[Kind]bool{}
	deadline := time.After(10 * time.Second)
	for !seen[Fork] || !seen[Exec] || !seen[Exit] {
		select {
		case evs, ok := <-got:
			if !ok {
				t.Fatal("the listener stopped")
			}
			for _, e := range evs {
				if e.PID != child {
					continue
				}
				if e.Kind == Fork && e.ParentPID != os.Getpid() {
					t.Errorf("fork of %d: parent %d, want %d", child, e.ParentPID, os.Getpid())
				}
				if e.Thread() {
					t.Errorf("%v of %d is a thread's: TID %d", e.Kind, child, e.TID)
				}
				// The kernel stamps events with CLOCK_MONOTONIC, which the
				// fork record compares with start times.
				if e.Timestamp < before || e.Timestamp > after {
					t.Errorf("%v of %d stamped %d, not within the child's run [%d, %d] of CLOCK_MONOTONIC", e.Kind, child, e.Timestamp, before, after)
				}
				seen[e.Kind] = true
			}
		case <-deadline:
			t.Fatalf("timed out; seen %v for child %d", seen, child)
		}
	}
}

func monotonic(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    []byte
		want Event
		ok   bool
	}{
		{"fork", cnMessage(Fork, 10, 10, 12, 12), Event{Kind: Fork, ParentPID: 10, TID: 12, PID: 12}, true},
		{"thread", cnMessage(Fork, 10, 10, 13, 10), Event{Kind: Fork, ParentPID: 10, TID: 13, PID: 10}, true},
		{"exec", cnMessage(Exec, 12, 12), Event{Kind: Exec, TID: 12, PID: 12}, true},
		{"exit", cnMessage(Exit, 14, 12, 0, 17, 1, 1), Event{Kind: Exit, TID: 14, PID: 12}, true},
		{"timestamp", func() []byte {
			b := cnMessage(Exit, 14, 12)
			binary.NativeEndian.PutUint64(b[cnMsgLen+8:], 123456789)
			return b
		}(), Event{Kind: Exit, TID: 14, PID: 12, Timestamp: 123456789}, true},
		{"uid change dropped", cnMessage(0x4, 12, 12, 0, 0), Event{}, false},
		{"short", cnMessage(Fork, 10, 10)[:cnMsgLen+procEventHdrLen+8], Event{}, false},
		{"truncated", []byte{1, 0, 0}, Event{}, false},
		{"other connector", func() []byte { b := cnMessage(Exec, 1, 1); b[0] = 9; return b }(), Event{}, false},
		{"length past the data", func() []byte { b := cnMessage(Exec, 1, 1); b[16] = 200; return b }(), Event{}, false},
	} {
		got, ok := Parse(tc.b)
		if ok != tc.ok || got != tc.want {
			t.Errorf("%s: Parse = %+v, %v; want %+v, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

// A datagram may hold more than one netlink message; a length past the
// datagram ends it.
func TestAppendMessages(t *testing.T) {
	two := append(nlMessage(cnMessage(Fork, 1, 1, 5, 5)), nlMessage(cnMessage(Exit, 5, 5))...)
	got := appendMessages(nil, two)
	want := []Event{{Kind: Fork, ParentPID: 1, TID: 5, PID: 5}, {Kind: Exit, TID: 5, PID: 5}}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("two messages: %+v, want %+v", got, want)
	}
	bad := nlMessage(cnMessage(Exec, 7, 7))
	binary.NativeEndian.PutUint32(bad[0:], uint32(len(bad)+4))
	if got := appendMessages(nil, bad); len(got) != 0 {
		t.Errorf("a length past the datagram: %+v, want nothing", got)
	}
	if got := appendMessages(nil, two[:10]); len(got) != 0 {
		t.Errorf("a datagram shorter than a header: %+v, want nothing", got)
	}
}

// cnMessage is a connector message (struct cn_msg, struct proc_event) of
// kind with the event's fields.
func cnMessage(kind Kind, fields ...uint32) []byte {
	b := make([]byte, cnMsgLen+procEventHdrLen+4*len(fields))
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], cnIdxProc)
	ne.PutUint32(b[4:], cnValProc)
	ne.PutUint16(b[16:], uint16(procEventHdrLen+4*len(fields)))
	ne.PutUint32(b[cnMsgLen:], uint32(kind))
	for i, f := range fields {
		ne.PutUint32(b[cnMsgLen+procEventHdrLen+4*i:], f)
	}
	return b
}

// nlMessage is payload in a netlink message, as the kernel frames it.
func nlMessage(payload []byte) []byte {
	n := unix.SizeofNlMsghdr + len(payload)
	b := make([]byte, (n+3)&^3)
	binary.NativeEndian.PutUint32(b[0:], uint32(n))
	binary.NativeEndian.PutUint16(b[4:], unix.NLMSG_DONE)
	copy(b[unix.SizeofNlMsghdr:], payload)
	return b
}

// listen subscribes, skipping the test where the events need privileges
// it lacks.
func listen(t *testing.T) *Listener {
	t.Helper()
	l, err := Listen()
	if errors.Is(err, ErrUnavailable) && os.Geteuid() != 0 {
		t.Skipf("not root: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func FuzzParse(f *testing.F) {
	f.Add([]byte{1, 0, 0, 0, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) { Parse(b) })
}

// A Receive that waits returns at its deadline, and at Close.
func TestReceiveDeadlineAndClose(t *testing.T) {
	l := listen(t)
	// Other processes' events may come first: read until the deadline.
	l.SetDeadline(time.Now().Add(100 * time.Millisecond))
	for {
		_, err := l.Receive(nil)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		if err != nil && !errors.Is(err, ErrLost) {
			t.Fatalf("before the deadline: %v", err)
		}
	}
	l.SetDeadline(time.Time{})
	done := make(chan error)
	go func() {
		for {
			_, err := l.Receive(nil)
			if err != nil && !errors.Is(err, ErrLost) {
				done <- err
				return
			}
		}
	}()
	l.Close()
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Errorf("Receive after Close: %v, want %v", err, ErrClosed)
	}
}

// Only the kernel speaks for the connector: a datagram that another
// socket sends to the listener's port (a privileged process may) is not
// an event, whatever it says.
func TestForgedEventDropped(t *testing.T) {
	l := listen(t)
	defer l.Close()
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_CONNECTOR)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	const forged = 999999 // a PID no process has: pid_max is at most 4194304, and nothing runs it
	msg := nlMessage(cnMessage(Fork, 1, 1, forged, forged))
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Pid: l.port}); err != nil {
		t.Fatalf("sending to the listener's port: %v", err)
	}
	// The forged datagram was queued before this deadline: read all.
	l.SetDeadline(time.Now().Add(200 * time.Millisecond))
	for {
		evs, err := l.Receive(nil)
		for _, e := range evs {
			if e.PID == forged {
				t.Fatalf("a datagram from another socket was taken for the kernel's event %+v", e)
			}
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return
		}
		if err != nil && !errors.Is(err, ErrLost) {
			t.Fatal(err)
		}
	}
}

// TestListenFiltersEvents: on Linux 6.6 and later the kernel sends only
// the events the listener keeps. A process that renames itself 100 times
// (each a comm event, as each exec also sends) costs a handful of
// datagrams, not a hundred.
func TestListenFiltersEvents(t *testing.T) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	var major, minor int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &major, &minor); err != nil {
		t.Fatal(err)
	}
	if major < 6 || (major == 6 && minor < 6) {
		t.Skipf("kernel %d.%d: the connector's event filter came in 6.6", major, minor)
	}
	l := listen(t)
	defer l.Close()
	cmd := exec.Command("sh", "-c", `i=0; while [ $i -lt 100 ]; do echo "n$i" > /proc/$$/comm; i=$((i+1)); done`)
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	child := cmd.Process.Pid
	l.SetDeadline(time.Now().Add(10 * time.Second))
	var buf []Event
	for exited := false; !exited; {
		var err error
		buf, err = l.Receive(buf[:0])
		if err != nil {
			t.Fatalf("before the child's exit: %v", err)
		}
		for _, e := range buf {
			exited = exited || (e.Kind == Exit && e.PID == child && !e.Thread())
		}
	}
	// With the filter no comm event reaches the socket, however busy the
	// machine is (a CI runner forks thousands of processes a second
	// beside this test, all of them kept events); without it, the
	// child's 100 renames alone arrive.
	if l.unkept >= 50 {
		t.Errorf("%d of %d datagrams carried no kept event for a child that renamed itself 100 times: the kernel does not filter the events", l.unkept, l.datagrams)
	}
	t.Logf("%d datagrams, %d of them unkept", l.datagrams, l.unkept)
}
