package tcp

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Why not io.Copy: between two *net.TCPConn it splices through a pipe, but it takes the pipe before
// waiting for data and keeps it while blocked, so an idle proxied connection holds 6 descriptors
// (2 sockets + 2 pipes); with the 20000-descriptor limit of our nodes a naive proxy tops out at about
// 3300 idle connections. Here a direction waits for readability through RawConn.Read with a callback
// that takes a pipe from a small shared pool only when the socket is readable, splices socket->pipe->
// socket (zero copy, same throughput as io.Copy for bulk), and gives the pipe back as soon as the
// source would block. Idle connections hold just their 2 sockets.
//
// Memory: a goroutine blocked in the poller costs at least its 2 KiB stack plus ~400 B of g, so two
// goroutines per connection would already exceed 4 KiB per idle connection. So a
// direction that saw no data for Config.ParkAfter parks: it arms a one-shot registration of its
// source socket in the proxy's own epoll set (park.go) and its goroutine exits. When the socket becomes
// readable, the watcher starts a fresh goroutine for that direction. An idle connection then costs its
// sockets, their os.Files and this struct: 1.2-1.3 KB of Go heap per idle connection
// (BenchmarkIdleMemory). The stacks of the goroutines a burst of new connections ran on are freed
// when they park, and trim.go hands that memory back to the OS after the wave: with 9000 opened in
// a burst, RSS is 2.7-3.1 KiB per idle connection (HAProxy 3.2-3.3, nginx 9.5). Active connections
// keep their goroutines, so request/response traffic pays no extra syscall.

// direction moves bytes one way: src -> dst.
type direction struct {
	c           *conn
	up          bool // client->endpoint
	src, dst    *sock
	fill, flush func(fd uintptr) bool // method values, bound once: no allocation per wakeup

	bulk bool           // splicing a bulk burst (see fillFn)
	buf  *[bufSize]byte // holds d.n bytes at off, in small-read mode
	off  int
	pipe *pipe
	n    int64 // bytes in flight (buffer or pipe), or the last read result
	rerr error // from fill
	werr error // from flush

	// guarded by c.mu
	parked bool // waiting in the parker, no goroutine
	armed  bool // registered in the parker's epoll set (re-armed with EPOLL_CTL_MOD)
}

func (d *direction) init(c *conn, up bool, src, dst *sock) {
	d.c, d.up, d.src, d.dst = c, up, src, dst
	d.fill, d.flush = d.fillFn, d.flushFn
}

func (d *direction) String() string {
	if d.up {
		return "client->endpoint"
	}
	return "endpoint->client"
}

// run moves data until EOF, an error, or ParkAfter without data (then it parks and returns).
func (d *direction) run() {
	parkAfter := d.c.p.cfg.ParkAfter
	var deadline time.Time
	for {
		// The read deadline only decides when to park (real clock of the runtime poller). Moving it
		// costs a timer update, so it is pushed only when less than half of ParkAfter remains: a
		// direction parks after between ParkAfter/2 and ParkAfter without data.
		if now := time.Now(); deadline.Sub(now) < parkAfter/2 {
			deadline = now.Add(parkAfter)
			d.src.f.SetReadDeadline(deadline)
		}
		d.n, d.rerr = 0, nil
		err := d.src.raw.Read(d.fill)
		if err == nil {
			err = d.rerr
		}
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			if d.park() {
				return
			}
			continue // no descriptor for the idle watcher: keep waiting in this goroutine
		case err != nil:
			d.broken(false, err)
			return
		case d.n == 0:
			d.eof()
			return
		}
		moved := d.n
		if d.c.fl != nil {
			d.observed()
		}
		for d.n > 0 && err == nil {
			d.werr = nil
			err = d.dst.raw.Write(d.flush)
			if err == nil {
				err = d.werr
			}
		}
		d.releaseBuf()
		if err != nil {
			d.broken(true, err)
			return
		}
		d.count(moved)
	}
}

// fillFn reads what the source has. It returns false (wait for readability) only when the source
// would block, and then holds neither buffer nor pipe.
//
// Small reads (request/response traffic) go through a pooled buffer: read+write costs the same
// syscalls as splice in+out and needs no pipe, which a connection-per-request workload would
// otherwise take from and return to the pool (or create) for every request. A read that fills the
// whole buffer means a bulk transfer: the rest of that burst is spliced through a pooled pipe, zero
// copy, until the source would block again.
func (d *direction) fillFn(fd uintptr) bool {
	if !d.bulk {
		return d.readBuf(fd)
	}
	if d.pipe == nil {
		p, err := pipes.get()
		if err != nil {
			d.rerr = err
			return true
		}
		d.pipe = p
	}
	for {
		n, err := sysSplice(int(fd), d.pipe.w, d.pipe.size)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			d.releasePipe()
			d.bulk = false
			return false
		case err != nil:
			d.rerr = os.NewSyscallError("splice", err)
		}
		d.n = int64(n)
		return true
	}
}

