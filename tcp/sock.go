package tcp

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// sock is one leg of a proxied connection: a non-blocking TCP socket in the Go runtime poller,
// reached through os.File's RawConn. The proxy creates it itself (accept4, or socket+connect)
// instead of through package net, which per connection does work a proxy has no use for:
//   - a dial with a timeout wraps the context in a timer and starts a goroutine to watch it, parses
//     the address string, sets the options one by one after connecting, and asks the kernel for
//     both addresses (getsockname, getpeername): 1870 B in 33 allocations per dial and close,
//     against about 580 B in 13 here (BenchmarkDial);
//   - accept asks for the local address and sets TCP_NODELAY, which the accepted socket inherits
//     from the listener anyway (set once in Listen, like keepalive).
//
// The splice code only ever needed RawConn, a read deadline, shutdown, linger and close.
type sock struct {
	f   *os.File
	raw syscall.RawConn
}

// newSock takes ownership of fd, a non-blocking socket, and registers it in the runtime poller.
func newSock(fd int) *sock {
	f := os.NewFile(uintptr(fd), "tcp")
	raw, _ := f.SyscallConn() // fails only for a nil *os.File
	return &sock{f: f, raw: raw}
}

// closeWrite sends FIN: the peer reads EOF, the other direction keeps flowing.
func (s *sock) closeWrite() error {
	var serr error
	err := s.raw.Control(func(fd uintptr) { serr = sysShutdownWrite(int(fd)) })
	if err != nil {
		return err
	}
	return os.NewSyscallError("shutdown", serr)
}

