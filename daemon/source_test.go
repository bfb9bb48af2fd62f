package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/transparent"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// steppedSourceNode hands each Sync's result over a channel, so a test sees the state between
// two Syncs: a Sync that starts has seen the previous one's result applied.
type steppedSourceNode struct {
	installed bool
	changed   atomic.Bool // BridgesChanged's answer
	started   chan struct{}
	results   chan error
}

func newSteppedSourceNode(installed bool) *steppedSourceNode {
	return &steppedSourceNode{installed: installed, started: make(chan struct{}), results: make(chan error)}
}

func (f *steppedSourceNode) Installed(context.Context) bool { return f.installed }

func (f *steppedSourceNode) BridgesChanged(context.Context) bool { return f.changed.Load() }

// TestSourceSyncsWhenABridgeAppears: a bridge that gains its first port (cni0 with the first
// pod) is synced within bridgeCheck, not at the next sync period (here an hour).
func TestSourceSyncsWhenABridgeAppears(t *testing.T) {
	o := &Options{sourceMode: "auto", nodePodCIDRs: podCIDRs, syncPeriod: time.Hour}
	node := newSteppedSourceNode(false)
	s := resolveSource(t.Context(), o, node, noLocalAddr, logrus.New())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); s.run(ctx, noLocalAddr) }()
	defer func() { cancel(); <-done }()
	<-node.started
	node.results <- nil // the first Sync, at once
	node.changed.Store(true)
	select {
	case <-node.started:
		node.changed.Store(false)
		node.results <- nil
	case <-time.After(10 * bridgeCheck):
		t.Fatalf("no Sync within %v of a bridge change (sync period %v)", 10*bridgeCheck, o.syncPeriod)
	}
}

func (f *steppedSourceNode) Sync(ctx context.Context) (transparent.Support, error) {
	select {
	case f.started <- struct{}{}:
	case <-ctx.Done():
		return transparent.Support{}, ctx.Err()
	}
	select {
	case err := <-f.results:
		return transparent.Support{NoBridges: true}, err
	case <-ctx.Done():
		return transparent.Support{}, ctx.Err()
	}
}

var (
	podClient   = netip.MustParseAddr("10.244.1.10")
	remotePod   = netip.MustParseAddr("10.244.2.20")
	noLocalAddr = func() []netip.Addr { return []netip.Addr{netip.MustParseAddr("10.244.1.1")} }
	podCIDRs    = []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")}
)

// sourceMetric is the mode and reason kube_portal_proxy_source_mode shows.
func sourceMetric(t *testing.T, s *sourceSetup) string {
	t.Helper()
	ch := make(chan prometheus.Metric, 4)
	s.collector().Collect(ch)
	close(ch)
	for m := range ch {
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		if len(pb.Label) == 2 {
			return pb.Label[0].GetValue() + ": " + pb.Label[1].GetValue()
		}
	}
	return ""
}

