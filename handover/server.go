package handover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
	"k8s.io/utils/clock"
)

// Defaults for the zero values of ServerConfig and ClientConfig.
const (
	// DefaultTimeout bounds each step of a hand-over (hello, transfer, adopted).
	DefaultTimeout = 5 * time.Second
	// DefaultReadyTimeout bounds how long the old process waits for its successor to be ready
	// (its first sync, at scale a few seconds after the API's initial list).
	DefaultReadyTimeout = 2 * time.Minute
)

// ServerConfig configures the running process's side.
type ServerConfig struct {
	// Path is the Unix socket's path (--handover-socket).
	Path string
	// Timeout bounds each step before ready; 0 means DefaultTimeout.
	Timeout time.Duration
	// ReadyTimeout bounds the wait for ready; 0 means DefaultReadyTimeout.
	ReadyTimeout time.Duration
	// StopWait is how long Run, stopped (SIGTERM) while a successor that adopted the sockets
	// is not ready yet, still waits for its ready before it calls handedOff; the process
	// serves meanwhile. A successor that starts slowly (a busy node; it starts at lowered
	// priority) would otherwise find the kernel's queues without a process that accepts. 0:
	// no wait, handedOff at once.
	StopWait time.Duration
	// Collect lists the sockets to hand over; nil means Collect (every listening socket).
	Collect func() ([]socket, error)
	// Affinity, if set, lists the ClientIP affinity table, sent to a successor that asks for it
	// (affinity.go).
	Affinity func() []AffinityEntry
	Logger   logrus.FieldLogger
	Clock    clock.PassiveClock
	// Pending, if set, is called with true once a successor has adopted the sockets (from then on
	// both processes accept on them, the health listener included, until the successor is
	// ready), and with false if that successor fails before it is ready. A process answers its
	// readiness probe "not ready" meanwhile: the kubelet probes the old and the new pod on the
	// same host port, and either process may accept the probe.
	Pending func(bool)
}

// Server answers a successor's hand-over request.
type Server struct {
	cfg ServerConfig
	ln  *net.UnixListener
	ino uint64 // the socket file's inode, to remove it at exit only while it is still ours
}

// NewServer returns a server for cfg. It opens nothing: Listen does.
func NewServer(cfg ServerConfig) *Server {
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = DefaultReadyTimeout
	}
	if cfg.Collect == nil {
		cfg.Collect = Collect
	}
	if cfg.Logger == nil {
		cfg.Logger = logrus.StandardLogger()
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	return &Server{cfg: cfg}
}

// Listen creates the socket file, replacing any that is there (a predecessor's, which has handed
// over or is gone) atomically: it binds a temporary name in the same directory and renames it over
// the path, so a successor never finds the path missing or half made.
func (s *Server) Listen() error {
	dir := filepath.Dir(s.cfg.Path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("handover socket %s: %w", s.cfg.Path, err)
	}
	if err := checkDir(dir); err != nil {
		return fmt.Errorf("handover socket %s: %w", s.cfg.Path, err)
	}
	tmp := filepath.Join(dir, "."+filepath.Base(s.cfg.Path)+"."+strconv.Itoa(os.Getpid()))
	_ = os.Remove(tmp)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("handover socket %s: %w", s.cfg.Path, err)
	}
	ln.SetUnlinkOnClose(false)
	err = os.Chmod(tmp, 0o600)
	if err == nil {
		err = os.Rename(tmp, s.cfg.Path)
	}
	var st os.FileInfo
	if err == nil {
		st, err = os.Stat(s.cfg.Path)
	}
	if err != nil {
		_ = ln.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("handover socket %s: %w", s.cfg.Path, err)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		s.ino = sys.Ino
	}
	s.ln = ln
	return nil
}

