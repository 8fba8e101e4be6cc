// Package procevents receives the kernel's process events (the proc
// connector: NETLINK_CONNECTOR, group CN_IDX_PROC) as they happen: every
// fork, exec, setsid and exit on the node.
//
// The netlink messages are framed with github.com/mdlayher/netlink
// (netlink.Message). The socket itself is opened and read here, with
// golang.org/x/sys/unix: the connector sends each event as one datagram,
// and a fork storm sends tens of thousands a second. mdlayher/netlink's
// Conn reads one datagram per call after peeking at its size (two system
// calls and an allocation per event), and like any os.File socket it
// registers with the Go runtime's poller, whose epoll wakes the process
// for every datagram that arrives, even while nobody reads: on the H200,
// that alone cost a daemon more than 10% of a core under a storm. Here the
// socket stays out of the runtime's poller: Receive waits in poll(2) only
// while it waits, and then takes up to ReceiveBatch datagrams in one
// recvmmsg(2) into buffers it reuses. The connector's own messages (struct
// cn_msg and struct proc_event of <linux/connector.h> and
// <linux/cn_proc.h>) are decoded here: no well-kept Go library decodes
// them and also survives a lost event. vishvananda/netlink's
// ProcEventMonitor stops at the first receive error (ENOBUFS after a fork
// storm) and cannot size the socket's buffer.
package procevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Kind is what happened to a process.
type Kind uint32

// The events kept (enum what of struct proc_event); others are dropped.
const (
	Fork Kind = 0x00000001
	Exec Kind = 0x00000002
	Sid  Kind = 0x00000080
	Exit Kind = 0x80000000
)

func (k Kind) String() string {
	switch k {
	case Fork:
		return "fork"
	case Exec:
		return "exec"
	case Sid:
		return "sid"
	case Exit:
		return "exit"
	}
	return fmt.Sprintf("event(%#x)", uint32(k))
}

// Event is one process event. PIDs are those of the initial PID namespace.
type Event struct {
	Kind Kind
	// TID and PID (the thread-group ID) of the process the event is about:
	// for Fork, the child.
	TID, PID int
	// ParentPID is, for Fork, the thread-group ID of the process that
	// forked (a thread of it).
	ParentPID int
	// Timestamp is when the kernel sent the event, in nanoseconds of
	// CLOCK_MONOTONIC. A fork event is sent after the child's start time
	// was set, so that a process with the child's PID that started later
	// is not the child (see forks).
	Timestamp uint64
}

// Thread reports whether the event is about a thread rather than a whole
// process: a fork that made a thread, or the exit of a thread other than
// the main one.
func (e Event) Thread() bool { return e.TID != e.PID }

// ErrLost is returned by Receive when the kernel dropped events because the
// socket's buffer was full (ENOBUFS): what was missed is unknown, and a
// reader resynchronises from /proc.
var ErrLost = errors.New("process events were lost (the socket's buffer overflowed)")

// ErrUnavailable wraps the reasons the connector cannot be used here.
var ErrUnavailable = errors.New("the kernel's process events are unavailable")

// Connector constants of <linux/connector.h> and <linux/cn_proc.h>.
const (
	cnIdxProc         = 1
	cnValProc         = 1
	procCnMcastListen = 1
	procCnMcastIgnore = 2
	cnMsgLen          = 20 // struct cn_msg without its data
	procEventHdrLen   = 16 // what, cpu, timestamp_ns
)

// readBuffer is the socket's receive buffer: room for tens of thousands of
// events while the reader is busy.
const readBuffer = 8 << 20

// ReceiveBatch is the most datagrams (events) one Receive takes, and
// datagramLen the room for each: an event's datagram is 76 bytes today
// (struct nlmsghdr, cn_msg and proc_event), a longer one is truncated and
// dropped.
const (
	ReceiveBatch = 128
	datagramLen  = 256
)

// Listener receives process events.
type Listener struct {
	// fd is the netlink socket, blocking and outside the runtime's
	// poller; wake an eventfd that Close writes to end a waiting Receive.
	fd, wake int
	port     uint32
	closed   atomic.Bool
	deadline atomic.Int64 // UnixNano; 0: none
	// mu is held by Receive, so that Close closes the descriptors only
	// once no Receive uses them.
	mu        sync.Mutex
	closeOnce sync.Once
	// The recvmmsg(2) vector, its buffers and the senders' addresses,
	// allocated once.
	msgs  []unix.Mmsghdr
	iovs  []unix.Iovec
	names []unix.RawSockaddrNetlink
	buf   []byte
	// datagrams counts those received from the kernel, and unkept those
	// of them that carried no event the listener keeps (comm, ptrace,
	// coredump, the subscription's acknowledgement).
	datagrams, unkept uint64
}

