package portal

import (
	"net/netip"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func addrs(s ...string) []netip.Addr {
	out := make([]netip.Addr, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddr(a)
	}
	return out
}

func spn(ns, name, port string) service.ServicePortName {
	return service.ServicePortName{Namespace: ns, Name: name, Port: port}
}
