package proxier

// convert.go: a Service converted, in one pure step, into the service ports the proxy serves,
// with every annotation the proxy reads (as kube-proxy builds its ServicePortInfo). What cannot
// be used is returned as errors (ErrInvalidAnnotation, ErrUnsupportedProtocol) and the default
// applies; the handler logs them and turns annotation errors into an event.

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/config"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Labels and annotations the proxy reads.
const (
	// LabelServiceProxyName marks a Service handled by another proxy; kube-proxy skips it too.
	LabelServiceProxyName = config.LabelServiceProxyName
	// AnnotationAccessLog turns the access log on ("true") or off ("false") for one Service.
	AnnotationAccessLog = "portal-proxy.kubernetes.io/access-log"
	// AnnotationAlgorithm picks the balancing algorithm of every port of a Service:
	// round-robin (the default), least-connections or random-two-choices.
	AnnotationAlgorithm = "portal-proxy.kubernetes.io/algorithm"
	// AnnotationOutlierConsecutiveFailures turns passive outlier detection on: an endpoint that
	// fails this many dials in a row (or resets this many connections at once) is ejected.
	AnnotationOutlierConsecutiveFailures = "portal-proxy.kubernetes.io/outlier-consecutive-failures"
	// AnnotationOutlierEjectionTime is the base ejection time (a Go duration, default 30s).
	AnnotationOutlierEjectionTime = "portal-proxy.kubernetes.io/outlier-ejection-time"
	// AnnotationOutlierMaxEjectionPercent bounds the endpoints out at once (default 50).
	AnnotationOutlierMaxEjectionPercent = "portal-proxy.kubernetes.io/outlier-max-ejection-percent"
	// AnnotationSlowStart is the window over which a new or returning endpoint's share of new
	// connections ramps up (a Go duration; unset: off).
	AnnotationSlowStart = "portal-proxy.kubernetes.io/slow-start"
)

// maxQuotedValue bounds how much of a bad annotation value an error quotes: the error becomes a
// Warning event on the Service and a log line, and a value may be 256 KiB.
const maxQuotedValue = 64

// quoteValue quotes an annotation value for an error, cut to maxQuotedValue bytes.
func quoteValue(v string) string {
	if len(v) <= maxQuotedValue {
		return strconv.Quote(v)
	}
	return strconv.Quote(strings.ToValidUTF8(v[:maxQuotedValue], "")) + fmt.Sprintf("... (%d bytes)", len(v))
}

// ErrInvalidAnnotation marks an annotation value the proxy cannot use; the default applies.
var ErrInvalidAnnotation = errors.New("invalid annotation, using the default")

// ErrUnsupportedProtocol marks a service port this proxy cannot serve (SCTP).
var ErrUnsupportedProtocol = errors.New("protocol not supported by a userspace proxy")

// servicePorts converts a Service (convertService) and reports the ports that ask for the kernel
// path this node cannot give them (kernelConflicts): those take the proxy path.
func (c *Config) servicePorts(svc *v1.Service) ([]*service.Port, []error) {
	ports, errs := convertService(svc)
	if svc == nil {
		return ports, errs
	}
	name := service.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	errs = append(errs, c.kernelConflicts(name, ports)...)
	return ports, append(errs, c.resolveSourceModes(name, ports)...)
}

// defaultSourceMode is the source mode of a port that does not ask for one.
func (c *Config) defaultSourceMode() service.SourceMode {
	if c.SourceMode == service.SourceTransparent {
		return service.SourceTransparent
	}
	return service.SourceProxy
}