// TestResolveSource: resolving the mode runs nothing on the node (the start must not wait for
// iptables); the policy is on at once only where a predecessor's plumbing is in place.
func TestResolveSource(t *testing.T) {
	t.Run("proxy installs nothing", func(t *testing.T) {
		s := resolveSource(t.Context(), &Options{sourceMode: "proxy"}, newSteppedSourceNode(true), noLocalAddr, logrus.New())
		if s.mode != service.SourceProxy || s.policy != nil || s.node != nil {
			t.Fatalf("mode %q policy %v node %v, want proxy and nothing to run", s.mode, s.policy, s.node)
		}
		if got := sourceMetric(t, s); got != "proxy: the node runs with --source-mode=proxy" {
			t.Errorf("metric %q", got)
		}
	})
	t.Run("a fresh node: ports ask for transparent, the policy waits for the first Sync", func(t *testing.T) {
		s := resolveSource(t.Context(), &Options{sourceMode: "auto", nodePodCIDRs: podCIDRs}, newSteppedSourceNode(false), noLocalAddr, logrus.New())
		if s.mode != service.SourceTransparent || s.policy.Transparent(podClient, remotePod) {
			t.Fatalf("mode %q, transparent before any Sync: %v", s.mode, s.policy.Transparent(podClient, remotePod))
		}
		if got := sourceMetric(t, s); got != "proxy: not installed yet" {
			t.Errorf("metric %q", got)
		}
	})
	t.Run("a restart finds the plumbing: on at once", func(t *testing.T) {
		s := resolveSource(t.Context(), &Options{sourceMode: "auto", nodePodCIDRs: podCIDRs}, newSteppedSourceNode(true), noLocalAddr, logrus.New())
		if !s.policy.Transparent(podClient, remotePod) {
			t.Fatal("not transparent with the predecessor's plumbing in place")
		}
		if got := sourceMetric(t, s); got != "transparent: " {
			t.Errorf("metric %q", got)
		}
	})
	t.Run("without --node-pod-cidr the Node's podCIDRs apply", func(t *testing.T) {
		s := resolveSource(t.Context(), &Options{sourceMode: "auto"}, newSteppedSourceNode(true), noLocalAddr, logrus.New())
		if s.policy.Transparent(podClient, remotePod) {
			t.Fatal("transparent before the pod CIDRs are known")
		}
		s.setNode(&v1.Node{Spec: v1.NodeSpec{PodCIDR: "10.244.1.0/24"}})
		if !s.policy.Transparent(podClient, remotePod) {
			t.Error("spec.podCIDR not taken")
		}
		s.setNode(&v1.Node{Spec: v1.NodeSpec{PodCIDRs: []string{"10.244.9.0/24"}}})
		if s.policy.Transparent(podClient, remotePod) {
			t.Error("spec.podCIDRs not followed")
		}
	})
	t.Run("--node-pod-cidr wins over the Node", func(t *testing.T) {
		s := resolveSource(t.Context(), &Options{sourceMode: "auto", nodePodCIDRs: podCIDRs}, newSteppedSourceNode(true), noLocalAddr, logrus.New())
		s.setNode(&v1.Node{Spec: v1.NodeSpec{PodCIDRs: []string{"10.244.9.0/24"}}})
		if !s.policy.Transparent(podClient, remotePod) {
			t.Error("the Node's podCIDRs replaced --node-pod-cidr")
		}
	})
}

// TestSourceRun: run installs at once and repairs every period; while a Sync fails the policy
// says no (the replies would not come back) and the metric says why; a lasting failure is logged
// once; --source-mode=transparent makes the failure an error, auto a warning.
func TestSourceRun(t *testing.T) {
	broken := errors.New("reply mark (nft table inet kube-portal-proxy): no nft socket expression")
	for _, tc := range []struct {
		mode      string
		installed bool
		level     logrus.Level // of the first failure's line
	}{
		{"auto", false, logrus.WarnLevel},
		{"transparent", false, logrus.ErrorLevel},
		{"auto", true, logrus.ErrorLevel}, // a repair that fails: an error whatever the mode
	} {
		t.Run(fmt.Sprintf("%s installed=%v", tc.mode, tc.installed), func(t *testing.T) {
			o := &Options{sourceMode: tc.mode, nodePodCIDRs: podCIDRs, syncPeriod: time.Millisecond}
			log, hook := logtest.NewNullLogger()
			node := newSteppedSourceNode(tc.installed)
			s := resolveSource(t.Context(), o, node, noLocalAddr, log)
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan struct{})
			go func() { defer close(done); s.run(ctx, noLocalAddr) }()
			defer func() { cancel(); <-done }()
			<-node.started
			for i, st := range []struct {
				err    error
				want   bool
				metric string
			}{
				{broken, false, "proxy: the node cannot: " + broken.Error()},
				{broken, false, "proxy: the node cannot: " + broken.Error()},
				{nil, true, "transparent: "},
				{broken, false, "proxy: the node cannot: " + broken.Error()},
			} {
				node.results <- st.err
				<-node.started // the next Sync began: the result above is applied
				if got := s.policy.Transparent(podClient, remotePod); got != st.want {
					t.Fatalf("step %d, after a Sync returning %v: transparent %v, want %v", i, st.err, got, st.want)
				}
				if got := sourceMetric(t, s); got != st.metric {
					t.Errorf("step %d: metric %q, want %q", i, got, st.metric)
				}
			}
			var levels []logrus.Level
			for _, e := range hook.AllEntries() {
				if e.Level <= logrus.WarnLevel {
					levels = append(levels, e.Level)
				}
			}
			// The first failure (logged once for two Syncs), then the failure after a repair.
			if want := []logrus.Level{tc.level, logrus.ErrorLevel}; fmt.Sprint(levels) != fmt.Sprint(want) {
				t.Errorf("warning and error lines %v, want %v", levels, want)
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.failures != 3 {
				t.Errorf("failures = %d, want 3", s.failures)
			}
		})
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
