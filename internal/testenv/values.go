package testenv

import (
	"net/netip"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Addrs parses test addresses, panicking on a typo; no arguments give nil.
func Addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

// PortName is the service port namespace/name:port.
func PortName(ns, name, port string) service.ServicePortName {
	return service.ServicePortName{Namespace: ns, Name: name, Port: port}
}
