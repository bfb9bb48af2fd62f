package proxier

import (
	"net/netip"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// portSink hands out one recorder per ForPort call and remembers the ports.
type portSink struct {
	mu    sync.Mutex
	ports []*flow.Port
}

type portRecorder struct{ port *flow.Port }

func (portRecorder) Record(*flow.Event) {}

func (s *portSink) ForPort(p *flow.Port) flow.Recorder {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ports = append(s.ports, p)
	return portRecorder{port: p}
}

// TestKernelFlowsLookup: a port on the kernel path is found by its cluster IP and port, its
// external IP and its node port (any address), under the protocol it has; off the kernel path,
// nothing is. The recorder names the port with path kernel and this node.
func TestKernelFlowsLookup(t *testing.T) {
	sink := &portSink{}
	e := newFakeEnv(t, func(c *Config) { c.KernelPath, c.Node.Name = true, "node-a" })
	e.p.deps.Flows = sink
	e.p.paths.kflows = newKernelFlows(sink, "node-a")
	e.synced()
	e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1"))
	svc := webService(func(s *v1.Service) {
		withDataPath("kernel")(s)
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.ExternalIPs = []string{"192.0.2.7"}
	})
	e.p.OnServiceAdd(svc)
	e.sync()

	look := e.p.KernelFlows()
	if look.Ports() != 1 {
		t.Errorf("Ports() = %d, want 1", look.Ports())
	}
	select {
	case <-look.Changed():
	default:
		t.Error("no Changed after the sync that put the port on the kernel path")
	}
	for _, tc := range []struct {
		proto flow.Protocol
		dst   string
		found bool
	}{
		{flow.TCP, "10.96.0.10:80", true},
		{flow.TCP, "192.0.2.7:80", true},
		{flow.TCP, "198.51.100.1:30080", true}, // a node port at any address
		{flow.TCP, "10.96.0.10:81", false},
		{flow.UDP, "10.96.0.10:80", false},
		{flow.TCP, "10.96.0.11:80", false},
	} {
		r := look.Lookup(tc.proto, netip.MustParseAddrPort(tc.dst))
		if (r != nil) != tc.found {
			t.Errorf("Lookup(%v, %s) = %v, want found %v", tc.proto, tc.dst, r, tc.found)
			continue
		}
		if r != nil {
			p := r.(portRecorder).port
			if p.String() != "ns/web:http" || p.Path != flow.PathKernel || p.Node != "node-a" || p.Protocol != flow.TCP {
				t.Errorf("Lookup(%s) port %+v, want ns/web:http on the kernel path of node-a", tc.dst, *p)
			}
		}
	}
	// Another sync with no change keeps the port's recorder (its events keep one Port).
	first := look.Lookup(flow.TCP, netip.MustParseAddrPort("10.96.0.10:80"))
	e.p.OnServiceUpdate(svc, svc)
	e.sync()
	if again := look.Lookup(flow.TCP, netip.MustParseAddrPort("10.96.0.10:80")); again != first {
		t.Errorf("recorder changed across syncs: %v then %v", first, again)
	}

	// Back on the proxy path: conntrack entries to it are not kernel-path flows.
	back := svc.DeepCopy()
	back.Annotations[AnnotationDataPath] = "proxy"
	e.p.OnServiceUpdate(svc, back)
	e.sync()
	if r := look.Lookup(flow.TCP, netip.MustParseAddrPort("10.96.0.10:80")); r != nil {
		t.Errorf("after the switch back to the proxy path Lookup found %v, want nil", r)
	}
	if look.Ports() != 0 {
		t.Errorf("Ports() = %d after the switch back, want 0", look.Ports())
	}
}

// TestFlowResolver names an endpoint's pod and node, and a client's pod when the client is an
// endpoint of some Service.
func TestFlowResolver(t *testing.T) {
	e := newFakeEnv(t, nil)
	pods := NewPodIndex()
	e.p.deps.Pods = pods
	pods.source = e.p.endpointsOf
	e.synced()
	slice := webSlice("a", 8080, "10.244.1.1", "10.244.1.2")
	for i := range slice.Endpoints {
		slice.Endpoints[i].TargetRef = &v1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: []string{"web-1", "web-2"}[i]}
		slice.Endpoints[i].NodeName = ptrTo([]string{"node-a", "node-b"}[i])
	}
	e.p.OnEndpointSliceAdd(slice)
	e.p.OnServiceAdd(webService(nil))
	e.sync()

	r := e.p.FlowResolver()
	port := flowPort(&service.Port{Name: webHTTP, Protocol: service.TCP}, "node-a", flow.PathSocket)
	if pod, node := r.Endpoint(port, netip.MustParseAddrPort("10.244.1.2:8080")); pod != "ns/web-2" || node != "node-b" {
		t.Errorf("Endpoint(10.244.1.2:8080) = %q, %q, want ns/web-2, node-b", pod, node)
	}
	if pod, node := r.Endpoint(port, netip.MustParseAddrPort("10.244.9.9:8080")); pod != "" || node != "" {
		t.Errorf("Endpoint(unknown) = %q, %q, want nothing", pod, node)
	}
	if got := r.Client(netip.MustParseAddr("10.244.1.1")); got != "ns/web-1" {
		t.Errorf("Client(10.244.1.1) = %q, want ns/web-1", got)
	}
	if got := r.Client(netip.MustParseAddr("10.100.0.2")); got != "" {
		t.Errorf("Client(10.100.0.2) = %q, want nothing", got)
	}
}