// Listen subscribes to the process events. It fails, wrapping
// ErrUnavailable, where the connector cannot be used: without
// CAP_NET_ADMIN, in a network namespace other than the initial one (the
// connector only speaks to that one: the subscription succeeds there and
// nothing ever arrives, which Listen cannot tell), or on a kernel without
// CONFIG_PROC_EVENTS.
func Listen() (*Listener, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_CONNECTOR)
	if err != nil {
		return nil, fmt.Errorf("%w: opening the connector's socket: %w", ErrUnavailable, os.NewSyscallError("socket", err))
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: cnIdxProc}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%w: opening the connector's socket: %w", ErrUnavailable, os.NewSyscallError("bind", err))
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, os.NewSyscallError("eventfd", err))
	}
	l := &Listener{
		fd:    fd,
		wake:  wake,
		msgs:  make([]unix.Mmsghdr, ReceiveBatch),
		iovs:  make([]unix.Iovec, ReceiveBatch),
		names: make([]unix.RawSockaddrNetlink, ReceiveBatch),
		buf:   make([]byte, ReceiveBatch*datagramLen),
	}
	if sa, err := unix.Getsockname(fd); err == nil {
		if nl, ok := sa.(*unix.SockaddrNetlink); ok {
			l.port = nl.Pid
		}
	}
	for i := range l.msgs {
		l.iovs[i].Base = &l.buf[i*datagramLen]
		l.iovs[i].SetLen(datagramLen)
		l.msgs[i].Hdr.Iov = &l.iovs[i]
		l.msgs[i].Hdr.SetIovlen(1)
		l.msgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&l.names[i]))
	}
	// Past rmem_max where the process may (SO_RCVBUFFORCE needs
	// CAP_NET_ADMIN, which the connector needs too).
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, readBuffer) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, readBuffer)
	}
	if err := l.mcast(procCnMcastListen); err != nil {
		l.closeFDs()
		return nil, fmt.Errorf("%w: subscribing: %w", ErrUnavailable, err)
	}
	// Since Linux 6.6 a listener may name the events it wants, and the
	// kernel drops the others before they reach the socket: each exec
	// also sends a comm event, a quarter of a fork storm's datagrams, and
	// receiving is most of what following the events costs. An older
	// kernel ignores this second message (its length is not the op's),
	// and the listener keeps every event.
	_ = l.mcast(procCnMcastListen, uint32(Fork|Exec|Sid|Exit))
	return l, nil
}

// mcast sends PROC_CN_MCAST_LISTEN or _IGNORE to the kernel; with events,
// a struct proc_input that keeps only those (Linux 6.6 and later).
func (l *Listener) mcast(op uint32, events ...uint32) error {
	data := []uint32{op}
	if len(events) > 0 {
		data = append(data, events[0])
	}
	b := make([]byte, cnMsgLen+4*len(data))
	binary.NativeEndian.PutUint32(b[0:], cnIdxProc)
	binary.NativeEndian.PutUint32(b[4:], cnValProc)
	binary.NativeEndian.PutUint16(b[16:], uint16(4*len(data)))
	for i, d := range data {
		binary.NativeEndian.PutUint32(b[cnMsgLen+4*i:], d)
	}
	m := netlink.Message{
		Header: netlink.Header{Length: uint32(unix.SizeofNlMsghdr + len(b)), Type: netlink.Done, PID: l.port},
		Data:   b,
	}
	msg, err := m.MarshalBinary()
	if err != nil {
		return err
	}
	return os.NewSyscallError("sendto", unix.Sendto(l.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}))
}

// ErrClosed is returned by Receive once the listener is closed.
var ErrClosed = errors.New("process events: listener closed")

// Receive blocks until events arrive and appends them to buf: those of up
// to ReceiveBatch datagrams, read in one system call. It returns ErrLost
// when the kernel dropped some since the last call; the listener stays
// usable. It returns os.ErrDeadlineExceeded once the deadline set by
// SetDeadline passed, and ErrClosed once Close was called. Receive must
// not be called concurrently.
func (l *Listener) Receive(buf []Event) ([]Event, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for {
		if l.closed.Load() {
			return buf, ErrClosed
		}
		n, errno := l.recvmmsg()
		switch errno {
		case 0:
			return l.appendEvents(buf, n), nil
		case unix.ENOBUFS:
			return buf, ErrLost
		case unix.EAGAIN, unix.EINTR:
		default:
			return buf, os.NewSyscallError("recvmmsg", errno)
		}
		if err := l.wait(); err != nil {
			return buf, err
		}
	}
}

// recvmmsg takes up to ReceiveBatch datagrams without waiting.
func (l *Listener) recvmmsg() (int, syscall.Errno) {
	for i := range l.msgs {
		l.msgs[i].Hdr.Namelen = unix.SizeofSockaddrNetlink
		l.msgs[i].Hdr.Flags = 0
		l.msgs[i].Len = 0
	}
	// MSG_DONTWAIT: the call never blocks (wait does), so the runtime
	// need not hand this thread's work to another.
	r, _, e := unix.RawSyscall6(unix.SYS_RECVMMSG, uintptr(l.fd), uintptr(unsafe.Pointer(&l.msgs[0])),
		uintptr(len(l.msgs)), unix.MSG_DONTWAIT, 0, 0)
	runtime.KeepAlive(l)
	return int(r), e
}