// resetOnClose makes close send RST and drop unsent data (SO_LINGER with a zero timeout).
func (s *sock) resetOnClose() {
	_ = s.raw.Control(func(fd uintptr) {
		_ = unix.SetsockoptLinger(int(fd), unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	})
}

func (s *sock) close() error { return s.f.Close() }

// errDialAborted: the connection was closed (Shutdown, idle timeout) while its dial was waiting.
var errDialAborted = errors.New("dial aborted: connection closed")

// dialer is told about the socket a dial is waiting on (see conn.startDial and endDial).
type dialer interface {
	startDial(*sock) bool
	endDial()
}

// dialSock connects a new socket to ep, giving up at deadline. The socket gets TCP_NODELAY and,
// when keepAlive > 0, keepalive before the SYN leaves. If src is valid (a transparent dial), the
// socket connects from src (bindSource); a failure to take it wraps errSourceTaken, as does
// EADDRNOTAVAIL from the connect, which then says that src already has a connection to ep.
// d.startDial is called with the socket once the connect is under way, so that the dial can be
// aborted by closing it (if it returns false, the dial is abandoned at once), and d.endDial when
// the wait is over.
func dialSock(ep, src netip.AddrPort, deadline time.Time, keepAlive time.Duration, d dialer) (*sock, error) {
	fd, err := unix.Socket(sockopt.Family(ep.Addr()), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := setLegOptions(fd, keepAlive); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if src.IsValid() {
		if err := bindSource(fd, src); err != nil {
			unix.Close(fd)
			return nil, err
		}
	}
	switch err := sysConnect(fd, ep); err {
	case nil, unix.EINPROGRESS, unix.EINTR: // EINTR: the connect goes on in the background
	default:
		unix.Close(fd)
		if err == unix.EADDRNOTAVAIL && src.IsValid() {
			return nil, sourceError("connect from "+src.String(), err)
		}
		return nil, os.NewSyscallError("connect", err)
	}
	s := newSock(fd)
	if !d.startDial(s) {
		s.close()
		return nil, errDialAborted
	}
	err = s.awaitConnect(deadline)
	d.endDial()
	if err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// awaitConnect waits until the connect started on s completes, fails, or deadline passes.
//
// The callback runs at once and again whenever the socket turns writable. A zero-length send is
// the cheapest way to ask a connecting socket for its state in one syscall: EAGAIN while the
// handshake runs (SYN_SENT), 0 once established, and the connect's error (ECONNREFUSED,
// ETIMEDOUT, EHOSTUNREACH...) if it failed, which also clears it like SO_ERROR would.
//
// The deadline is armed only when that first answer is EAGAIN. To an endpoint on this node (or
// behind a veth) the handshake has usually completed by the time connect returns: the kernel runs
// the endpoint's side of it inline, and the SYN-ACK is processed when connect releases the socket.
// Arming and clearing a timer for such a dial was wasted, and its call chain outgrew the dialing
// goroutine's first stack: the stack copy cost 3.5% of the proxy's CPU per connection (perf,
// bench/tcp conn test). The deadline is set before the callback returns false, so before the wait.
func (s *sock) awaitConnect(deadline time.Time) error {
	w := &connectWait{s: s, deadline: deadline} // one allocation for the callback's state
	err := s.raw.Write(w.probe)
	switch {
	case err != nil:
		return err
	case w.cerr != nil:
		return os.NewSyscallError("connect", w.cerr)
	case w.armed:
		return s.f.SetWriteDeadline(time.Time{})
	}
	return nil
}

// connectWait is awaitConnect's callback and what it found.
type connectWait struct {
	s        *sock
	deadline time.Time
	armed    bool  // the write deadline is set
	cerr     error // from the probe
}

func (w *connectWait) probe(fd uintptr) bool {
	for {
		w.cerr = sysSendEmpty(int(fd))
		switch w.cerr {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			if !w.armed {
				// It fails only if the socket was closed (an aborted dial), and then so does
				// the wait.
				w.armed = true
				_ = w.s.f.SetWriteDeadline(w.deadline)
			}
			return false
		}
		return true
	}
}

// listenSock opens a listening socket on addr as package net would (SO_REUSEADDR, IPV6_V6ONLY for
// IPv6, the largest backlog the kernel allows), plus IP_FREEBIND if asked and the options every
// accepted socket inherits (setLegOptions). It is an os.File, not a net.TCPListener, because the
// accept loop calls accept4 itself through RawConn.Read, which a listener's RawConn refuses.
// A blocking socket (an engine that accepts through its own rings) stays out of the runtime
// poller: os.NewFile registers only non-blocking descriptors.
func listenSock(addr netip.AddrPort, freeBind bool, keepAlive time.Duration, blocking bool) (*sock, netip.AddrPort, error) {
	domain := sockopt.Family(addr.Addr())
	typ := unix.SOCK_STREAM | unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC
	if blocking {
		typ &^= unix.SOCK_NONBLOCK
	}
	fd, err := unix.Socket(domain, typ, 0)
	if err != nil {
		return nil, netip.AddrPort{}, os.NewSyscallError("socket", err)
	}
	err = func() error {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			return os.NewSyscallError("setsockopt SO_REUSEADDR", err)
		}
		if domain == unix.AF_INET6 {
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); err != nil {
				return os.NewSyscallError("setsockopt IPV6_V6ONLY", err)
			}
		}
		if freeBind {
			if err := sockopt.SetFreeBind(fd, addr.Addr()); err != nil {
				return err
			}
		}
		if err := setLegOptions(fd, keepAlive); err != nil {
			return err
		}
		if err := unix.Bind(fd, sockopt.ToSockaddr(addr)); err != nil {
			return os.NewSyscallError("bind", err)
		}
		// The kernel caps the backlog at net.core.somaxconn.
		return os.NewSyscallError("listen", unix.Listen(fd, 65535))
	}()
	// A port asked for is the port bound, as getsockname would say it (no zone, unmapped): a
	// restart reopens 10,000 known ports, and the call was 8% of each listen.
	bound := netip.AddrPortFrom(addr.Addr().Unmap().WithZone(""), addr.Port())
	if err == nil && addr.Port() == 0 {
		var sa unix.Sockaddr
		sa, err = unix.Getsockname(fd)
		bound, err = sockopt.FromSockaddr(sa), os.NewSyscallError("getsockname", err)
	}
	if err != nil {
		unix.Close(fd)
		return nil, netip.AddrPort{}, err
	}
	return newSock(fd), bound, nil
}

// adoptSock takes a listening socket another process bound (a hand-over) and sets on it what
// listenSock would, for accepted sockets to inherit: the predecessor may be another version.
//
// O_NONBLOCK belongs to the open file, which the predecessor shares until it exits. The epoll
// engine needs it set. The io_uring engine (blocking) accepts either way, so it leaves it as it
// is: clearing it under a predecessor on the epoll engine would make that one's accept4, a raw
// system call, block its thread and P until a connection comes, and a garbage collection would
// wait for it. (Left non-blocking, the socket is in the runtime poller, which then wakes for
// connections it has no reader for: a cost, not a fault.)
func adoptSock(fd int, keepAlive time.Duration, blocking bool) (*sock, netip.AddrPort, error) {
	var err error
	if !blocking {
		err = os.NewSyscallError("set non-blocking", unix.SetNonblock(fd, true))
	}
	if err == nil {
		err = setLegOptions(fd, keepAlive)
	}
	var bound unix.Sockaddr
	if err == nil {
		bound, err = unix.Getsockname(fd)
		err = os.NewSyscallError("getsockname", err)
	}
	if err != nil {
		unix.Close(fd)
		return nil, netip.AddrPort{}, fmt.Errorf("adopt a handed-over socket: %w", err)
	}
	return newSock(fd), sockopt.FromSockaddr(bound), nil
}

// setLegOptions sets what both legs of a connection get; the accepted leg inherits the same from
// the listening socket (see Proxy.Listen).
func setLegOptions(fd int, keepAlive time.Duration) error {
	if err := sysSetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		return os.NewSyscallError("setsockopt TCP_NODELAY", err)
	}
	if keepAlive > 0 {
		return setKeepAlive(fd, keepAlive)
	}
	return nil
}

// setKeepAlive turns TCP keepalive on with idle time and probe interval d (whole seconds, at least
// one); the probe count is the kernel's (net.ipv4.tcp_keepalive_probes, 9 by default). Set on the
// listening socket, it is inherited by every accepted socket.
func setKeepAlive(fd int, d time.Duration) error {
	secs := max(int(d/time.Second), 1)
	for _, o := range [...]struct {
		level, opt, v int
		name          string
	}{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1, "SO_KEEPALIVE"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, secs, "TCP_KEEPIDLE"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, secs, "TCP_KEEPINTVL"},
	} {
		if err := sysSetsockoptInt(fd, o.level, o.opt, o.v); err != nil {
			return os.NewSyscallError("setsockopt "+o.name, err)
		}
	}
	return nil
}

// acceptFn returns the accept callback for the listener's RawConn.Read: it sets *fd and *peer, or
// *err, and asks to wait (false) only when no connection is queued.
func acceptFn(fd *int, peer *netip.AddrPort, err *error) func(uintptr) bool {
	return func(lfd uintptr) bool {
		for {
			*fd, *peer, *err = sysAccept(int(lfd))
			switch *err {
			case unix.EINTR:
				continue
			case unix.EAGAIN:
				return false
			}
			return true
		}
	}
}
