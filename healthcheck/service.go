package healthcheck

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ReasonFailedToStart is the reason of the Warning event kube-proxy records on a Service whose
// health check node port cannot be opened.
const ReasonFailedToStart = "FailedToStartServiceHealthcheck"

// ProxierHealth is what a service health check asks of the proxy: whether the proxier keeps up.
// *ProxyHealth implements it.
type ProxierHealth interface {
	IsHealthy() bool
}

// ServiceConfig configures a ServiceHealthServer.
type ServiceConfig struct {
	// NodePortAddresses is --nodeport-addresses: health check ports listen on the local addresses
	// inside these prefixes. Empty means every address. The addresses are read when a port is
	// opened; a port already open keeps its sockets.
	NodePortAddresses []netip.Prefix
	// Proxier fills serviceProxyHealthy; nil means always healthy.
	Proxier ProxierHealth
	// OnListenError is called for each health check port that could not be opened, typically
	// because another process holds it; err names the service and port. The open is retried at
	// every later SyncServices that still asks for it, and reported again if it fails again (as
	// kube-proxy does; the event recorder aggregates repeats). Nil logs a warning instead.
	OnListenError func(svc service.NamespacedName, port uint16, err error)
	// Listen opens a listening socket; nil means net.ListenConfig.Listen.
	Listen func(ctx context.Context, network, address string) (net.Listener, error)
	// InterfaceAddrs lists the local addresses NodePortAddresses selects from; nil means this
	// host's interface addresses. Unused when NodePortAddresses is empty.
	InterfaceAddrs func() ([]netip.Addr, error)
	// Logger defaults to logrus' standard logger.
	Logger logrus.FieldLogger
	// Limits bound what each port accepts from outside (connections, request rate, header size,
	// timeouts); zero fields take the defaults.
	Limits Limits
}

// ServiceHealthServer serves one HTTP health check per Service on its healthCheckNodePort: 200
// while the Service has a ready endpoint on this node and the proxier keeps up, 503 otherwise, so a
// load balancer for an externalTrafficPolicy: Local Service sends traffic only to nodes that can
// serve it locally.
type ServiceHealthServer struct {
	cfg ServiceConfig
	log logrus.FieldLogger

	mu     sync.Mutex // guards open and closed; held across a sync
	open   map[service.NamespacedName]*hcPort
	closed bool
	wg     sync.WaitGroup // the serve goroutines

	epMu      sync.RWMutex
	endpoints map[service.NamespacedName]int
}

// hcPort is one open health check port: an HTTP server per listen address.
type hcPort struct {
	port    uint16
	servers []*http.Server
	lns     []net.Listener
}

// NewServiceHealthServer returns a server with no port open. It opens nothing and starts
// nothing: ports open at SyncServices and close at Close (or when Run's ctx ends).
func NewServiceHealthServer(cfg ServiceConfig) *ServiceHealthServer {
	if cfg.Listen == nil {
		var lc net.ListenConfig
		cfg.Listen = lc.Listen
	}
	if cfg.InterfaceAddrs == nil {
		cfg.InterfaceAddrs = hostAddrs
	}
	cfg.Limits = cfg.Limits.withDefaults()
	log := cfg.Logger
	if log == nil {
		log = logrus.StandardLogger()
	}
	return &ServiceHealthServer{cfg: cfg, log: log, open: map[service.NamespacedName]*hcPort{},
		endpoints: map[service.NamespacedName]int{}}
}

// Run waits for ctx to end, then closes every health check port.
func (s *ServiceHealthServer) Run(ctx context.Context) {
	<-ctx.Done()
	s.Close()
}

