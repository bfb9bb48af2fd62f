package main

// targets.go starts each way of reaching the pod: directly, through the real kube-portal-proxy
// binary (iptables portals or bind mode), HAProxy and nginx stream. Proxies run in the node
// namespace; HAProxy and nginx listen on the node's address as a node-level proxy would.

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// target is one way from the client to the pod.
type target struct {
	name  string
	start func(ctx context.Context, b *bed) (*running, error)
}

// running is a started target: where the client sends each load and which process to measure.
type running struct {
	echo, sink netip.AddrPort // TCP request/response and bulk
	udp        netip.AddrPort // UDP echo; invalid when the target has no UDP
	redis, dns netip.AddrPort // the real servers (TCP, UDP); invalid when the target does not serve them
	pid        int            // the proxy; 0 for direct
	proc       *child
	stopSig    syscall.Signal
	// bulkAndUDPOnly skips the connection, keep-alive and idle loads (the ceiling target).
	bulkAndUDPOnly bool
	// cleanup, when set, runs after the proxy has stopped (the legacy target's API relay).
	cleanup func()
	// idleMax, when set, caps the idle-connection test below the suite's count: the most the
	// proxy can hold within its descriptor limit.
	idleMax int
}

func (r *running) stop() {
	if r.proc != nil {
		r.proc.stop(r.stopSig, 10*time.Second)
	}
	if r.cleanup != nil {
		r.cleanup()
	}
}

// The cluster IPs of the services the daemon serves, and the ports HAProxy and nginx listen on.
var (
	echoVIP = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.10"), 80)
	sinkVIP = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.11"), 80)
	dnsVIP  = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.53"), 53)

	nodeEcho = netip.AddrPortFrom(testbed.NodeClientIP, 10080)
	nodeSink = netip.AddrPortFrom(testbed.NodeClientIP, 10081)
	nodeUDP  = netip.AddrPortFrom(testbed.NodeClientIP, 10053)
)

func directTarget() target {
	return target{name: "direct", start: func(context.Context, *bed) (*running, error) {
		return &running{echo: podAddr(echoPort), sink: podAddr(sinkPort), udp: podAddr(udpPort),
			redis: podAddr(redisPort), dns: podAddr(dnsPort)}, nil
	}}
}

// kppTarget runs the real daemon on a services file in the given portal mode, with extra flags
// (the kernel target: --default-data-path kernel).
func kppTarget(name, binary, mode string, extra ...string) target {
	return target{name: name, start: func(ctx context.Context, b *bed) (*running, error) {
		file := filepath.Join(b.dir, "services.yaml")
		if err := os.WriteFile(file, []byte(servicesYAML()), 0o644); err != nil {
			return nil, err
		}
		logPath := filepath.Join(b.dir, strings.ReplaceAll(name, " ", "-")+".log")
		log, err := os.Create(logPath)
		if err != nil {
			return nil, err
		}
		defer log.Close()
		proc, err := startChild(ctx, b.tb.Node, "kube-portal-proxy", log, append([]string{binary,
			"--services-file", file, "--portal-mode", mode,
			"--healthz-bind-address", "", "--metrics-bind-address", "", "--log-level", "warn",
			"--iptables-min-sync-period", "100ms", "--shutdown-timeout", "2s", "--oom-score-adj", "0",
			// Leave conntrack sysctls alone: nf_conntrack_max is not the bed's to set.
			"--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0",
			"--conntrack-tcp-timeout-close-wait", "0"}, extra...)...)
		if err != nil {
			return nil, err
		}
		r := &running{echo: echoVIP, sink: sinkVIP, udp: dnsVIP, redis: redisVIP, dns: realDNSIP,
			pid: proc.pid(), proc: proc, stopSig: syscall.SIGTERM}
		if err := waitReady(ctx, b, r); err != nil {
			r.stop()
			tail, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("%w; log:\n%s", err, lastLines(string(tail), 10))
		}
		return r, nil
	}}
}

// servicesYAML is the daemon's input: echo and sink over TCP, and a DNS-like UDP port.
func servicesYAML() string {
	var b strings.Builder
	for _, s := range []struct {
		name     string
		vip      netip.AddrPort
		proto    string
		port     uint16
		podPort  uint16
		portName string
	}{
		{"echo", echoVIP, "TCP", 80, echoPort, "tcp"},
		{"sink", sinkVIP, "TCP", 80, sinkPort, "tcp"},
		{"dns", dnsVIP, "UDP", 53, udpPort, "udp"},
		{"redis", redisVIP, "TCP", redisVIP.Port(), redisPort, "redis"},
		{"unbound", realDNSIP, "UDP", 53, dnsPort, "dns"},
	} {
		fmt.Fprintf(&b, `apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: bench}
spec: {clusterIP: %[2]s, ports: [{name: %[6]s, protocol: %[3]s, port: %[4]d, targetPort: %[5]d}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, namespace: bench, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: %[6]s, protocol: %[3]s, port: %[5]d}]
endpoints:
- addresses: ["%[7]s"]
---
`, s.name, s.vip.Addr(), s.proto, s.port, s.podPort, s.portName, testbed.PodIP(1))
	}
	return b.String()
}