func ptrTo[T any](v T) *T { return &v }

// TestPickWhyFromSelection: the selection's reasons reach every pick as flow.PickWhy bits.
func TestPickWhyFromSelection(t *testing.T) {
	for _, tc := range []struct {
		reason string
		want   flow.PickWhy
	}{
		{"policy=Cluster", 0},
		{"policy=Cluster topology=zone:zone-a", flow.Topology},
		{"policy=Cluster hints-ignored=no-zone-hint-for:zone-c", 0},
		{"policy=Cluster fallback=terminating", flow.Terminating},
		{"policy=Local", flow.Local},
		{"policy=Local fallback=terminating", flow.Local | flow.Terminating},
		{"policy=Local endpoints=none-on-node", flow.Local},
	} {
		if got := (Selection{Reason: tc.reason}).pickWhy(); got != tc.want {
			t.Errorf("%q: %v, want %v", tc.reason, got.Names(), tc.want.Names())
		}
	}
}

// TestPicksExplainThemselves: through the proxier, a port's picks carry the balancer's reasons
// and the selection's (here topology hints for this node's zone), and the pickers that wrap the
// balancer after a restart pass them on.
func TestPicksExplainThemselves(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.Node = NodeTopology{Name: "node-a", Zone: "zone-a"} })
	e.p.eps.refs = true // as with Deps.Flows: the balancer names the endpoints' pods
	e.synced()
	slice := webSlice("a", 8080, "10.244.1.1", "10.244.1.2")
	for i := range slice.Endpoints {
		zone := []string{"zone-a", "zone-b"}[i]
		slice.Endpoints[i].Zone = ptrTo(zone)
		slice.Endpoints[i].Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}}
		slice.Endpoints[i].TargetRef = &v1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: []string{"web-1", "web-2"}[i]}
		slice.Endpoints[i].NodeName = ptrTo([]string{"node-a", "node-b"}[i])
	}
	e.p.OnEndpointSliceAdd(slice)
	e.p.OnServiceAdd(webService(nil))
	e.sync()
	svc := e.lb.Service(webHTTP)
	for name, picker := range map[string]Picker{
		"balancer": svc,
		"gated":    &gatedPicker{next: svc},
		"hold":     &holdPicker{next: svc, clock: e.clk},
	} {
		x, ok := picker.(flow.Explainer)
		if !ok {
			t.Errorf("%s picker does not explain its picks", name)
			continue
		}
		ep, why, err := x.NextWhy(netip.MustParseAddr("10.100.0.2"), false)
		if err != nil || ep != netip.MustParseAddrPort("10.244.1.1:8080") {
			t.Errorf("%s: picked %v, %v; want the zone-a endpoint", name, ep, err)
		}
		if why.Algorithm != flow.RoundRobin || why.Why != flow.Topology {
			t.Errorf("%s: pick %s %v, want round-robin [topology]", name, why.Algorithm, why.Why.Names())
		}
		if why.Ref == nil || *why.Ref != (flow.EndpointRef{Pod: "ns/web-1", Node: "node-a"}) {
			t.Errorf("%s: pick names %+v, want ns/web-1 on node-a", name, why.Ref)
		}
	}
}
