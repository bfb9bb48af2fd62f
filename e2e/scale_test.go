package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// Bounds of the load loop: it stops at whichever comes first.
const (
	loadMaxRequests = 4000
	loadMaxDuration = 90 * time.Second
	loadPace        = 5 * time.Millisecond
	// settleWindow is how many requests in a row must match a phase's endpoints: the load runs
	// on each set of endpoints for a while, not just until the first match.
	settleWindow = 40
)

// TestEndpointsScaledUnderLoad changes a service's endpoints while a client keeps opening
// connections to it: no request fails, new endpoints get traffic, removed ones stop getting it,
// and a connection already open to a surviving endpoint keeps working through every change.
func TestEndpointsScaledUnderLoad(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 3)
	svc := n.createService(t, "scaled", webSpec(corev1.ServiceTypeClusterIP))
	phases := []struct {
		name string
		pods []int
	}{
		{"initial", []int{1, 2}},
		{"scale_up", []int{1, 2, 3}},
		{"scale_down", []int{1, 3}},
		{"scale_down_to_one", []int{1}},
		{"scale_up_again", []int{1, 2}},
	}
	n.setEndpoints(t, svc, phases[0].pods...)
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterTCP
	proxy.waitAnswers(t, n.bed.Client, addr, "the service never answered")

	// pod1 survives every phase: keep a connection to it open throughout.
	kept := dialPod(t, n.bed.Client, addr, "pod1", 4)
	load := startLoad(t, n.bed.Client, addr)

	for i, ph := range phases {
		if i > 0 {
			load.setPhase(i)
			n.setEndpoints(t, svc, ph.pods...)
		}
		want := podNames(ph.pods...)
		if err := testbed.Eventually(t.Context(), 20*time.Second, 100*time.Millisecond, func() error {
			return load.settled(i, want)
		}); err != nil {
			t.Fatalf("phase %s: traffic never settled on %v: %v%s", ph.name, want, err, firstFailures(load.failures()))
		}
		if failed := load.failures(); len(failed) > 0 {
			t.Fatalf("phase %s: requests failed, want none:%s", ph.name, firstFailures(failed))
		}
		if err := kept.echo(fmt.Sprintf("after %s", ph.name)); err != nil {
			t.Fatalf("phase %s: the connection kept open to pod1 broke: %v", ph.name, err)
		}
	}
	results := load.stop()
	if failed := load.failures(); len(failed) > 0 {
		t.Errorf("requests failed after the last phase, want none:%s", firstFailures(failed))
	}

	// A request started in phase i may still find the proxy on phase i-1's endpoints, never on others.
	for _, r := range results {
		if r.err != nil {
			continue
		}
		allowed := podNames(phases[r.phase].pods...)
		if r.phase > 0 {
			allowed = append(allowed, podNames(phases[r.phase-1].pods...)...)
		}
		if !slices.Contains(allowed, r.who) {
			t.Errorf("request in phase %s answered by %s, want one of %v", phases[r.phase].name, r.who, allowed)
		}
	}
	t.Logf("%d requests over %d phases, %v", len(results), len(phases), results[len(results)-1].at.Sub(results[0].at).Round(time.Millisecond))
}

// firstFailures formats up to ten failed requests for a message.
func firstFailures(failed []string) string {
	if len(failed) == 0 {
		return ""
	}
	return fmt.Sprintf("\n%d failed requests, the first ones:\n%s", len(failed), strings.Join(failed[:min(len(failed), 10)], "\n"))
}

// keptConn is a connection to one pod through the portal that stays open.
type keptConn struct {
	c net.Conn
	r *bufio.Reader
}

// dialPod opens connections to addr until one is answered by pod (at most tries), closing the
// others.
func dialPod(t *testing.T, from *netns.NS, addr netip.AddrPort, pod string, tries int) *keptConn {
	t.Helper()
	for range tries {
		c, err := dialTCP(from, addr)
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		r := bufio.NewReader(c)
		_ = c.SetReadDeadline(time.Now().Add(requestTimeout))
		greeting, err := r.ReadString('\n')
		if err != nil {
			c.Close()
			t.Fatalf("greeting from %s: %v", addr, err)
		}
		if strings.TrimSpace(greeting) == pod {
			t.Cleanup(func() { c.Close() })
			return &keptConn{c: c, r: r}
		}
		c.Close()
	}
	t.Fatalf("no connection to %s landed on %s in %d tries", addr, pod, tries)
	return nil
}

// echo sends a line and expects it back.
func (k *keptConn) echo(msg string) error {
	_ = k.c.SetDeadline(time.Now().Add(requestTimeout))
	if _, err := fmt.Fprintf(k.c, "%s\n", msg); err != nil {
		return err
	}
	got, err := k.r.ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(got) != msg {
		return fmt.Errorf("echo %q, got %q", msg, got)
	}
	return nil
}

// load opens one connection after another to a service from a client namespace, recording who
// answered each, until stopped or its bounds are reached.
type load struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	phase   int
	results []loadResult
}

type loadResult struct {
	at    time.Time
	phase int // the phase when the request started
	who   string
	err   error
}

func startLoad(t *testing.T, from *netns.NS, addr netip.AddrPort) *load {
	ctx, cancel := context.WithTimeout(context.Background(), loadMaxDuration)
	l := &load{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(l.done)
		pace := time.NewTicker(loadPace)
		defer pace.Stop()
		for range loadMaxRequests {
			l.mu.Lock()
			phase := l.phase
			l.mu.Unlock()
			who, err := whoTCP(from, addr)
			l.mu.Lock()
			l.results = append(l.results, loadResult{at: time.Now(), phase: phase, who: who, err: err})
			l.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-pace.C:
			}
		}
	}()
	t.Cleanup(func() { l.stop() })
	return l
}

func (l *load) setPhase(p int) {
	l.mu.Lock()
	l.phase = p
	l.mu.Unlock()
}

// settled reports whether the latest requests of phase (at least settleWindow, and two rounds
// over want) were all answered by, and covered exactly, the pods in want.
func (l *load) settled(phase int, want []string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	window := max(settleWindow, 2*len(want))
	var recent []string
	for i := len(l.results) - 1; i >= 0 && len(recent) < window && l.results[i].phase == phase; i-- {
		recent = append(recent, l.results[i].who)
	}
	if len(recent) < window {
		return fmt.Errorf("only %d requests in this phase so far", len(recent))
	}
	got := slices.Compact(slices.Sorted(slices.Values(recent)))
	if !slices.Equal(got, want) {
		return fmt.Errorf("the last %d requests were answered by %v", window, got)
	}
	return nil
}

// failures describes the failed requests so far.
func (l *load) failures() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for i, r := range l.results {
		if r.err != nil {
			out = append(out, fmt.Sprintf("request %d (phase %d, %s): %v", i+1, r.phase, r.at.Format("15:04:05.000"), r.err))
		}
	}
	return out
}

// stop ends the loop and returns every result.
func (l *load) stop() []loadResult {
	l.cancel()
	<-l.done
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.results)
}