// Close closes every health check port and waits for their goroutines. Later syncs open nothing.
func (s *ServiceHealthServer) Close() {
	s.mu.Lock()
	s.closed = true
	for name, p := range s.open {
		p.close()
		delete(s.open, name)
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// SyncServices makes the open health check ports those of services (healthCheckNodePort by
// Service; 0 means none). It is a diff: a port that stays keeps its sockets, a Service whose port
// changed is closed then reopened, and ports are closed before others open, so a port passed from
// one Service to another in one sync is free when its new owner opens it.
func (s *ServiceHealthServer) SyncServices(services map[service.NamespacedName]uint16) {
	for _, f := range s.syncServices(services) {
		if s.cfg.OnListenError != nil {
			s.cfg.OnListenError(f.name, f.port, f.err)
		} else {
			s.log.WithFields(logrus.Fields{"service": f.name.String(), "port": f.port}).WithError(f.err).Warn("Cannot open health check port")
		}
	}
}

type listenFailure struct {
	name service.NamespacedName
	port uint16
	err  error
}

// syncServices applies the diff and returns the ports it could not open, reported once the lock
// is released so the callback may call back in.
func (s *ServiceHealthServer) syncServices(services map[service.NamespacedName]uint16) []listenFailure {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	for name, p := range s.open {
		if port := services[name]; port != p.port {
			s.log.WithFields(logrus.Fields{"service": name.String(), "port": p.port}).Debug("Closing health check port")
			p.close()
			delete(s.open, name)
		}
	}
	var (
		addrs   []listenAddr
		addrErr error
		failed  []listenFailure
	)
	for name, port := range services {
		if port == 0 || s.open[name] != nil {
			continue
		}
		if addrs == nil && addrErr == nil {
			addrs, addrErr = s.listenAddrs()
		}
		p, err := s.openPort(name, port, addrs, addrErr)
		if err != nil {
			failed = append(failed, listenFailure{name, port, fmt.Errorf("health check for service %s on port %d: %w", name, port, err)})
			continue
		}
		s.log.WithFields(logrus.Fields{"service": name.String(), "port": port}).Debug("Opened health check port")
		s.open[name] = p
	}
	return failed
}

// SyncEndpoints sets the number of ready endpoints each Service has on this node; a Service left
// out has none.
func (s *ServiceHealthServer) SyncEndpoints(local map[service.NamespacedName]int) {
	m := make(map[service.NamespacedName]int, len(local))
	for name, n := range local {
		m[name] = n
	}
	s.epMu.Lock()
	s.endpoints = m
	s.epMu.Unlock()
}

// Ports returns the open health check ports by Service.
func (s *ServiceHealthServer) Ports() map[service.NamespacedName]uint16 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[service.NamespacedName]uint16, len(s.open))
	for name, p := range s.open {
		out[name] = p.port
	}
	return out
}

func (s *ServiceHealthServer) listenAddrs() ([]listenAddr, error) {
	var local []netip.Addr
	if len(s.cfg.NodePortAddresses) > 0 {
		var err error
		if local, err = s.cfg.InterfaceAddrs(); err != nil {
			return nil, fmt.Errorf("list local addresses: %w", err)
		}
	}
	addrs := listenAddrs(s.cfg.NodePortAddresses, local)
	if len(addrs) == 0 {
		return nil, errNoNodeAddress
	}
	return addrs, nil
}

// openPort listens on every address and starts serving, or closes what it opened and fails, so
// the next sync retries from scratch.
func (s *ServiceHealthServer) openPort(name service.NamespacedName, port uint16, addrs []listenAddr, addrErr error) (*hcPort, error) {
	if addrErr != nil {
		return nil, addrErr
	}
	p := &hcPort{port: port}
	for _, a := range addrs {
		ln, err := s.cfg.Listen(context.Background(), a.network, a.address(port))
		if err != nil {
			p.close()
			return nil, err
		}
		p.lns = append(p.lns, ln)
	}
	limit := s.cfg.Limits.port() // shared by the port's addresses: slots, buckets, clients
	h := limit.handler(s.handler(name))
	for i, ln := range p.lns {
		p.lns[i] = limit.listener(ln)
		ln = p.lns[i]
		srv := s.cfg.Limits.server(h)
		p.servers = append(p.servers, srv)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.WithFields(logrus.Fields{"service": name.String(), "port": port}).WithError(err).Warn("Health check server stopped")
			}
		}()
	}
	return p, nil
}

// close stops serving and frees the port before it returns: the listeners are closed here too,
// as a Serve goroutine that has not started yet would close its listener only later.
func (p *hcPort) close() {
	for _, srv := range p.servers {
		_ = srv.Close()
	}
	for _, ln := range p.lns {
		_ = ln.Close()
	}
}

// serviceHealthBody is kube-proxy's body, written with its tab indentation and no final newline.
type serviceHealthBody struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

func (s *ServiceHealthServer) handler(name service.NamespacedName) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		s.epMu.RLock()
		n := s.endpoints[name]
		s.epMu.RUnlock()
		healthy := s.cfg.Proxier == nil || s.cfg.Proxier.IsHealthy()

		var body serviceHealthBody
		body.Service.Namespace, body.Service.Name = name.Namespace, name.Name
		body.LocalEndpoints, body.ServiceProxyHealthy = n, healthy
		out, err := json.MarshalIndent(body, "", "\t")
		if err != nil { // cannot happen: strings, an int and a bool
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		// As kube-proxy: lets a load balancer weigh nodes by their local endpoints.
		w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(n))
		if n > 0 && healthy {
			w.WriteHeader(http.StatusOK)
		} else {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = w.Write(out)
	})
}