// haproxyTarget runs HAProxy (TCP only) with two threads, like the daemon's GOMAXPROCS here.
func haproxyTarget(maxconn int) target {
	return target{name: "haproxy", start: func(ctx context.Context, b *bed) (*running, error) {
		cfg := fmt.Sprintf(`global
  maxconn %d
  nbthread 2
defaults
  mode tcp
  timeout connect 5s
  timeout client 1h
  timeout server 1h
listen echo
  bind %s
  server pod %s
listen sink
  bind %s
  server pod %s
listen redis
  bind %s
  server pod %s
`, maxconn, nodeEcho, podAddr(echoPort), nodeSink, podAddr(sinkPort), nodeRedis, podAddr(redisPort))
		path := filepath.Join(b.dir, "haproxy.cfg")
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			return nil, err
		}
		return startInNode(ctx, b, running{echo: nodeEcho, sink: nodeSink, redis: nodeRedis, stopSig: syscall.SIGTERM},
			"haproxy", "-db", "-q", "-f", path)
	}}
}

// nginxTarget runs nginx stream (TCP and UDP) with two workers.
func nginxTarget(module string, fdLimit int) target {
	return target{name: "nginx", start: func(ctx context.Context, b *bed) (*running, error) {
		cfg := fmt.Sprintf(`load_module %[1]s;
daemon off;
worker_processes 2;
worker_rlimit_nofile %[2]d;
pid %[3]s/nginx.pid;
error_log stderr warn;
events { worker_connections %[4]d; }
stream {
  server { listen %[5]s; proxy_pass %[6]s; proxy_half_close on; }
  server { listen %[7]s; proxy_pass %[8]s; proxy_half_close on; }
  server { listen %[9]s udp; proxy_pass %[10]s; proxy_timeout 10s; }
  server { listen %[11]s; proxy_pass %[12]s; proxy_half_close on; }
  server { listen %[13]s udp; proxy_pass %[14]s; proxy_timeout 10s; }
}
`, module, fdLimit, b.dir, fdLimit-500, nodeEcho, podAddr(echoPort), nodeSink, podAddr(sinkPort), nodeUDP, podAddr(udpPort),
			nodeRedis, podAddr(redisPort), nodeDNS, podAddr(dnsPort))
		path := filepath.Join(b.dir, "nginx.conf")
		if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
			return nil, err
		}
		// SIGTERM: the master stops its workers (SIGKILL would orphan them).
		return startInNode(ctx, b, running{echo: nodeEcho, sink: nodeSink, udp: nodeUDP, redis: nodeRedis, dns: nodeDNS,
			stopSig: syscall.SIGTERM},
			"nginx", "-e", "stderr", "-p", b.dir, "-c", path)
	}}
}

// startInNode runs argv in the node namespace as the target r describes (its addresses and stop
// signal) and waits until it answers there.
func startInNode(ctx context.Context, b *bed, r running, argv ...string) (*running, error) {
	proc, err := startChild(ctx, b.tb.Node, filepath.Base(argv[0]), nil, argv...)
	if err != nil {
		return nil, err
	}
	r.pid, r.proc = proc.pid(), proc
	if err := waitReady(ctx, b, &r); err != nil {
		r.stop()
		return nil, err
	}
	return &r, nil
}

// waitReady waits until every address of r answers from the client namespace.
func waitReady(ctx context.Context, b *bed, r *running) error {
	var exited <-chan struct{}
	if r.proc != nil {
		exited = r.proc.exited
	}
	// The sink answers only at EOF; the echo proves the proxy serves TCP.
	if err := b.probeTCP(ctx, r.echo, exited); err != nil {
		return fmt.Errorf("tcp %s: %w", r.echo, err)
	}
	if r.udp.IsValid() {
		if err := b.probeUDP(ctx, r.udp, exited); err != nil {
			return fmt.Errorf("udp %s: %w", r.udp, err)
		}
	}
	return nil
}

// available says why a tool cannot run here ("" when it can).
func available(bin string, files ...string) string {
	if _, err := exec.LookPath(bin); err != nil {
		return bin + " not installed"
	}
	for _, f := range files {
		if _, err := os.Stat(f); err != nil {
			return fmt.Sprintf("%s: %s missing", bin, f)
		}
	}
	return ""
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