// wait blocks in poll(2) until a datagram is there, the deadline passes or
// Close is called.
func (l *Listener) wait() error {
	timeout := -1
	if d := l.deadline.Load(); d != 0 {
		left := time.Until(time.Unix(0, d))
		if left <= 0 {
			return os.ErrDeadlineExceeded
		}
		timeout = int((left + time.Millisecond - 1) / time.Millisecond)
	}
	fds := []unix.PollFd{{Fd: int32(l.fd), Events: unix.POLLIN}, {Fd: int32(l.wake), Events: unix.POLLIN}}
	// Whatever woke it (a datagram, a pending error such as ENOBUFS,
	// Close), the caller's next recvmmsg or check says.
	if _, err := unix.Poll(fds, timeout); err != nil && !errors.Is(err, unix.EINTR) {
		return os.NewSyscallError("poll", err)
	}
	return nil
}

// appendEvents appends the events of the n datagrams received.
func (l *Listener) appendEvents(buf []Event, n int) []Event {
	for i := range n {
		m := &l.msgs[i]
		// Only the kernel (port 0) speaks for the connector; a truncated
		// datagram is not an event.
		if m.Hdr.Flags&unix.MSG_TRUNC != 0 || l.names[i].Pid != 0 {
			continue
		}
		l.datagrams++
		size := min(int(m.Len), datagramLen)
		kept := len(buf)
		buf = appendMessages(buf, l.buf[i*datagramLen:i*datagramLen+size])
		if len(buf) == kept {
			l.unkept++
		}
	}
	return buf
}

// appendMessages appends the events of the netlink messages in one
// datagram.
func appendMessages(buf []Event, b []byte) []Event {
	const hdrLen = unix.SizeofNlMsghdr
	for len(b) >= hdrLen {
		n := int(binary.NativeEndian.Uint32(b[0:]))
		aligned := (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1)
		var m netlink.Message
		if n < hdrLen || aligned > len(b) || m.UnmarshalBinary(b[:aligned]) != nil {
			break
		}
		if m.Header.Type == netlink.Done {
			if e, ok := Parse(m.Data); ok {
				buf = append(buf, e)
			}
		}
		b = b[aligned:]
	}
	return buf
}

// SetDeadline makes a Receive that waits past t return; the zero time
// waits for ever. It applies to the Receive calls that start after it.
func (l *Listener) SetDeadline(t time.Time) {
	if t.IsZero() {
		l.deadline.Store(0)
	} else {
		l.deadline.Store(t.UnixNano())
	}
}

// Close unsubscribes and closes the socket; a waiting Receive returns
// ErrClosed.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		l.closed.Store(true)
		_ = l.mcast(procCnMcastIgnore)
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		_, _ = unix.Write(l.wake, one[:])
		l.mu.Lock()
		defer l.mu.Unlock()
		l.closeFDs()
	})
	return nil
}

func (l *Listener) closeFDs() {
	unix.Close(l.fd)
	unix.Close(l.wake)
}

// Parse decodes one connector message (struct cn_msg followed by struct
// proc_event) into an Event; ok is false for other messages and for the
// event kinds not kept.
func Parse(b []byte) (Event, bool) {
	if len(b) < cnMsgLen+procEventHdrLen {
		return Event{}, false
	}
	ne := binary.NativeEndian
	if ne.Uint32(b[0:]) != cnIdxProc || ne.Uint32(b[4:]) != cnValProc {
		return Event{}, false
	}
	n := int(ne.Uint16(b[16:]))
	data := b[cnMsgLen:]
	if n < procEventHdrLen || n > len(data) {
		return Event{}, false
	}
	data = data[:n]
	kind := Kind(ne.Uint32(data[0:]))
	ts := ne.Uint64(data[8:])
	ev := data[procEventHdrLen:]
	u := func(i int) int { return int(ne.Uint32(ev[4*i:])) }
	switch kind {
	case Fork:
		if len(ev) < 16 {
			return Event{}, false
		}
		return Event{Kind: Fork, ParentPID: u(1), TID: u(2), PID: u(3), Timestamp: ts}, true
	case Exec, Sid:
		if len(ev) < 8 {
			return Event{}, false
		}
		return Event{Kind: kind, TID: u(0), PID: u(1), Timestamp: ts}, true
	case Exit:
		if len(ev) < 8 {
			return Event{}, false
		}
		return Event{Kind: Exit, TID: u(0), PID: u(1), Timestamp: ts}, true
	}
	return Event{}, false
}
