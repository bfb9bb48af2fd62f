package proxier

import (
	"errors"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestSourceModes: the source mode each port gets from the node's mode, the annotation and the
// PROXY protocol, and the errors a Service that asks for what it cannot have gets.
func TestSourceModes(t *testing.T) {
	annotated := func(kv ...string) func(*v1.Service) {
		return func(s *v1.Service) {
			s.Annotations = map[string]string{}
			for i := 0; i+1 < len(kv); i += 2 {
				s.Annotations[kv[i]] = kv[i+1]
			}
		}
	}
	tests := []struct {
		name     string
		node     service.SourceMode
		mutate   func(*v1.Service)
		want     []service.SourceMode // per port: TCP, UDP
		wantErrs []string
	}{
		{"node proxy, no annotation", service.SourceProxy, nil,
			[]service.SourceMode{service.SourceProxy, service.SourceProxy}, nil},
		{"node unset means proxy", "", nil,
			[]service.SourceMode{service.SourceProxy, service.SourceProxy}, nil},
		{"node transparent, no annotation", service.SourceTransparent, nil,
			[]service.SourceMode{service.SourceTransparent, service.SourceTransparent}, nil},
		{"node transparent, the Service opts out", service.SourceTransparent, annotated(AnnotationSourceMode, "proxy"),
			[]service.SourceMode{service.SourceProxy, service.SourceProxy}, nil},
		{"node proxy, the Service asks: reported once", service.SourceProxy, annotated(AnnotationSourceMode, " transparent "),
			[]service.SourceMode{service.SourceProxy, service.SourceProxy}, []string{"source mode transparent: the node runs with --source-mode=proxy"}},
		{"bad value: the node's", service.SourceTransparent, annotated(AnnotationSourceMode, "client"),
			[]service.SourceMode{service.SourceTransparent, service.SourceTransparent}, []string{`source-mode="client": want transparent or proxy`}},
		{"PROXY protocol by default: proxy, silently", service.SourceTransparent, annotated(AnnotationProxyProtocol, "v2"),
			[]service.SourceMode{service.SourceProxy, service.SourceTransparent}, []string{"ignored on a UDP port"}},
		{"PROXY protocol and transparent asked: the header wins, reported", service.SourceTransparent,
			annotated(AnnotationProxyProtocol, "v1", AnnotationSourceMode, "transparent"),
			[]service.SourceMode{service.SourceProxy, service.SourceTransparent}, []string{"ignored on a UDP port", "source mode transparent and a PROXY protocol header"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := &Config{SourceMode: tc.node}
			svc := makeService("default", "web", "10.96.0.10", tc.mutate, tcpPort("http", 80), udpPort("dns", 53))
			ports, errs := c.servicePorts(svc)
			if len(ports) != len(tc.want) {
				t.Fatalf("%d ports, want %d", len(ports), len(tc.want))
			}
			for i, p := range ports {
				if p.SourceMode != tc.want[i] {
					t.Errorf("port %s: source mode %q, want %q", p.Name, p.SourceMode, tc.want[i])
				}
			}
			if len(errs) != len(tc.wantErrs) {
				t.Fatalf("errors %v, want %d matching %q", errs, len(tc.wantErrs), tc.wantErrs)
			}
			for i, err := range errs {
				if !strings.Contains(err.Error(), tc.wantErrs[i]) || !errors.Is(err, ErrInvalidAnnotation) {
					t.Errorf("error %d = %v, want one containing %q and wrapping ErrInvalidAnnotation", i, err, tc.wantErrs[i])
				}
			}
		})
	}
	t.Run("a node that cannot says why", func(t *testing.T) {
		c := &Config{SourceMode: service.SourceProxy, SourceWhy: "the node cannot: no xt_socket"}
		_, errs := c.servicePorts(makeService("default", "web", "10.96.0.10", annotated(AnnotationSourceMode, "transparent"), tcpPort("http", 80)))
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "no xt_socket") {
			t.Errorf("errors %v, want the node's reason", errs)
		}
	})
}

// TestSourceModeChangeReopensTheSocket: a socket opened for one source mode cannot serve
// another (its dial differs), so a changed annotation gives the port a new socket.
func TestSourceModeChangeReopensTheSocket(t *testing.T) {
	a := &service.Port{Protocol: service.TCP, Port: 80, SourceMode: service.SourceProxy}
	b := *a
	b.SourceMode = service.SourceTransparent
	if a.SocketEqual(&b) {
		t.Error("SocketEqual ignores the source mode")
	}
}
