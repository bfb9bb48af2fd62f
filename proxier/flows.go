package proxier

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// FlowSink gives each service port's flow events their home: the live flow stream's ring
// (observe.Hub). ForPort is called once per proxy socket when it is built, and once per
// kernel-path port when the port moves there; the data path then calls the Recorder.
type FlowSink interface {
	ForPort(*flow.Port) flow.Recorder
}

// KernelFlowLookup finds the recorder of the kernel-path port whose address dst is (the
// original destination of a conntrack entry); nil if none.
type KernelFlowLookup interface {
	Lookup(proto flow.Protocol, dst netip.AddrPort) flow.Recorder
	// Ports is how many ports are on the kernel path: conntrack events are worth reading only
	// while there is one.
	Ports() int
	// Changed receives after a sync that changed the kernel-path ports.
	Changed() <-chan struct{}
}

// flowPort describes a service port for its flow events.
func flowPort(p *service.Port, node string, path flow.Path) *flow.Port {
	proto := flow.TCP
	if p.Protocol == service.UDP {
		proto = flow.UDP
	}
	return &flow.Port{Namespace: p.Name.Namespace, Service: p.Name.Name, Port: p.Name.Port, Protocol: proto, Path: path, Node: node}
}

// kernelFlows finds the kernel-path port a conntrack entry belongs to, by the address its
// client reached (observe/conntrack.PortLookup): a service address and port, or any address at
// a node port. The sync goroutine rebuilds the index after a sync that changed the kernel-path
// ports; the conntrack watcher reads it without a lock.
type kernelFlows struct {
	sink FlowSink
	node string
	// dirty is set by the sync goroutine when the kernel-path ports changed.
	dirty bool
	index atomic.Pointer[kernelIndex]
	// recorders keeps each port's recorder across rebuilds, so a port's flow events keep their
	// Port. Owned by the sync goroutine.
	recorders map[kernelRecorderKey]flow.Recorder
	// ports counts the kernel-path ports as last indexed; changed is poked after each rebuild.
	ports   atomic.Int64
	changed chan struct{}
}

func newKernelFlows(sink FlowSink, node string) *kernelFlows {
	return &kernelFlows{sink: sink, node: node, changed: make(chan struct{}, 1)}
}

// Ports is how many ports are on the kernel path.
func (k *kernelFlows) Ports() int { return int(k.ports.Load()) }

// Changed receives after a sync that changed the kernel-path ports.
func (k *kernelFlows) Changed() <-chan struct{} { return k.changed }

type kernelRecorderKey struct {
	name  service.ServicePortName
	proto service.Protocol
}

type kernelKey struct {
	proto flow.Protocol
	dst   netip.AddrPort
}

type kernelIndex struct {
	addrs     map[kernelKey]flow.Recorder
	nodePorts map[kernelKey]flow.Recorder // dst's address is the zero Addr
}

// Lookup returns the recorder of the kernel-path port that dst (the original destination of a
// conntrack entry) belongs to, or nil.
func (k *kernelFlows) Lookup(proto flow.Protocol, dst netip.AddrPort) flow.Recorder {
	if k == nil {
		return nil
	}
	x := k.index.Load()
	if x == nil {
		return nil
	}
	if r := x.addrs[kernelKey{proto, netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())}]; r != nil {
		return r
	}
	return x.nodePorts[kernelKey{proto, netip.AddrPortFrom(netip.Addr{}, dst.Port())}]
}

// rebuild publishes the index of ports, the kernel-path ports as the sync goroutine holds them.
func (k *kernelFlows) rebuild(ports map[service.ServicePortName]*service.Port) {
	if k == nil || k.sink == nil || !k.dirty {
		return
	}
	k.dirty = false
	x := &kernelIndex{addrs: map[kernelKey]flow.Recorder{}, nodePorts: map[kernelKey]flow.Recorder{}}
	recs := make(map[kernelRecorderKey]flow.Recorder, len(ports))
	for _, p := range ports {
		key := kernelRecorderKey{p.Name, p.Protocol}
		r := k.recorders[key]
		if r == nil {
			r = k.sink.ForPort(flowPort(p, k.node, flow.PathKernel))
		}
		recs[key] = r
		proto := flow.TCP
		if p.Protocol == service.UDP {
			proto = flow.UDP
		}
		for _, ips := range [][]netip.Addr{p.ClusterIPs, p.ExternalIPs, p.LoadBalancerIPs} {
			for _, ip := range ips {
				x.addrs[kernelKey{proto, netip.AddrPortFrom(ip.Unmap(), p.Port)}] = r
			}
		}
		if p.NodePort != 0 {
			x.nodePorts[kernelKey{proto, netip.AddrPortFrom(netip.Addr{}, p.NodePort)}] = r
		}
	}
	k.recorders = recs
	k.index.Store(x)
	k.ports.Store(int64(len(ports)))
	select {
	case k.changed <- struct{}{}:
	default:
	}
}

// flowResolver names the pods behind a flow's addresses for the stream (observe.Resolver), from
// the proxier's EndpointSlices. It runs on observers' goroutines, never on the data path.
type flowResolver struct {
	pods *PodIndex
	// all lists every service port's endpoints, for the client index.
	all   func() map[service.ServicePortName][]service.Endpoint
	clock func() time.Time

	mu        sync.Mutex
	clients   map[netip.Addr]string
	clientsAt time.Time
}

// clientIndexTTL bounds how stale the client-pod index may be: it is rebuilt from every
// endpoint, so at most this often, and only while someone observes.
const clientIndexTTL = 5 * time.Second

// Endpoint names the pod and node behind ep, an endpoint of port.
func (r *flowResolver) Endpoint(port *flow.Port, ep netip.AddrPort) (pod, node string) {
	if port == nil || r.pods == nil {
		return "", ""
	}
	name := service.ServicePortName{Namespace: port.Namespace, Name: port.Service, Port: port.Port}
	r.pods.watch(name)
	ref := r.pods.lookup(name, ep)
	return ref.pod, ref.node
}

// Client names the pod at ip when it is an endpoint of some Service.
func (r *flowResolver) Client(ip netip.Addr) string {
	if r.all == nil {
		return ""
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if now := r.clock(); r.clients == nil || now.Sub(r.clientsAt) > clientIndexTTL {
		r.clients = map[netip.Addr]string{}
		for _, eps := range r.all() {
			for _, e := range eps {
				if e.TargetRef.Name != "" {
					r.clients[e.Addr.Addr()] = e.TargetRef.String()
				}
			}
		}
		r.clientsAt = now
	}
	return r.clients[ip.Unmap()]
}
