package healthcheck

// limits.go: the health check node ports listen on the node's addresses for load balancers, so
// anyone who reaches the node reaches them. Each port bounds what it takes: how many connections
// it serves at once (the others wait in the kernel's accept queue: no goroutine, no buffer), how
// many requests a second it answers (a token bucket; the excess gets 429 and the connection is
// closed), the size of a request's headers, how long a request or an idle connection may take,
// and it never reads a body (a probe has none; one that comes closes the connection instead of
// being drained).

import (
	"net"
	"net/http"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Limits bound one health check port (all its addresses together). Zero fields take the defaults.
type Limits struct {
	// MaxConnections is how many connections the port serves at once.
	MaxConnections int
	// RequestsPerSecond and Burst size the port's token bucket.
	RequestsPerSecond float64
	Burst             int
	// MaxHeaderBytes bounds a request's header block (net/http allows 4 KiB over it).
	MaxHeaderBytes int
	// ReadTimeout bounds reading a request, headers included; IdleTimeout a kept-alive connection
	// waiting for its next request; WriteTimeout writing the answer.
	ReadTimeout, IdleTimeout, WriteTimeout time.Duration
}

// Defaults of Limits. A load balancer probes a node's port every few seconds from a handful of
// addresses: these are orders of magnitude above that, and far below what would cost the node.
const (
	DefaultMaxConnections    = 64
	DefaultRequestsPerSecond = 100
	DefaultBurst             = 50
	DefaultMaxHeaderBytes    = 4 << 10
	DefaultReadTimeout       = 5 * time.Second
	DefaultIdleTimeout       = 30 * time.Second
	DefaultWriteTimeout      = 5 * time.Second
)

func (l Limits) withDefaults() Limits {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&l.MaxConnections, DefaultMaxConnections)
	def(&l.Burst, DefaultBurst)
	def(&l.MaxHeaderBytes, DefaultMaxHeaderBytes)
	if l.RequestsPerSecond <= 0 {
		l.RequestsPerSecond = DefaultRequestsPerSecond
	}
	defDur(&l.ReadTimeout, DefaultReadTimeout)
	defDur(&l.IdleTimeout, DefaultIdleTimeout)
	defDur(&l.WriteTimeout, DefaultWriteTimeout)
	return l
}

// server is an http.Server for h (already wrapped by handler) within l's sizes and timeouts.
func (l Limits) server(h http.Handler) *http.Server {
	return &http.Server{Handler: h, MaxHeaderBytes: l.MaxHeaderBytes, ReadHeaderTimeout: l.ReadTimeout,
		ReadTimeout: l.ReadTimeout, IdleTimeout: l.IdleTimeout, WriteTimeout: l.WriteTimeout}
}

// handler answers at most the bucket's rate and closes the connection of a request with a body.
func (l Limits) handler(h http.Handler) http.Handler {
	bucket := rate.NewLimiter(rate.Limit(l.RequestsPerSecond), l.Burst)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 || len(r.TransferEncoding) > 0 {
			w.Header().Set("Connection", "close") // not drained: the body is never read
		}
		if !bucket.Allow() {
			w.Header().Set("Connection", "close")
			http.Error(w, "too many requests", http.StatusTooManyRequests)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// connLimit is the connection slots one port's listeners share.
type connLimit struct {
	slots chan struct{}
}

func newConnLimit(n int) *connLimit { return &connLimit{slots: make(chan struct{}, n)} }

// listener wraps ln so that it accepts only while a slot is free; a connection frees its slot
// when closed.
func (c *connLimit) listener(ln net.Listener) net.Listener {
	return &limitedListener{Listener: ln, limit: c, done: make(chan struct{})}
}

type limitedListener struct {
	net.Listener
	limit     *connLimit
	done      chan struct{}
	closeOnce sync.Once
}

// Accept waits for a free slot, then for a connection. The wait ends when the listener closes.
func (l *limitedListener) Accept() (net.Conn, error) {
	select {
	case l.limit.slots <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.limit.slots
		return nil, err
	}
	return &limitedConn{Conn: c, release: func() { <-l.limit.slots }}, nil
}

func (l *limitedListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// Serve returns ln and a server for h within l (zero fields: the defaults), for an address that
// faces outside on its own (the proxy's /healthz and /livez): l.MaxConnections at once, one token
// bucket, the header size and the timeouts.
func (l Limits) Serve(ln net.Listener, h http.Handler) (net.Listener, *http.Server) {
	l = l.withDefaults()
	return newConnLimit(l.MaxConnections).listener(ln), l.server(l.handler(h))
}
