package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

// Address plan: internal/testbed's. A real nginx in pod1 (10.244.1.10) listens on 8081 with
// proxy_protocol; the client pod (172.30.0.2) and the external host (192.0.2.2) reach the
// Service at its cluster IP and its node port on the node (192.0.2.1).

// createAnnotated creates a Service with annotations in the node's namespace.
func (n *clusterNode) createAnnotated(t *testing.T, name string, annotations map[string]string, spec corev1.ServiceSpec) *corev1.Service {
	t.Helper()
	return createService(t, n.admin, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.namespace, Annotations: annotations}, Spec: spec})
}

// proxyProtocolGet sends one HTTP request from ns to addr and returns nginx's answer: the client
// and server addresses its PROXY header carried.
func proxyProtocolGet(ns *netns.NS, addr netip.AddrPort) (client string, body string, err error) {
	c, err := dialTCP(ns, addr)
	if err != nil {
		return "", "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(requestTimeout))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: e2e\r\n\r\n"); err != nil {
		return "", "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", "", fmt.Errorf("read response: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("GET %s: %d %q, %v (nginx rejects a connection without a PROXY header with 400)", addr, resp.StatusCode, b, err)
	}
	return c.LocalAddr().String(), string(b), nil
}

// TestProxyProtocolAnnotation: Services annotated proxy-protocol v1 and v2 in front of a real
// nginx that requires the PROXY protocol. nginx sees the real client address and port, and as the
// server address the one the client dialled: the cluster IP and service port (from conntrack,
// SO_ORIGINAL_DST, behind the portal's REDIRECT), or the node IP and node port.
func TestProxyProtocolAnnotation(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 1)
	pod := n.bed.Pods[0]
	testenv.StartNginxProxyProtocol(t, netip.AddrPortFrom(pod.IP, 8081), []string{"ip", "netns", "exec", pod.NS.Name},
		func(a netip.AddrPort) (net.Conn, error) { return testbed.Dial(n.bed.Node, a, time.Second) })
	spec := corev1.ServiceSpec{Type: corev1.ServiceTypeNodePort, Ports: []corev1.ServicePort{
		{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8081)}}}
	proxy := n.startProxy(t)
	for _, version := range []string{"v1", "v2"} {
		t.Run(version, func(t *testing.T) {
			svc := n.createAnnotated(t, "pp-"+version, map[string]string{proxier.AnnotationProxyProtocol: version}, spec)
			n.setEndpoints(t, svc, 1)
			cluster := targetsOf(t, svc).clusterTCP
			nodePort := netip.AddrPortFrom(testbed.NodeExtIP, uint16(svc.Spec.Ports[0].NodePort))
			for _, c := range []struct {
				from *netns.NS
				to   netip.AddrPort
			}{{n.bed.Client, cluster}, {n.bed.External, nodePort}} {
				var client, body string
				eventually(t, 30*time.Second, "the PROXY protocol service to answer at "+c.to.String(), func() error {
					if err := proxy.exited(); err != nil {
						return err
					}
					var err error
					client, body, err = proxyProtocolGet(c.from, c.to)
					return err
				})
				if want := client + " " + c.to.String(); body != want {
					t.Errorf("nginx behind %s saw %q, want the client and the address it dialled: %q", c.to, body, want)
				}
			}
		})
	}
}

// TestHoldTimeoutAnnotation: a Service annotated hold-timeout and without endpoints is not
// refused: a client's connection is accepted and held (the held gauge shows it) and is served by
// the first endpoint that appears, with the bytes it sent meanwhile. Another one, with a short
// hold and no endpoint ever, resets its client at the deadline, logged with the reason
// hold-timeout.
func TestHoldTimeoutAnnotation(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 1)
	spec := corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, Ports: []corev1.ServicePort{
		{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080)}}}
	held := n.createAnnotated(t, "held", map[string]string{proxier.AnnotationHoldTimeout: "1m"}, spec)
	short := n.createAnnotated(t, "short", map[string]string{proxier.AnnotationHoldTimeout: "2s"}, spec)
	ready := n.createService(t, "ready", spec) // answers once the proxy has synced
	n.setEndpoints(t, ready, 1)
	proxy := n.startProxy(t, "--access-log")
	proxy.waitAnswers(t, n.bed.Client, targetsOf(t, ready).clusterTCP, "the proxy never served the ready service")

	heldGauge := fmt.Sprintf(`kube_portal_proxy_tcp_held_connections{service_port="%s/held:http"}`, n.namespace)
	t.Run("held_until_an_endpoint_appears", func(t *testing.T) {
		c, err := dialTCP(n.bed.Client, targetsOf(t, held).clusterTCP)
		if err != nil {
			t.Fatalf("connect to the held service without endpoints: %v, want it accepted", err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(45 * time.Second))
		if _, err := io.WriteString(c, "sent while held\n"); err != nil {
			t.Fatal(err)
		}
		eventually(t, 30*time.Second, "the connection to show as held", func() error {
			if v, err := scrape(n.bed.Node, heldGauge); err != nil || v != 1 {
				return fmt.Errorf("%s = %v, %v; want 1", heldGauge, v, err)
			}
			return nil
		})
		n.setEndpoints(t, held, 1)
		r := bufio.NewReader(c)
		greeting, err := r.ReadString('\n')
		if err != nil || strings.TrimSpace(greeting) != "pod1" {
			t.Fatalf("greeting after the endpoint appeared: %q, %v; want pod1", greeting, err)
		}
		echo, err := r.ReadString('\n')
		if err != nil || echo != "sent while held\n" {
			t.Errorf("echo of the bytes sent while held: %q, %v", echo, err)
		}
		if v, err := scrape(n.bed.Node, heldGauge); err != nil || v != 0 {
			t.Errorf("%s after the endpoint appeared = %v, %v; want 0", heldGauge, v, err)
		}
	})
	t.Run("reset_at_the_deadline_with_reason_hold_timeout", func(t *testing.T) {
		c, err := dialTCP(n.bed.Client, targetsOf(t, short).clusterTCP)
		if err != nil {
			t.Fatalf("connect to the short-hold service without endpoints: %v, want it accepted", err)
		}
		defer c.Close()
		start := time.Now()
		_ = c.SetDeadline(start.Add(30 * time.Second))
		_, err = c.Read(make([]byte, 1))
		if waited := time.Since(start); !errors.Is(err, syscall.ECONNRESET) || waited < 1500*time.Millisecond {
			t.Fatalf("read on the held connection: %v after %v; want ECONNRESET after the 2s hold", err, waited.Round(time.Millisecond))
		}
		eventually(t, 10*time.Second, "the access log line with reason hold-timeout", func() error {
			for _, line := range strings.Split(proxy.LogTail(200), "\n") {
				if strings.Contains(line, "/short:http") && strings.Contains(line, "reason=hold-timeout") {
					return nil
				}
			}
			return errors.New("no access log line for the short service with reason=hold-timeout")
		})
	})
}
