// Package procevents receives the kernel's process events (the proc
// connector: NETLINK_CONNECTOR, group CN_IDX_PROC) as they happen: every
// fork, exec, setsid and exit on the node.
//
// The netlink socket, its options and its subscription come from
// github.com/mdlayher/netlink. Events are read here, through the socket's
// syscall.RawConn: the connector sends each event as one datagram, and
// mdlayher/netlink reads one datagram per call after peeking at its size
// (two system calls and an allocation per event), which under a fork storm
// cost a core. Listener.Receive takes up to receiveBatch datagrams in one
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
	conn *netlink.Conn
	rc   syscall.RawConn
	// The recvmmsg(2) vector, its buffers and the senders' addresses,
	// allocated once.
	msgs  []unix.Mmsghdr
	iovs  []unix.Iovec
	names []unix.RawSockaddrNetlink
	buf   []byte
}

// Listen subscribes to the process events. It fails, wrapping
// ErrUnavailable, where the connector cannot be used: without
// CAP_NET_ADMIN, in a network namespace other than the initial one (the
// connector only speaks to that one: the subscription succeeds there and
// nothing ever arrives, which Listen cannot tell), or on a kernel without
// CONFIG_PROC_EVENTS.
func Listen() (*Listener, error) {
	conn, err := netlink.Dial(unix.NETLINK_CONNECTOR, &netlink.Config{Groups: cnIdxProc})
	if err != nil {
		return nil, fmt.Errorf("%w: opening the connector's socket: %w", ErrUnavailable, err)
	}
	rc, err := conn.SyscallConn()
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: the connector's socket: %w", ErrUnavailable, err)
	}
	l := &Listener{
		conn:  conn,
		rc:    rc,
		msgs:  make([]unix.Mmsghdr, ReceiveBatch),
		iovs:  make([]unix.Iovec, ReceiveBatch),
		names: make([]unix.RawSockaddrNetlink, ReceiveBatch),
		buf:   make([]byte, ReceiveBatch*datagramLen),
	}
	for i := range l.msgs {
		l.iovs[i].Base = &l.buf[i*datagramLen]
		l.iovs[i].SetLen(datagramLen)
		l.msgs[i].Hdr.Iov = &l.iovs[i]
		l.msgs[i].Hdr.SetIovlen(1)
		l.msgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&l.names[i]))
	}
	l.growBuffer()
	if err := l.mcast(procCnMcastListen); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: subscribing: %w", ErrUnavailable, err)
	}
	return l, nil
}

// growBuffer raises the receive buffer, past rmem_max where the process
// may (SO_RCVBUFFORCE needs CAP_NET_ADMIN, which the connector needs too).
func (l *Listener) growBuffer() {
	rc, err := l.conn.SyscallConn()
	if err == nil {
		var serr error
		err = rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, readBuffer)
		})
		if err == nil && serr == nil {
			return
		}
	}
	_ = l.conn.SetReadBuffer(readBuffer)
}

// mcast sends PROC_CN_MCAST_LISTEN or _IGNORE.
func (l *Listener) mcast(op uint32) error {
	b := make([]byte, cnMsgLen+4)
	binary.NativeEndian.PutUint32(b[0:], cnIdxProc)
	binary.NativeEndian.PutUint32(b[4:], cnValProc)
	binary.NativeEndian.PutUint16(b[16:], 4)
	binary.NativeEndian.PutUint32(b[20:], op)
	_, err := l.conn.Send(netlink.Message{
		Header: netlink.Header{Type: netlink.Done, PID: uint32(os.Getpid())},
		Data:   b,
	})
	return err
}

// Receive blocks until events arrive and appends them to buf: those of up
// to ReceiveBatch datagrams, read in one system call. It returns ErrLost
// when the kernel dropped some since the last call; the listener stays
// usable. It returns os.ErrDeadlineExceeded (wrapped) once the deadline
// set by SetDeadline passed. Receive must not be called concurrently.
func (l *Listener) Receive(buf []Event) ([]Event, error) {
	n, err := l.recvmmsg()
	if err != nil {
		if errors.Is(err, unix.ENOBUFS) {
			return buf, ErrLost
		}
		return buf, err
	}
	for i := range n {
		m := &l.msgs[i]
		// Only the kernel (port 0) speaks for the connector; a truncated
		// datagram is not an event.
		if m.Hdr.Flags&unix.MSG_TRUNC != 0 || l.names[i].Pid != 0 {
			continue
		}
		size := min(int(m.Len), datagramLen)
		buf = appendMessages(buf, l.buf[i*datagramLen:i*datagramLen+size])
	}
	return buf, nil
}

// recvmmsg reads up to ReceiveBatch datagrams, waiting (in the runtime's
// poller, as any Go socket read) until one is there.
func (l *Listener) recvmmsg() (int, error) {
	for i := range l.msgs {
		l.msgs[i].Hdr.Namelen = unix.SizeofSockaddrNetlink
		l.msgs[i].Hdr.Flags = 0
		l.msgs[i].Len = 0
	}
	var n int
	var errno syscall.Errno
	err := l.rc.Read(func(fd uintptr) bool {
		for {
			// MSG_DONTWAIT: the call never blocks (the poller waits), so
			// the runtime need not hand this thread's work to another.
			r, _, e := unix.RawSyscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&l.msgs[0])),
				uintptr(len(l.msgs)), unix.MSG_DONTWAIT, 0, 0)
			if e == unix.EINTR {
				continue
			}
			n, errno = int(r), e
			return e != unix.EAGAIN
		}
	})
	runtime.KeepAlive(l)
	if err != nil {
		return 0, err
	}
	if errno != 0 {
		return 0, os.NewSyscallError("recvmmsg", errno)
	}
	return n, nil
}

// appendMessages appends the events of the netlink messages in one
// datagram.
func appendMessages(buf []Event, b []byte) []Event {
	const hdrLen = unix.SizeofNlMsghdr
	for len(b) >= hdrLen {
		n := int(binary.NativeEndian.Uint32(b[0:]))
		if n < hdrLen || n > len(b) {
			break
		}
		if e, ok := Parse(b[hdrLen:n]); ok {
			buf = append(buf, e)
		}
		n = (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1)
		if n >= len(b) {
			break
		}
		b = b[n:]
	}
	return buf
}

// SetDeadline makes a Receive waiting past t return; the zero time waits
// for ever.
func (l *Listener) SetDeadline(t time.Time) error {
	return l.conn.SetReadDeadline(t)
}

// Close unsubscribes and closes the socket; a blocked Receive returns.
func (l *Listener) Close() error {
	_ = l.mcast(procCnMcastIgnore)
	return l.conn.Close()
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