// Run answers hand-over requests until ctx is done or one completes: then it calls handedOff (the
// successor is ready; stop accepting and finish what is established) and returns. A request that
// fails leaves this process serving as before, and the next one is answered. Run closes the
// listener and removes the socket file, unless a successor has replaced it. Call Listen first.
func (s *Server) Run(ctx context.Context, handedOff func()) {
	defer s.close()
	stop := context.AfterFunc(ctx, func() { _ = s.ln.Close() })
	defer stop()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if ctx.Err() == nil {
				s.cfg.Logger.WithError(err).Error("Hand-over socket failed; a successor will start without the sockets")
			}
			return
		}
		var waiting atomic.Bool // a successor adopted the sockets: a SIGTERM waits StopWait for its ready
		stopConn := context.AfterFunc(ctx, func() {
			if s.cfg.StopWait > 0 && waiting.Load() {
				_ = c.SetReadDeadline(time.Now().Add(s.cfg.StopWait))
				return
			}
			_ = c.Close()
		})
		adopted, err := s.serve(c, &waiting)
		stopConn()
		_ = c.Close()
		if err == nil {
			handedOff()
			return
		}
		if ctx.Err() != nil {
			// Stopping anyway: the successor serves the sockets it took. Once it has adopted
			// them this process goes as after a hand-over, finishing its connections instead of
			// resetting them: its ready may even be on the way (a SIGTERM sent as soon as the
			// successor says it took over races with reading it).
			if adopted {
				s.cfg.Logger.Info("Stopping while a successor that holds the sockets gets ready: finishing established connections")
				handedOff()
			}
			return
		}
		s.cfg.Logger.WithError(err).Warn("Hand-over to a successor failed; still serving")
	}
}

// serve runs one hand-over on c; nil means the successor is ready. adopted reports that the
// successor confirmed it holds the sockets, whatever came after.
func (s *Server) serve(c *net.UnixConn, waiting *atomic.Bool) (adopted bool, err error) {
	start := s.cfg.Clock.Now()
	h, err := greet(c, s.cfg.Timeout)
	if err != nil {
		return false, err
	}
	socks, err := s.cfg.Collect()
	if err != nil {
		_ = send(c, header{Version: Version, Error: err.Error()}, nil)
		return false, err
	}
	defer func() {
		for _, sk := range socks {
			if sk.fd >= 0 {
				_ = closeFD(sk.fd)
			}
		}
	}()
	affinity, sentAffinity := s.affinityMessages(h)
	if err := sendSockets(c, socks, affinity); err != nil {
		return false, err
	}
	var r reply
	if _, err := receive(c, &r); err != nil || r.Adopted == nil {
		return false, fmt.Errorf("handover: successor did not confirm adoption: %v", orNot(err, r))
	}
	s.cfg.Logger.WithFields(logrus.Fields{"sockets": len(socks), "adopted": *r.Adopted, "affinityEntries": sentAffinity,
		"duration": s.cfg.Clock.Since(start).String()}).Info("Handed the listening sockets to a successor; serving until it is ready")
	return true, s.awaitReady(c, start, waiting)
}

// greet checks that the successor runs as this process's user, and reads its hello, refusing
// (and telling it) a protocol version other than this one.
func greet(c *net.UnixConn, timeout time.Duration) (hello, error) {
	var h hello
	if err := samePeerUser(c); err != nil {
		return h, err
	}
	deadline(c, time.Now(), timeout)
	if _, err := receive(c, &h); err != nil {
		return h, fmt.Errorf("handover: read hello: %w", err)
	}
	if h.Version != Version {
		err := fmt.Errorf("%w: the successor speaks version %d, this process %d", ErrVersion, h.Version, Version)
		_ = send(c, header{Version: Version, Error: err.Error()}, nil)
		return h, err
	}
	return h, nil
}

// affinityMessages is the affinity table as messages, when the successor asks for it, and how
// many entries they hold: at most maxAffinityEntries, the least recently used left behind.
func (s *Server) affinityMessages(h hello) (msgs [][]byte, sent int) {
	if !h.Affinity || s.cfg.Affinity == nil {
		return nil, 0
	}
	entries := s.cfg.Affinity()
	msgs, left, err := encodeAffinity(entries, maxAffinityEntries)
	if err != nil { // entries of this process's own table: not expected
		s.cfg.Logger.WithError(err).Warn("Cannot encode the affinity table; handing over without it")
		msgs = nil
	} else {
		sent = len(entries) - left
	}
	if left > 0 {
		s.cfg.Logger.WithFields(logrus.Fields{"entries": len(entries), "left": left}).Warn("Handing over part of the affinity table: over its bound, the least recently used stay behind")
	}
	return msgs, sent
}

