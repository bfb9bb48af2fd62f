package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/transparent"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// fakeSourceNode answers Sync from a queue of results (the last one repeats) and counts calls.
type fakeSourceNode struct {
	mu      sync.Mutex
	results []error
	calls   int
	bridge  bool
}

func (f *fakeSourceNode) Sync(context.Context) (transparent.Support, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	err := f.results[min(f.calls, len(f.results))-1]
	return transparent.Support{Bridge: f.bridge}, err
}

func (f *fakeSourceNode) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

var (
	podClient   = netip.MustParseAddr("10.244.1.10")
	remotePod   = netip.MustParseAddr("10.244.2.20")
	noLocalAddr = func() []netip.Addr { return []netip.Addr{netip.MustParseAddr("10.244.1.1")} }
)

func TestResolveSource(t *testing.T) {
	errNoSocket := errors.New("mangle KUBE-PORTALS-TRANSPARENT: -m socket: no xt_socket")
	t.Run("proxy installs nothing", func(t *testing.T) {
		node := &fakeSourceNode{results: []error{nil}}
		s, err := resolveSource(t.Context(), &Options{sourceMode: "proxy"}, node, noLocalAddr, logrus.New())
		if err != nil || s.mode != service.SourceProxy || s.policy != nil || node.count() != 0 {
			t.Fatalf("mode %q policy %v calls %d err %v, want proxy, no policy, no Sync", s.mode, s.policy, node.count(), err)
		}
	})
	t.Run("auto on a node that cannot: proxy, one warning saying why", func(t *testing.T) {
		log, hook := logtest.NewNullLogger()
		s, err := resolveSource(t.Context(), &Options{sourceMode: "auto"}, &fakeSourceNode{results: []error{errNoSocket}}, noLocalAddr, log)
		if err != nil || s.mode != service.SourceProxy || !strings.Contains(s.why, "no xt_socket") {
			t.Fatalf("mode %q why %q err %v, want proxy because of xt_socket", s.mode, s.why, err)
		}
		if len(hook.Entries) != 1 || hook.LastEntry().Level != logrus.WarnLevel {
			t.Errorf("log %v, want one warning", hook.Entries)
		}
	})
	t.Run("transparent on a node that cannot: the start fails", func(t *testing.T) {
		_, err := resolveSource(t.Context(), &Options{sourceMode: "transparent"}, &fakeSourceNode{results: []error{errNoSocket}}, noLocalAddr, logrus.New())
		if !errors.Is(err, errNoSocket) || !strings.Contains(err.Error(), "--source-mode=transparent") {
			t.Fatalf("err %v, want the probe's error under --source-mode=transparent", err)
		}
	})
	t.Run("auto on a node that can: the policy follows --node-pod-cidr", func(t *testing.T) {
		o := &Options{sourceMode: "auto", nodePodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")}}
		s, err := resolveSource(t.Context(), o, &fakeSourceNode{results: []error{nil}}, noLocalAddr, logrus.New())
		if err != nil || s.mode != service.SourceTransparent || s.policy == nil {
			t.Fatalf("mode %q err %v, want transparent", s.mode, err)
		}
		if !s.policy.Transparent(podClient, remotePod) {
			t.Error("a pod of this node to a pod of another: not transparent")
		}
		s.setNode(&v1.Node{Spec: v1.NodeSpec{PodCIDRs: []string{"10.244.9.0/24"}}})
		if !s.policy.Transparent(podClient, remotePod) {
			t.Error("the Node's podCIDRs replaced --node-pod-cidr")
		}
	})
	t.Run("without --node-pod-cidr the Node's podCIDRs apply", func(t *testing.T) {
		s, err := resolveSource(t.Context(), &Options{sourceMode: "auto"}, &fakeSourceNode{results: []error{nil}}, noLocalAddr, logrus.New())
		if err != nil {
			t.Fatal(err)
		}
		if s.policy.Transparent(podClient, remotePod) {
			t.Fatal("transparent before the pod CIDRs are known")
		}
		s.setNode(&v1.Node{Spec: v1.NodeSpec{PodCIDR: "10.244.1.0/24"}})
		if !s.policy.Transparent(podClient, remotePod) {
			t.Error("spec.podCIDR not taken")
		}
	})
}

// steppedSourceNode hands each Sync's result over a channel: a Sync that starts has seen the
// previous one's result applied (run applies it before waiting for the next tick).
type steppedSourceNode struct {
	started chan struct{}
	results chan error
}

func (f *steppedSourceNode) Sync(ctx context.Context) (transparent.Support, error) {
	select {
	case f.started <- struct{}{}:
	case <-ctx.Done():
		return transparent.Support{}, ctx.Err()
	}
	select {
	case err := <-f.results:
		return transparent.Support{}, err
	case <-ctx.Done():
		return transparent.Support{}, ctx.Err()
	}
}

// TestSourceRepair: the periodic Sync repairs the plumbing; while it fails the policy says no
// (the replies would not come back), and it says yes again once repaired. A lasting failure is
// logged once.
func TestSourceRepair(t *testing.T) {
	broken := errors.New("ip rule: operation not permitted")
	o := &Options{sourceMode: "auto", nodePodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")}, syncPeriod: time.Millisecond}
	log, hook := logtest.NewNullLogger()
	s, err := resolveSource(t.Context(), o, &fakeSourceNode{results: []error{nil}}, noLocalAddr, log)
	if err != nil {
		t.Fatal(err)
	}
	node := &steppedSourceNode{started: make(chan struct{}), results: make(chan error)}
	s.node = node
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); s.run(ctx, noLocalAddr) }()
	defer func() { cancel(); <-done }()
	seq := []struct {
		err  error
		want bool
	}{{broken, false}, {broken, false}, {nil, true}}
	<-node.started
	for i, st := range seq {
		node.results <- st.err
		<-node.started
		if got := s.policy.Transparent(podClient, remotePod); got != st.want {
			t.Fatalf("step %d, after a Sync returning %v: transparent %v, want %v", i, st.err, got, st.want)
		}
	}
	errorsLogged := 0
	for _, e := range hook.AllEntries() {
		if e.Level == logrus.ErrorLevel {
			errorsLogged++
		}
	}
	if errorsLogged != 1 {
		t.Errorf("%d error lines for one lasting failure, want 1", errorsLogged)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failures != 2 {
		t.Errorf("failures = %d, want 2", s.failures)
	}
}

// TestSourceModeOptions: --source-mode and --node-pod-cidr, their config file fields, errors and
// --write-config-to.
func TestSourceModeOptions(t *testing.T) {
	const head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	tests := []struct {
		name     string
		file     string
		args     []string
		want     string
		wantPods string
		wantErr  string
	}{
		{name: "default_is_auto", want: "auto"},
		{name: "flag", args: []string{"--source-mode=proxy"}, want: "proxy"},
		{name: "file", file: head + "sourceMode: transparent\nnodePodCIDR: 10.244.1.0/24, fd00:1::/64\n", want: "transparent", wantPods: "[10.244.1.0/24 fd00:1::/64]"},
		{name: "flag_overrides_file", file: head + "sourceMode: transparent\n", args: []string{"--source-mode=proxy"}, want: "proxy"},
		{name: "bad_flag", args: []string{"--source-mode=client"}, wantErr: "--source-mode: must be auto, proxy or transparent"},
		{name: "bad_file_value", file: head + "sourceMode: 3\n", wantErr: "sourceMode: want auto, proxy or transparent"},
		{name: "bad_cidr", args: []string{"--node-pod-cidr=10.244.1.0"}, wantErr: "--node-pod-cidr"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := tt.args
			if tt.file != "" {
				args = append([]string{"--config=" + writeTemp(t, "config.yaml", tt.file)}, args...)
			}
			o, _, err := parseOptions(args)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseOptions(%v) error %v, want one containing %q", args, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.sourceMode != tt.want {
				t.Errorf("source mode %q, want %q", o.sourceMode, tt.want)
			}
			if tt.wantPods != "" && fmt.Sprint(o.nodePodCIDRs) != tt.wantPods {
				t.Errorf("node pod CIDRs %v, want %s", o.nodePodCIDRs, tt.wantPods)
			}
		})
	}
	t.Run("written_config_reads_back", func(t *testing.T) {
		o, _, err := parseOptions([]string{"--source-mode=proxy", "--node-pod-cidr=10.244.1.0/24"})
		if err != nil {
			t.Fatal(err)
		}
		data, err := marshalConfig(o)
		if err != nil {
			t.Fatal(err)
		}
		back, _, err := parseOptions([]string{"--config=" + writeTemp(t, "back.yaml", string(data))})
		if err != nil || back.sourceMode != "proxy" || back.nodePodCIDR != "10.244.1.0/24" {
			t.Errorf("read back: %q %q, %v from\n%s", back.sourceMode, back.nodePodCIDR, err, data)
		}
	})
}