// resolveSourceModes sets each port's SourceMode to the one it gets, transparent or proxy: the
// annotation's, else the node's. A port asking for transparent gets proxy, reported, where the node
// has no transparent plumbing or the port sends a PROXY protocol header (its endpoint reads the
// client's address there and expects the header); by the node's default alone such a port takes
// proxy silently.
func (c *Config) resolveSourceModes(name service.NamespacedName, ports []*service.Port) []error {
	var errs []error
	nodeTransparent := c.SourceMode == service.SourceTransparent
	reported := false // a node that cannot: one error per Service
	for _, port := range ports {
		asked := port.SourceMode
		mode := asked
		if mode == "" {
			mode = c.defaultSourceMode()
		}
		if mode == service.SourceTransparent {
			switch {
			case !nodeTransparent:
				mode = service.SourceProxy
				if asked != "" && !reported {
					why := c.SourceWhy
					if why == "" {
						why = "the node runs with --source-mode=proxy"
					}
					errs = append(errs, fmt.Errorf("service %s: source mode transparent: %s; endpoints see the node's address: %w", name, why, ErrInvalidAnnotation))
					reported = true
				}
			case port.ProxyProtocol != "":
				mode = service.SourceProxy
				if asked != "" {
					errs = append(errs, fmt.Errorf("service port %s: source mode transparent and a PROXY protocol header: the header is sent, from the node's address: %w", port.Name, ErrInvalidAnnotation))
				}
			}
		}
		port.SourceMode = mode
	}
	return errs
}

// kernelConflicts reports, for a Service whose ports would take the kernel path, why some cannot:
// the node has no kernel path (bind mode: no NAT), or a port needs the proxy (a PROXY protocol
// header is written by the proxy socket). Those ports take the proxy path.
func (c *Config) kernelConflicts(name service.NamespacedName, ports []*service.Port) []error {
	var errs []error
	for _, port := range ports {
		if !c.wantsKernel(port) {
			continue
		}
		switch {
		case !c.KernelPath:
			errs = append(errs, fmt.Errorf("service %s: data path kernel: this node's portal mode has no kernel path (bind mode has no NAT); the proxy path applies: %w",
				name, ErrInvalidAnnotation))
			return errs
		case port.ProxyProtocol != "":
			errs = append(errs, fmt.Errorf("service port %s: data path kernel cannot send a PROXY protocol header; the proxy path applies: %w",
				port.Name, ErrInvalidAnnotation))
		}
	}
	return errs
}

// wantsKernel reports whether a port asks for the kernel path, by annotation or node default.
func (c *Config) wantsKernel(port *service.Port) bool {
	return port.DataPath == service.DataPathKernel || (port.DataPath == "" && c.DefaultDataPath == service.DataPathKernel)
}

// convertService turns a Service into the service ports the proxy serves. Services the proxy does
// not handle (headless, ExternalName, another proxy's) yield none. A port that cannot be served
// (SCTP) is left out and reported in errs; the others are still returned.
func convertService(svc *v1.Service) (ports []*service.Port, errs []error) {
	if svc == nil || !shouldProxy(svc) {
		return nil, nil
	}
	clusterIPs := parseIPs(svc.Spec.ClusterIPs)
	if len(clusterIPs) == 0 {
		clusterIPs = parseIPs([]string{svc.Spec.ClusterIP})
	}
	if len(clusterIPs) == 0 {
		return nil, []error{fmt.Errorf("service %s/%s: no valid cluster IP in %q", svc.Namespace, svc.Name, svc.Spec.ClusterIP)}
	}
	common := service.Port{
		UID:             string(svc.UID),
		ClusterIPs:      clusterIPs,
		ExternalIPs:     parseIPs(svc.Spec.ExternalIPs),
		LoadBalancerIPs: loadBalancerIPs(svc),
		Affinity:        affinity(svc),
		ExternalLocal:   externalPolicyLocal(svc),
		InternalLocal:   svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal,
	}
	if svc.Spec.TrafficDistribution != nil {
		common.TrafficDistribution = service.TrafficDistribution(*svc.Spec.TrafficDistribution)
	}
	proxyProto, hold, errs := readAnnotations(svc, &common)
	for i := range svc.Spec.Ports {
		sp := &svc.Spec.Ports[i]
		name := service.ServicePortName{Namespace: svc.Namespace, Name: svc.Name, Port: sp.Name}
		proto := service.Protocol(sp.Protocol)
		if proto == "" {
			proto = service.TCP
		}
		if proto != service.TCP && proto != service.UDP {
			errs = append(errs, fmt.Errorf("service port %s: %s: %w", name, proto, ErrUnsupportedProtocol))
			continue
		}
		if sp.Port <= 0 || sp.Port > 65535 || sp.NodePort < 0 || sp.NodePort > 65535 {
			errs = append(errs, fmt.Errorf("service port %s: port %d / nodePort %d out of range", name, sp.Port, sp.NodePort))
			continue
		}
		p := common
		p.Name = name
		p.Protocol = proto
		p.Port = uint16(sp.Port)
		p.NodePort = uint16(sp.NodePort)
		if err := setConnectionPolicy(&p, proxyProto, hold); err != nil {
			errs = append(errs, err)
		}
		ports = append(ports, &p)
	}
	return ports, errs
}

