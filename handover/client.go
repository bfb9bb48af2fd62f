package handover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// ErrNoPredecessor: no process answers on the hand-over socket (no file, or a stale one left by
// a process that was killed). The caller starts as usual.
var ErrNoPredecessor = errors.New("handover: no running proxy to take over from")

// Inherited is what a successor received: the predecessor's sockets, each to be taken by whoever
// would otherwise bind the same address, and the connection on which it says it is ready.
type Inherited struct {
	conn     *net.UnixConn
	received int
	duration time.Duration

	mu    sync.Mutex
	socks map[key][]int
	names map[int]string // descriptor -> manifest name, for the report of unclaimed sockets
	taken int

	// affinity is the predecessor's affinity table, checked; affinityDropped the entries (or
	// messages) dropped on receipt, affinityWhy the first one's reason.
	affinity        []AffinityEntry
	affinityDropped int
	affinityWhy     error
}

// Receive asks the process listening on path for its listening sockets. It returns
// ErrNoPredecessor when nobody listens there; any other error (timeout, protocol, version) means
// the hand-over failed: whatever was received is closed, and the caller starts as usual. timeout
// bounds the whole exchange.
func Receive(ctx context.Context, path string, timeout time.Duration) (*Inherited, error) {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	start := time.Now()
	d := net.Dialer{Timeout: timeout}
	nc, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ECONNREFUSED) {
			return nil, fmt.Errorf("%w (%s)", ErrNoPredecessor, path)
		}
		return nil, fmt.Errorf("handover: connect %s: %w", path, err)
	}
	c := nc.(*net.UnixConn)
	if err := samePeerUser(c); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("handover from %s: %w", path, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	deadline(c, start, timeout)
	in := &Inherited{conn: c, socks: map[key][]int{}, names: map[int]string{}}
	if err := in.receive(); err != nil {
		in.Close()
		return nil, fmt.Errorf("handover from %s: %w", path, err)
	}
	in.duration = time.Since(start)
	// The exchange is over until Ready; the predecessor waits for that with its own deadline.
	deadline(c, time.Now(), 0)
	return in, nil
}

func (in *Inherited) receive() error {
	if err := send(in.conn, hello{Version: Version, Affinity: true}, nil); err != nil {
		return fmt.Errorf("send hello: %w", err)
	}
	var h header
	if _, err := receive(in.conn, &h); err != nil {
		return fmt.Errorf("read header: %w", err)
	}
	if h.Version != Version {
		return fmt.Errorf("%w: the running proxy speaks version %d, this one %d", ErrVersion, h.Version, Version)
	}
	if h.Error != "" {
		return fmt.Errorf("the running proxy refused: %.200q", h.Error)
	}
	// The header bounds what follows: a count of sockets, in as many chunks as this version cuts
	// them into (a peer cannot keep this process reading).
	if h.Sockets < 0 || h.Sockets > maxSockets || h.Chunks != len(chunks(h.Sockets)) {
		return fmt.Errorf("header announces %d sockets in %d chunks", h.Sockets, h.Chunks)
	}
	if h.Affinity < 0 || h.Affinity > maxAffinityChunks {
		return fmt.Errorf("header announces %d affinity messages (at most %d)", h.Affinity, maxAffinityChunks)
	}
	for range h.Chunks {
		var entries []Entry
		fds, err := receive(in.conn, &entries)
		if err != nil {
			return fmt.Errorf("read sockets: %w", err)
		}
		if len(fds) != len(entries) {
			closeAll(fds)
			return fmt.Errorf("read sockets: %d descriptors for %d manifest entries", len(fds), len(entries))
		}
		for i, e := range entries {
			k, err := e.check(fds[i])
			if err != nil {
				closeAll(fds[i:])
				return err
			}
			in.socks[k] = append(in.socks[k], fds[i])
			in.names[fds[i]] = e.Name
			in.received++
		}
	}
	if in.received != h.Sockets {
		return fmt.Errorf("received %d sockets, the header announced %d", in.received, h.Sockets)
	}
	if err := in.receiveAffinity(in.conn, h.Affinity); err != nil {
		return err
	}
	n := in.received
	if err := send(in.conn, reply{Adopted: &n}, nil); err != nil {
		return fmt.Errorf("confirm adoption: %w", err)
	}
	return nil
}

