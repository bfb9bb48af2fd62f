package udp

import (
	"context"
	"errors"
	"net/netip"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// fakeRunner records command lines and answers with canned results keyed by the joined line.
type fakeRunner struct {
	cmds    []string
	results map[string]runResult
}

type runResult struct {
	out []byte
	err error
}

func (r *fakeRunner) Run(_ context.Context, name string, args ...string) ([]byte, error) {
	line := strings.Join(append([]string{name}, args...), " ")
	r.cmds = append(r.cmds, line)
	res := r.results[line]
	return res.out, res.err
}

// exitError returns a real *exec.ExitError with the given status.
func exitError(t *testing.T, status string) error {
	t.Helper()
	err := exec.Command("sh", "-c", "exit "+status).Run()
	if _, ok := errors.AsType[*exec.ExitError](err); !ok {
		t.Fatalf("sh exit %s: %v", status, err)
	}
	return err
}

func TestFlowsOf_allAddressesOfThePort(t *testing.T) {
	p := &service.Port{
		Protocol:        service.UDP,
		Port:            53,
		NodePort:        30053,
		ClusterIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00::a")},
		ExternalIPs:     []netip.Addr{netip.MustParseAddr("192.0.2.7")},
		LoadBalancerIPs: []netip.Addr{netip.MustParseAddr("198.51.100.1"), netip.MustParseAddr("192.0.2.7")},
	}
	want := Flows{
		Addrs: []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("192.0.2.7"),
			netip.MustParseAddr("198.51.100.1"), netip.MustParseAddr("fd00::a")},
		Port: 53, NodePort: 30053,
	}
	if got := FlowsOf(p); !reflect.DeepEqual(got, want) {
		t.Errorf("FlowsOf (-want +got):\n-%+v\n+%+v", want, got)
	}
}

func TestExecConntrack_ClearUDP(t *testing.T) {
	v4, v6 := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00::a")
	ext := netip.MustParseAddr("192.0.2.7")
	tests := []struct {
		name    string
		flows   Flows
		results map[string]runResult
		want    []string
		wantErr string
	}{{
		name:  "cluster and external IPs and a node port",
		flows: Flows{Addrs: []netip.Addr{v4, ext}, Port: 53, NodePort: 30053},
		want: []string{
			"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53",
			"conntrack -D -f ipv4 -p udp --orig-dst 192.0.2.7 --orig-port-dst 53",
			"conntrack -D -f ipv4 -p udp --orig-port-dst 30053",
		},
	}, {
		name:  "dual stack node port clears both families",
		flows: Flows{Addrs: []netip.Addr{v4, v6}, Port: 53, NodePort: 30053},
		want: []string{
			"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53",
			"conntrack -D -f ipv6 -p udp --orig-dst fd00::a --orig-port-dst 53",
			"conntrack -D -f ipv4 -p udp --orig-port-dst 30053",
			"conntrack -D -f ipv6 -p udp --orig-port-dst 30053",
		},
	}, {
		name:  "node port alone defaults to IPv4",
		flows: Flows{NodePort: 30053},
		want:  []string{"conntrack -D -f ipv4 -p udp --orig-port-dst 30053"},
	}, {
		name:  "no matching entries is success",
		flows: Flows{Addrs: []netip.Addr{v4}, Port: 53},
		results: map[string]runResult{
			"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53": {
				out: []byte("conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"),
				err: exitError(t, "1"),
			},
		},
		want: []string{"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53"},
	}, {
		name:  "a failure does not stop the other deletions",
		flows: Flows{Addrs: []netip.Addr{v4, ext}, Port: 53},
		results: map[string]runResult{
			"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53": {
				out: []byte("conntrack v1.4.7 (conntrack-tools): Operation failed: Operation not permitted\n"),
				err: exitError(t, "1"),
			},
		},
		want: []string{
			"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53",
			"conntrack -D -f ipv4 -p udp --orig-dst 192.0.2.7 --orig-port-dst 53",
		},
		wantErr: "Operation not permitted",
	}, {
		name:  "a missing tool is an error",
		flows: Flows{Addrs: []netip.Addr{v4}, Port: 53},
		results: map[string]runResult{
			"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53": {err: exec.ErrNotFound},
		},
		want:    []string{"conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53"},
		wantErr: "executable file not found",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRunner{results: tt.results}
			err := ExecConntrack{Runner: r}.ClearUDP(context.Background(), tt.flows)
			if !reflect.DeepEqual(r.cmds, tt.want) {
				t.Errorf("commands (-want +got):\n-%s\n+%s", strings.Join(tt.want, "\n-"), strings.Join(r.cmds, "\n+"))
			}
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("ClearUDP: %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("ClearUDP: %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestFakeConntrack_Dump(t *testing.T) {
	f := &FakeConntrack{}
	f.ClearUDP(context.Background(), Flows{Addrs: []netip.Addr{netip.MustParseAddr("fd00::a"),
		netip.MustParseAddr("10.96.0.10")}, Port: 53, NodePort: 30053})
	want := "udp 10.96.0.10:53\nudp [fd00::a]:53\nudp nodeport 30053"
	if got := f.Dump(); got != want {
		t.Errorf("Dump() (-want +got):\n-%s\n+%s", want, got)
	}
}