// readAnnotations sets a Service's ports' common settings from its annotations and from the spec
// fields that need parsing (the data path, balancing, drain timeout, health check node port,
// source ranges, access log), and returns the connection policies, which apply to TCP ports
// only (setConnectionPolicy), and what it could not use.
func readAnnotations(svc *v1.Service, common *service.Port) (service.ProxyProtocol, time.Duration, []error) {
	var errs []error
	accessLogOn, accessLogErr := accessLog(svc)
	common.AccessLog = accessLogOn
	var err error
	if common.DataPath, err = dataPath(svc); err != nil {
		errs = append(errs, err)
	}
	var balErrs []error
	common.Balancing, balErrs = balancing(svc)
	errs = append(errs, balErrs...)
	if common.DrainTimeout, err = drainTimeout(svc); err != nil {
		errs = append(errs, err)
	}
	if common.SourceMode, err = sourceMode(svc); err != nil {
		errs = append(errs, err)
	}
	if common.HealthCheckNodePort, err = healthCheckNodePort(svc); err != nil {
		errs = append(errs, err)
	}
	var rangeErrs []error
	common.LoadBalancerSourceRanges, rangeErrs = sourceRanges(svc)
	errs = append(errs, rangeErrs...)
	proxyProto, hold, connErrs := connectionPolicy(svc)
	errs = append(errs, connErrs...)
	if accessLogErr != nil {
		errs = append(errs, accessLogErr)
	}
	return proxyProto, hold, errs
}

// AnnotationDrainTimeout is how long the connections and sessions of an endpoint that leaves
// the rotation (terminating, or removed) may go on before what is left is closed: FIN both ways,
// then a reset after DrainResetGrace (a Go duration from 1s to 24h). Unset, the node's
// --drain-removed-endpoints decides.
const AnnotationDrainTimeout = "portal-proxy.kubernetes.io/drain-timeout"

// maxDrainTimeout bounds drain-timeout: a day is longer than any terminationGracePeriodSeconds
// a rolling update would wait for.
const maxDrainTimeout = 24 * time.Hour

// drainTimeout reads the drain-timeout annotation; a value that does not parse is reported
// (wrapping ErrInvalidAnnotation) and the node default (0) used.
func drainTimeout(svc *v1.Service) (time.Duration, error) {
	v, ok := svc.Annotations[AnnotationDrainTimeout]
	if !ok {
		return 0, nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(v))
	if err != nil || d < time.Second || d > maxDrainTimeout {
		return 0, fmt.Errorf("service %s/%s: annotation %s=%s: want a duration from 1s to 24h, such as 60s; the node's --drain-removed-endpoints applies: %w",
			svc.Namespace, svc.Name, AnnotationDrainTimeout, quoteValue(v), ErrInvalidAnnotation)
	}
	return d, nil
}

