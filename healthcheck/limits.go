package healthcheck

// limits.go: the health check node ports listen on the node's addresses for load balancers, so
// anyone who reaches the node reaches them. Each port bounds what it takes: how many connections
// it serves at once (the others wait in the kernel's accept queue: no goroutine, no buffer), how
// many requests a second it answers (a token bucket; the excess gets 429 and the connection is
// closed), the size of a request's headers, how long a request or an idle connection may take,
// and it never reads a body (a probe has none; one that comes closes the connection instead of
// being drained).
//
// One client must not spend the port's share for everyone: a load balancer whose probes get 429
// or wait behind another client's connections marks the node down. So each client address also
// has its own token bucket and its own few connection slots (clients.go), checked before the
// port's; the port's bucket and slots stay as the cap on a flood from many addresses.

import (
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/utils/clock"
)

// Limits bound one health check port (all its addresses together). Zero fields take the defaults.
type Limits struct {
	// MaxConnections is how many connections the port serves at once.
	MaxConnections int
	// RequestsPerSecond and Burst size the port's token bucket.
	RequestsPerSecond float64
	Burst             int
	// ClientRequestsPerSecond and ClientBurst size each client address's token bucket, and
	// ClientConnections bounds the connections one address holds at once (a connection beyond
	// it is closed at once). MaxClients bounds how many addresses the port remembers: beyond it
	// the least recently seen address without an open connection is forgotten.
	ClientRequestsPerSecond float64
	ClientBurst             int
	ClientConnections       int
	MaxClients              int
	// MaxHeaderBytes bounds a request's header block (net/http allows 4 KiB over it).
	MaxHeaderBytes int
	// ReadTimeout bounds reading a request, headers included; IdleTimeout a kept-alive connection
	// waiting for its next request; WriteTimeout writing the answer.
	ReadTimeout, IdleTimeout, WriteTimeout time.Duration
	// Clock refills the token buckets; nil is the real clock.
	Clock clock.PassiveClock
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

	// Per client: a probe every second is already ten times a load balancer's usual rate.
	DefaultClientRequestsPerSecond = 10
	DefaultClientBurst             = 20
	DefaultClientConnections       = 8
	// 256 addresses, about 50 KiB at most per port; an address comes back with a full bucket.
	DefaultMaxClients = 256
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
	if l.ClientRequestsPerSecond <= 0 {
		l.ClientRequestsPerSecond = DefaultClientRequestsPerSecond
	}
	def(&l.ClientBurst, DefaultClientBurst)
	def(&l.ClientConnections, DefaultClientConnections)
	def(&l.MaxClients, DefaultMaxClients)
	// Entries with an open connection are never forgotten, and there are at most MaxConnections
	// of them: room for one more keeps every client accounted for.
	l.MaxClients = max(l.MaxClients, l.MaxConnections+1)
	if l.Clock == nil {
		l.Clock = clock.RealClock{}
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

// portLimit is what one port's listeners and servers share: the connection slots, the port's
// token bucket and the per-client table.
type portLimit struct {
	slots   chan struct{}
	bucket  *rate.Limiter
	clients *clients
	clock   clock.PassiveClock
}

// port is the shared state of one port within l (l has its defaults).
func (l Limits) port() *portLimit {
	return &portLimit{
		slots:   make(chan struct{}, l.MaxConnections),
		bucket:  rate.NewLimiter(rate.Limit(l.RequestsPerSecond), l.Burst),
		clients: newClients(l.MaxClients, rate.Limit(l.ClientRequestsPerSecond), l.ClientBurst, l.ClientConnections),
		clock:   l.Clock,
	}
}

// handler answers at most the client's and the port's bucket rate and closes the connection of
// a request with a body. The client's bucket comes first, so a client over its rate spends
// nothing of the port's.
func (p *portLimit) handler(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 || len(r.TransferEncoding) > 0 {
			w.Header().Set("Connection", "close") // not drained: the body is never read
		}
		now := p.clock.Now()
		if !p.clients.allow(remoteAddr(r.RemoteAddr), now) || !p.bucket.AllowN(now, 1) {
			w.Header().Set("Connection", "close")
			http.Error(w, "too many requests", http.StatusTooManyRequests)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// remoteAddr is the client address of a request's or a connection's remote address; the zero
// Addr (one shared entry) for one that does not parse, which net/http's never is.
func remoteAddr(s string) netip.Addr {
	ap, _ := netip.ParseAddrPort(s)
	return ap.Addr().Unmap()
}

// listener wraps ln so that it accepts only while a slot is free; a connection frees its slot
// when closed.
func (p *portLimit) listener(ln net.Listener) net.Listener {
	return &limitedListener{Listener: ln, limit: p, done: make(chan struct{})}
}

type limitedListener struct {
	net.Listener
	limit     *portLimit
	done      chan struct{}
	closeOnce sync.Once
}

// Accept waits for a free slot, then for a connection. A connection from a client that holds
// its share of connections already is closed at once and the next one awaited, so one client
// cannot take every slot and leave a load balancer's probes in the accept queue. The wait ends
// when the listener closes.
func (l *limitedListener) Accept() (net.Conn, error) {
	select {
	case l.limit.slots <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			<-l.limit.slots
			return nil, err
		}
		client := remoteAddr(c.RemoteAddr().String())
		if !l.limit.clients.open(client) {
			_ = c.Close()
			continue
		}
		return &limitedConn{Conn: c, release: func() { l.limit.clients.closed(client); <-l.limit.slots }}, nil
	}
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
// faces outside on its own (the proxy's /healthz and /livez, the metrics-only address):
// l.MaxConnections at once, the port's and each client's token bucket and connection share, the
// header size and the timeouts.
func (l Limits) Serve(ln net.Listener, h http.Handler) (net.Listener, *http.Server) {
	l = l.withDefaults()
	p := l.port()
	return p.listener(ln), l.server(p.handler(h))
}