// Received is how many sockets came; Taken how many were taken so far.
func (in *Inherited) Received() int { return in.received }

// Taken is how many received sockets were taken.
func (in *Inherited) Taken() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.taken
}

// Duration is how long the transfer took (connect to adopted).
func (in *Inherited) Duration() time.Duration { return in.duration }

// take removes and returns the first socket under one of keys.
func (in *Inherited) take(keys ...key) (int, bool) {
	if in == nil {
		return -1, false
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, k := range keys {
		if fds := in.socks[k]; len(fds) > 0 {
			in.socks[k] = fds[1:]
			if len(fds) == 1 {
				delete(in.socks, k)
			}
			in.taken++
			return fds[0], true
		}
	}
	return -1, false
}

// TakeFD returns the inherited socket of protocol proto ("tcp" or "udp") bound to exactly ap, as
// a proxy opens it itself (one family; IPV6_V6ONLY for IPv6). The caller owns the descriptor.
// Port 0 (a kernel-chosen port) never matches. Safe on a nil *Inherited.
func (in *Inherited) TakeFD(proto string, ap netip.AddrPort) (int, bool) {
	if ap.Port() == 0 {
		return -1, false
	}
	return in.take(exactKey(proto, ap))
}

// Listener returns the inherited TCP listener that a net.Listen(network, address) would have
// opened, if there is one. Safe on a nil *Inherited.
func (in *Inherited) Listener(network, address string) (net.Listener, bool) {
	f, ok := in.file(network, address)
	if !ok {
		return nil, false
	}
	defer f.Close()
	ln, err := net.FileListener(f)
	return ln, err == nil
}

// PacketConn is Listener for UDP sockets (net.ListenPacket).
func (in *Inherited) PacketConn(network, address string) (net.PacketConn, bool) {
	f, ok := in.file(network, address)
	if !ok {
		return nil, false
	}
	defer f.Close()
	pc, err := net.FilePacketConn(f)
	return pc, err == nil
}

func (in *Inherited) file(network, address string) (*os.File, bool) {
	if in == nil {
		return nil, false
	}
	keys, err := netKeys(network, address)
	if err != nil {
		return nil, false
	}
	fd, ok := in.take(keys...)
	if !ok {
		return nil, false
	}
	return os.NewFile(uintptr(fd), address), true
}

// Ready tells the predecessor that this process serves now, so it stops accepting and finishes
// its connections, and closes the sockets nobody took (ports the predecessor had that this
// process does not serve). It returns their names.
func (in *Inherited) Ready() (unclaimed []string, err error) {
	unclaimed = in.closeUnclaimed()
	deadline(in.conn, time.Now(), DefaultTimeout)
	err = send(in.conn, reply{Ready: true}, nil)
	_ = in.conn.Close()
	if err != nil {
		return unclaimed, fmt.Errorf("handover: tell the running proxy this one is ready: %w", err)
	}
	return unclaimed, nil
}

// Close gives up: closes every socket not taken and the connection. The predecessor sees the
// connection close before ready and goes on serving.
func (in *Inherited) Close() {
	in.closeUnclaimed()
	_ = in.conn.Close()
}

func (in *Inherited) closeUnclaimed() []string {
	in.mu.Lock()
	defer in.mu.Unlock()
	var names []string
	for k, fds := range in.socks {
		for _, fd := range fds {
			names = append(names, in.names[fd])
		}
		closeAll(fds)
		delete(in.socks, k)
	}
	slices.Sort(names)
	return names
}