func (d *direction) readBuf(fd uintptr) bool {
	buf := bufs.Get().(*[bufSize]byte)
	for {
		n, err := sysRead(int(fd), buf[:])
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			bufs.Put(buf)
			return false
		case err != nil:
			bufs.Put(buf)
			d.rerr = os.NewSyscallError("read", err)
			return true
		}
		if n == 0 {
			bufs.Put(buf)
			return true
		}
		d.buf, d.off, d.n = buf, 0, int64(n)
		// A captured connection stays on the copy path: spliced bytes never reach its tap.
		d.bulk = n == bufSize && !d.c.tapped()
		return true
	}
}

// observed tells the flow what the direction just read (conn.moved): the buffer's bytes, or
// none when they went into a pipe.
func (d *direction) observed() {
	var b []byte
	if d.buf != nil {
		b = d.buf[d.off : d.off+int(d.n)]
	}
	d.c.moved(d.up, b)
}

// flushFn writes the buffer or splices the pipe into the destination; false means wait for
// writability.
func (d *direction) flushFn(fd uintptr) bool {
	for d.n > 0 {
		var n int
		var err error
		if d.buf != nil {
			n, err = sysWrite(int(fd), d.buf[d.off:d.off+int(d.n)])
		} else {
			n, err = sysSplice(d.pipe.r, int(fd), int(d.n))
		}
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return false
		case err != nil:
			d.werr = os.NewSyscallError("write", err)
			return true
		}
		d.n -= int64(n)
		d.off += n
	}
	return true
}

// bufSize is the copy buffer for small reads; a read that fills it switches to splice.
const bufSize = 16 << 10

var bufs = sync.Pool{New: func() any { return new([bufSize]byte) }}

func (d *direction) releaseBuf() {
	if d.buf != nil {
		bufs.Put(d.buf)
		d.buf = nil
	}
}

func (d *direction) releasePipe() {
	d.releaseBuf()
	if d.pipe != nil {
		pipes.put(d.pipe, d.n == 0)
		d.pipe = nil
	}
}

func (d *direction) count(n int64) { d.c.count(d.up, n, d.c.p.cfg.Clock.Now().UnixNano()) }

// eof forwards a FIN: half-close the destination and let the other direction run on. The second
// direction to see FIN closes the connection.
func (d *direction) eof() {
	d.releasePipe()
	c := d.c
	if c.sawEOF(d.up) {
		if err := d.dst.closeWrite(); err != nil {
			d.broken(true, err)
			return
		}
	}
	c.eofForwarded()
	c.release()
}

// broken handles a read (onWrite=false) or write error: the side that failed is gone or reset, so
// reset the other one too. On a connection closed under us on purpose (its sockets report "use of
// closed file"), fail does nothing, so no error is built.
func (d *direction) broken(onWrite bool, err error) {
	d.releasePipe()
	d.c.legFailed(d.up, onWrite, err)
	d.c.release()
}

// park hands the idle source to the watcher and lets the goroutine go (true). If the connection
// is closing, or the watcher is gone (Shutdown), the direction ends instead (true). If the watcher
// cannot be created (out of descriptors) the direction stays in its goroutine (false): an idle
// connection then costs a goroutine, never the connection.
func (d *direction) park() bool {
	d.releasePipe()
	c := d.c
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		c.release()
		return true
	}
	pk, err := c.p.idleWatcher()
	if err != nil && !errors.Is(err, errClosed) {
		c.mu.Unlock()
		return false
	}
	if err == nil {
		err = pk.arm(d)
	}
	if err == nil {
		d.parked = true
		c.mu.Unlock()
		stackTrim.parked()
		return true
	}
	c.mu.Unlock()
	c.fail(flow.Shutdown, fmt.Errorf("%s: park idle socket: %w", d, err))
	c.release()
	return true
}

// unpark runs on the watcher when a parked source is readable (data, FIN, RST).
func (d *direction) unpark() {
	c := d.c
	c.mu.Lock()
	if !d.parked {
		c.mu.Unlock()
		return
	}
	d.parked = false
	c.mu.Unlock()
	c.p.goRun(d)
}

func (p *Proxy) goRun(d *direction) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		d.run()
	}()
}