// sendSockets sends the header, the sockets in chunks (their entries with their descriptors) and
// the affinity messages.
func sendSockets(c *net.UnixConn, socks []socket, affinity [][]byte) error {
	parts := chunks(len(socks))
	if err := send(c, header{Version: Version, Sockets: len(socks), Chunks: len(parts), Affinity: len(affinity)}, nil); err != nil {
		return fmt.Errorf("handover: send header: %w", err)
	}
	for _, p := range parts {
		entries := make([]Entry, 0, p[1]-p[0])
		fds := make([]int, 0, p[1]-p[0])
		for i := p[0]; i < p[1]; i++ {
			if err := socks[i].take(); err != nil {
				return err // the successor's read fails; this process serves on
			}
			entries = append(entries, socks[i].Entry)
			fds = append(fds, socks[i].fd)
		}
		if err := send(c, entries, fds); err != nil {
			return fmt.Errorf("handover: send sockets: %w", err)
		}
		// The message in flight holds the sockets now. Keeping the duplicates until the
		// successor is ready doubled this process's descriptors for the successor's whole
		// start: at 10,000 service ports under a 20,000 limit, accept failed with EMFILE and
		// connections waited in the queue for seconds.
		for i := p[0]; i < p[1]; i++ {
			_ = closeFD(socks[i].fd)
			socks[i].fd = -1
		}
	}
	for _, msg := range affinity {
		if _, _, err := c.WriteMsgUnix(msg, nil, nil); err != nil {
			return fmt.Errorf("handover: send affinity: %w", err)
		}
	}
	return nil
}

// awaitReady waits, at most ReadyTimeout, for the successor that adopted the sockets to say it
// is ready; Pending is true meanwhile, and again false if it never does.
func (s *Server) awaitReady(c *net.UnixConn, start time.Time, waiting *atomic.Bool) error {
	s.pending(true)
	deadline(c, time.Now(), s.cfg.ReadyTimeout)
	waiting.Store(true) // after the deadline above, which would undo a SIGTERM's shorter one
	var ready reply     // a message of its own: the adoption's fields must not count as ready
	if _, err := receive(c, &ready); err != nil || !ready.Ready {
		s.pending(false)
		return fmt.Errorf("handover: successor did not become ready (gone, or not within %v): %v", s.cfg.ReadyTimeout, orNot(err, ready))
	}
	s.cfg.Logger.WithField("duration", s.cfg.Clock.Since(start).String()).
		Info("Successor is ready: no longer accepting; finishing established connections")
	return nil
}

func (s *Server) pending(p bool) {
	if s.cfg.Pending != nil {
		s.cfg.Pending(p)
	}
}

func orNot(err error, r reply) any {
	if err != nil {
		return err
	}
	return fmt.Sprintf("unexpected reply %+v", r)
}

// close closes the listener and removes the socket file if it is still the one Listen made.
func (s *Server) close() {
	_ = s.ln.Close()
	st, err := os.Stat(s.cfg.Path)
	if err != nil {
		return
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && sys.Ino == s.ino {
		_ = os.Remove(s.cfg.Path)
	}
}

func closeFD(fd int) error { return syscall.Close(fd) }

// samePeerUser refuses a peer that runs as another user: the socket file is the owner's only
// (0600), and the sockets handed over are the node's service ports. Both sides check: the
// predecessor whom it gives its sockets to, the successor whose sockets it takes (a process of
// another user that got to the path first would otherwise feed it listeners it keeps a copy of).
// The kernel records the credentials at connect (the successor) and at listen (the predecessor).
func samePeerUser(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return fmt.Errorf("handover: peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return fmt.Errorf("handover: peer credentials: %w", err)
	}
	if cerr != nil {
		return fmt.Errorf("handover: peer credentials: %w", cerr)
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("%w: the peer runs as uid %d (pid %d), this process as uid %d", ErrPeerUser, cred.Uid, cred.Pid, os.Geteuid())
	}
	return nil
}

// ErrPeerUser: the process at the other end of the hand-over socket runs as another user.
var ErrPeerUser = errors.New("handover: refusing a peer of another user")

// checkDir refuses to put the socket in a directory that another user could write to: they could
// rename their own socket over the path (to be asked for, or handed, the sockets) or swap the
// temporary name for a symlink between bind and chmod. The directory must belong to this user or
// root and be writable by no one else, unless it is sticky (like /tmp, where others can add
// names but not replace ours).
func checkDir(dir string) error {
	st, err := os.Stat(dir) // following symlinks: /var/run is one to /run on most systems
	if err != nil {
		return err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	if int(sys.Uid) != os.Geteuid() && sys.Uid != 0 {
		return fmt.Errorf("%w: directory %s belongs to uid %d", ErrUnsafeDir, dir, sys.Uid)
	}
	if st.Mode().Perm()&0o022 != 0 && st.Mode()&os.ModeSticky == 0 {
		return fmt.Errorf("%w: directory %s is writable by group or others (mode %v)", ErrUnsafeDir, dir, st.Mode().Perm())
	}
	return nil
}

// ErrUnsafeDir: the socket's directory is writable by another user.
var ErrUnsafeDir = errors.New("handover: unsafe socket directory")