// accessLog reads the access-log annotation: "true" logs this Service's connections and sessions
// whatever --access-log says, "false" or unset leaves it to the flag. Anything else is reported
// (wrapping ErrInvalidAnnotation) and means unset.
func accessLog(svc *v1.Service) (bool, error) {
	v, ok := svc.Annotations[AnnotationAccessLog]
	if !ok {
		return false, nil
	}
	switch strings.TrimSpace(v) {
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, fmt.Errorf("service %s/%s: annotation %s=%s: want true or false; --access-log applies: %w",
		svc.Namespace, svc.Name, AnnotationAccessLog, quoteValue(v), ErrInvalidAnnotation)
}

// AnnotationDataPath picks a Service's data path: "proxy" (portal rules to a proxy socket) or
// "kernel" (kube-proxy's iptables chains straight to the endpoints, portal/kernel). Unset: the
// node's --default-data-path.
const AnnotationDataPath = "portal-proxy.kubernetes.io/data-path"

// dataPath reads the data-path annotation; a value that does not parse is reported (wrapping
// ErrInvalidAnnotation) and the node default used.
func dataPath(svc *v1.Service) (service.DataPath, error) {
	v, ok := svc.Annotations[AnnotationDataPath]
	if !ok {
		return "", nil
	}
	switch d := service.DataPath(strings.TrimSpace(v)); d {
	case service.DataPathProxy, service.DataPathKernel:
		return d, nil
	}
	return "", fmt.Errorf("service %s/%s: annotation %s=%s: want kernel or proxy; the node's --default-data-path applies: %w",
		svc.Namespace, svc.Name, AnnotationDataPath, quoteValue(v), ErrInvalidAnnotation)
}

// AnnotationSourceMode picks the address a Service's endpoints see: "transparent" (the client's,
// where the node supports it: portal/transparent) or "proxy" (the node's). Unset: the node's
// --source-mode.
const AnnotationSourceMode = "portal-proxy.kubernetes.io/source-mode"

// sourceMode reads the source-mode annotation; a value that does not parse is reported (wrapping
// ErrInvalidAnnotation) and the node default used.
func sourceMode(svc *v1.Service) (service.SourceMode, error) {
	v, ok := svc.Annotations[AnnotationSourceMode]
	if !ok {
		return "", nil
	}
	switch m := service.SourceMode(strings.TrimSpace(v)); m {
	case service.SourceProxy, service.SourceTransparent:
		return m, nil
	}
	return "", fmt.Errorf("service %s/%s: annotation %s=%s: want transparent or proxy; the node's --source-mode applies: %w",
		svc.Namespace, svc.Name, AnnotationSourceMode, quoteValue(v), ErrInvalidAnnotation)
}

// Annotations of the connection policies of a Service's TCP ports: what the proxy does with the
// connection itself rather than with the choice of endpoint.
const (
	// AnnotationProxyProtocol makes every connection to an endpoint start with a PROXY protocol
	// header ("v1" or "v2") carrying the client's address. TCP only: ignored, with a warning, on
	// UDP ports.
	AnnotationProxyProtocol = "portal-proxy.kubernetes.io/proxy-protocol"
	// AnnotationHoldTimeout holds new connections while the port has no endpoint, for up to this
	// long (a Go duration), instead of refusing them. TCP only; unset: refuse.
	AnnotationHoldTimeout = "portal-proxy.kubernetes.io/hold-timeout"
)

// Bounds of the hold timeout: clients give up on a connection that sends nothing after a minute
// or so anyway, and scaling from zero takes seconds to minutes.
const (
	minHoldTimeout = time.Second
	maxHoldTimeout = time.Hour
)

// connectionPolicy reads the PROXY protocol and hold annotations of a Service. A value that does
// not parse is reported (wrapping ErrInvalidAnnotation) and the default used: off.
func connectionPolicy(svc *v1.Service) (service.ProxyProtocol, time.Duration, []error) {
	var errs []error
	bad := func(key, value, why string) {
		errs = append(errs, fmt.Errorf("service %s/%s: annotation %s=%s: %s: %w", svc.Namespace, svc.Name, key, quoteValue(value), why, ErrInvalidAnnotation))
	}
	var pp service.ProxyProtocol
	if v, ok := svc.Annotations[AnnotationProxyProtocol]; ok {
		switch s := service.ProxyProtocol(strings.TrimSpace(v)); s {
		case service.ProxyProtocolV1, service.ProxyProtocolV2:
			pp = s
		default:
			bad(AnnotationProxyProtocol, v, "want v1 or v2; no PROXY header is sent")
		}
	}
	var hold time.Duration
	if v, ok := svc.Annotations[AnnotationHoldTimeout]; ok {
		if d, err := time.ParseDuration(strings.TrimSpace(v)); err == nil && d >= minHoldTimeout && d <= maxHoldTimeout {
			hold = d
		} else {
			bad(AnnotationHoldTimeout, v, fmt.Sprintf("want a duration from %s to %s, such as 30s; connections are refused while there is no endpoint", minHoldTimeout, maxHoldTimeout))
		}
	}
	return pp, hold, errs
}

// setConnectionPolicy gives a TCP port the Service's connection policies. A UDP port takes
// neither: a PROXY protocol asked of it is reported (the Service's TCP ports still send it), a
// hold is silently not applied (datagrams without an endpoint are dropped; the client retries).
func setConnectionPolicy(p *service.Port, pp service.ProxyProtocol, hold time.Duration) error {
	if p.Protocol == service.TCP {
		p.ProxyProtocol, p.HoldTimeout = pp, hold
		return nil
	}
	if pp != "" {
		return fmt.Errorf("service port %s: annotation %s=%q: ignored on a UDP port, the PROXY protocol is TCP only: %w",
			p.Name, AnnotationProxyProtocol, pp, ErrInvalidAnnotation)
	}
	return nil
}

// shouldProxy mirrors kube-proxy's ShouldSkipService plus its informer label selector.
func shouldProxy(svc *v1.Service) bool {
	if _, other := svc.Labels[LabelServiceProxyName]; other {
		return false
	}
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		return false
	}
	ip := svc.Spec.ClusterIP
	return ip != "" && ip != v1.ClusterIPNone
}

