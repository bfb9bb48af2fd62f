package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Steered is where the portal rules in force send one service port's traffic: what a restarted
// proxy reopens so that traffic flows again before its first sync (the rules of a killed process
// stay, and point at proxy ports nobody listens on any more).
type Steered struct {
	Name     service.ServicePortName
	Protocol service.Protocol
	// ProxyPort receives the port's cluster traffic (the HOST chains' target, which is the same
	// for every portal of the port).
	ProxyPort uint16
	// ExternalProxyPort receives its external traffic when that has a socket of its own
	// (a Local traffic policy); 0 otherwise.
	ExternalProxyPort uint16
	// Families are the IP families of the port's portal addresses (cluster, external and
	// load-balancer IPs; node port rules exist in every family), IPv4 first: the families its
	// sockets listen in.
	Families []portal.Family
}

// ReadSteered reads the nat portal chains in force, for every family these portals program, and
// returns the proxy ports they steer each service port to, sorted by name. A family that is not
// programmed (no node IP of it, another bind address family) or whose iptables is missing is
// skipped.
func (p *Portals) ReadSteered(ctx context.Context) ([]Steered, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	byName := map[service.ServicePortName]*Steered{}
	var errs []error
	for _, fam := range portal.Families {
		if !p.familyEnabled(fam) {
			continue
		}
		data, err := p.runner.Save(ctx, fam, tableNAT)
		if errors.Is(err, ErrUnavailable) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("portal %s nat: read back: %w", fam, err))
			continue
		}
		st, err := parseSave(tableNAT, data)
		if err != nil {
			errs = append(errs, fmt.Errorf("portal %s nat: %w", fam, err))
			continue
		}
		addSteered(byName, fam, st)
	}
	out := make([]Steered, 0, len(byName))
	for _, s := range byName {
		if s.ProxyPort == 0 { // only external portals left: that socket serves them alone
			s.ProxyPort, s.ExternalProxyPort = s.ExternalProxyPort, 0
		}
		if len(s.Families) == 0 { // node port rules alone
			s.Families = []portal.Family{portal.IPv4}
		}
		if s.ProxyPort != 0 {
			out = append(out, *s)
		}
	}
	slices.SortFunc(out, func(a, b Steered) int { return strings.Compare(a.Name.String(), b.Name.String()) })
	return out, errors.Join(errs...)
}

// addSteered records the targets of one family's portal rules. HOST rules always lead to the
// cluster socket; CONTAINER rules lead to it too, except those of external portals of a port whose
// external traffic has its own socket, so a CONTAINER target other than the HOST one is that socket.
func addSteered(byName map[service.ServicePortName]*Steered, fam portal.Family, st *tableState) {
	containers := map[string]bool{ChainPortalsContainer: true, ChainNodePortContainer: true}
	var container []parsedRule
	for _, chain := range []string{ChainPortalsHost, ChainNodePortHost, ChainPortalsContainer, ChainNodePortContainer} {
		for _, body := range st.chains[chain] {
			r, ok := parseRule(body)
			if !ok {
				continue
			}
			s := byName[r.name]
			if s == nil {
				s = &Steered{Name: r.name, Protocol: r.proto}
				byName[r.name] = s
			}
			if (chain == ChainPortalsHost || chain == ChainPortalsContainer) && !slices.Contains(s.Families, fam) {
				s.Families = append(s.Families, fam)
				slices.Sort(s.Families)
			}
			if containers[chain] {
				container = append(container, r)
			} else if s.ProxyPort == 0 {
				s.ProxyPort = r.port
			}
		}
	}
	for _, r := range container {
		s := byName[r.name]
		switch {
		case s.ProxyPort == 0 && s.ExternalProxyPort == 0:
			s.ExternalProxyPort = r.port // settled below, once the HOST rules of every family are in
		case r.port != s.ProxyPort && s.ProxyPort != 0:
			s.ExternalProxyPort = r.port
		}
	}
}

// parsedRule is what a portal rule says about its service port.
type parsedRule struct {
	name  service.ServicePortName
	proto service.Protocol
	port  uint16 // the proxy port it redirects or DNATs to
}

// parseRule reads a portal rule body as buildRules writes it (and iptables-save prints it):
// "-p tcp -m comment --comment "ns/name:port" ... -j REDIRECT --to-ports N" or
// "... -j DNAT --to-destination ADDR:N".
func parseRule(body string) (parsedRule, bool) {
	var r parsedRule
	_, rest, ok := strings.Cut(body, "-p ")
	if !ok {
		return r, false
	}
	proto, rest, _ := strings.Cut(rest, " ")
	switch proto {
	case "tcp":
		r.proto = service.TCP
	case "udp":
		r.proto = service.UDP
	default:
		return r, false
	}
	_, rest, ok = strings.Cut(rest, `--comment "`)
	if !ok {
		return r, false
	}
	comment, _, ok := strings.Cut(rest, `"`)
	if !ok {
		return r, false
	}
	if r.name, ok = parsePortName(comment); !ok {
		return r, false
	}
	var target string
	if _, t, found := strings.Cut(body, "-j REDIRECT --to-ports "); found {
		target = t
	} else if _, t, found := strings.Cut(body, "-j DNAT --to-destination "); found {
		f := strings.Fields(t)
		if len(f) == 0 { // the rule ends there: not one of ours (it crashed the reader)
			return r, false
		}
		ap, err := netip.ParseAddrPort(f[0])
		if err != nil {
			return r, false
		}
		target = strconv.Itoa(int(ap.Port()))
	} else {
		return r, false
	}
	f := strings.Fields(target)
	if len(f) == 0 {
		return r, false
	}
	n, err := strconv.ParseUint(f[0], 10, 16)
	if err != nil || n == 0 {
		return r, false
	}
	r.port = uint16(n)
	return r, true
}

// parsePortName reads "namespace/name:port" or "namespace/name" (ServicePortName.String).
func parsePortName(s string) (service.ServicePortName, bool) {
	ns, rest, ok := strings.Cut(s, "/")
	if !ok || ns == "" || rest == "" {
		return service.ServicePortName{}, false
	}
	name, port, _ := strings.Cut(rest, ":")
	if name == "" {
		return service.ServicePortName{}, false
	}
	return service.ServicePortName{Namespace: ns, Name: name, Port: port}, true
}