// externalPolicyLocal mirrors kube-proxy: externalTrafficPolicy applies only to a Service that
// takes traffic from outside (NodePort, LoadBalancer, or ClusterIP with external IPs).
func externalPolicyLocal(svc *v1.Service) bool {
	if svc.Spec.ExternalTrafficPolicy != v1.ServiceExternalTrafficPolicyLocal {
		return false
	}
	switch svc.Spec.Type {
	case v1.ServiceTypeNodePort, v1.ServiceTypeLoadBalancer:
		return true
	case v1.ServiceTypeClusterIP, "":
		return len(svc.Spec.ExternalIPs) > 0
	}
	return false
}

// healthCheckNodePort is spec.healthCheckNodePort where kube-proxy serves one: a LoadBalancer
// with externalTrafficPolicy Local. Missing there (the API server allocates it) is reported.
func healthCheckNodePort(svc *v1.Service) (uint16, error) {
	if svc.Spec.Type != v1.ServiceTypeLoadBalancer || !externalPolicyLocal(svc) {
		return 0, nil
	}
	p := svc.Spec.HealthCheckNodePort
	if p <= 0 || p > 65535 {
		return 0, fmt.Errorf("service %s/%s: healthCheckNodePort %d: load balancers cannot check this node's endpoints", svc.Namespace, svc.Name, p)
	}
	return uint16(p), nil
}

// sourceRanges parses spec.loadBalancerSourceRanges (padded with spaces, which validation lets
// through, as kube-proxy tolerates), masked and without duplicates. A range that does not parse
// is reported and skipped. Like kube-proxy, and unlike cloud providers, the
// service.beta.kubernetes.io/load-balancer-source-ranges annotation is not read.
func sourceRanges(svc *v1.Service) ([]netip.Prefix, []error) {
	var out []netip.Prefix
	var errs []error
	for i, raw := range svc.Spec.LoadBalancerSourceRanges {
		p, err := netip.ParsePrefix(strings.TrimSpace(raw))
		if err != nil {
			errs = append(errs, fmt.Errorf("service %s/%s: loadBalancerSourceRanges[%d] skipped: %w", svc.Namespace, svc.Name, i, err))
			continue
		}
		p = p.Masked()
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out, errs
}

// balancing reads the load-balancing annotations. A value that does not parse is reported
// (wrapping ErrInvalidAnnotation) and its default used: a typo must not take a Service down.
func balancing(svc *v1.Service) (service.Balancing, []error) {
	var b service.Balancing
	var errs []error
	bad := func(key, value, why string) {
		errs = append(errs, fmt.Errorf("service %s/%s: annotation %s=%s: %s: %w", svc.Namespace, svc.Name, key, quoteValue(value), why, ErrInvalidAnnotation))
	}
	if v, ok := svc.Annotations[AnnotationAlgorithm]; ok {
		switch a := service.Algorithm(strings.TrimSpace(v)); a {
		case service.RoundRobin, service.LeastConnections, service.RandomTwoChoices:
			b.Algorithm = a
		default:
			bad(AnnotationAlgorithm, v, "want round-robin, least-connections or random-two-choices")
		}
	}
	o := service.Outlier{EjectionTime: service.DefaultEjectionTime, MaxEjectionPercent: service.DefaultMaxEjectionPercent}
	if v, ok := svc.Annotations[AnnotationOutlierConsecutiveFailures]; ok {
		if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && n >= 1 && n <= maxConsecutiveFailures {
			o.ConsecutiveFailures = n
		} else {
			bad(AnnotationOutlierConsecutiveFailures, v, fmt.Sprintf("want a whole number from 1 to %d; outlier detection stays off", maxConsecutiveFailures))
		}
	}
	if v, ok := svc.Annotations[AnnotationOutlierEjectionTime]; ok {
		if d, err := time.ParseDuration(strings.TrimSpace(v)); err == nil && d >= time.Second && d <= time.Hour {
			o.EjectionTime = d
		} else {
			bad(AnnotationOutlierEjectionTime, v, "want a duration from 1s to 1h, such as 30s")
		}
	}
	if v, ok := svc.Annotations[AnnotationOutlierMaxEjectionPercent]; ok {
		if n, err := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "%"))); err == nil && n >= 1 && n <= 100 {
			o.MaxEjectionPercent = n
		} else {
			bad(AnnotationOutlierMaxEjectionPercent, v, "want a whole number from 1 to 100")
		}
	}
	if o.On() {
		b.Outlier = o
	}
	if v, ok := svc.Annotations[AnnotationSlowStart]; ok {
		if d, err := time.ParseDuration(strings.TrimSpace(v)); err == nil && d >= time.Second && d <= time.Hour {
			b.SlowStart = d
		} else {
			bad(AnnotationSlowStart, v, "want a duration from 1s to 1h, such as 30s; slow start stays off")
		}
	}
	return b, errs
}

// maxConsecutiveFailures bounds outlier-consecutive-failures; more would never trigger.
const maxConsecutiveFailures = 1000

func affinity(svc *v1.Service) service.Affinity {
	if svc.Spec.SessionAffinity != v1.ServiceAffinityClientIP {
		return service.Affinity{}
	}
	a := service.Affinity{ClientIP: true}
	if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
		a.Timeout = time.Duration(*c.ClientIP.TimeoutSeconds) * time.Second
	}
	if a.Timeout <= 0 {
		a.Timeout = service.DefaultAffinityTimeout
	}
	return a
}

func loadBalancerIPs(svc *v1.Service) []netip.Addr {
	var raw []string
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		raw = append(raw, ing.IP) // hostname-only ingress has no IP to portal
	}
	return parseIPs(raw)
}

// parseIPs keeps the valid, unique addresses in their given order.
func parseIPs(raw []string) []netip.Addr {
	var out []netip.Addr
	seen := map[netip.Addr]bool{}
	for _, s := range raw {
		ip, err := netip.ParseAddr(s)
		if err != nil || ip.Zone() != "" {
			continue
		}
		ip = ip.Unmap()
		if !seen[ip] {
			seen[ip] = true
			out = append(out, ip)
		}
	}
	return out
}
