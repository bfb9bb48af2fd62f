package e2e

// A planned restart keeps ClientIP session affinity (issue #30): the hand-over carries the
// affinity table, so a client goes on to the pod it had. Address plan: the testbed's, plus
// twelve client addresses 172.30.0.10-21 on the client namespace's link (the node answers them
// over the same /24), a ClusterIP Service with sessionAffinity ClientIP on three pods.

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// whoFrom connects from ns, with source address src, to addr and returns the pod's greeting.
func whoFrom(ns *netns.NS, src netip.Addr, addr netip.AddrPort) (string, error) {
	var c net.Conn
	err := ns.Do(func() error {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: requestTimeout}
		var err error
		c, err = d.Dial("tcp", addr.String())
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(requestTimeout))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("greeting from %s to %s: %w", addr, src, err)
	}
	return strings.TrimSpace(line), nil
}

// TestHandOverKeepsAffinity: twelve clients of a ClientIP Service each stick to a pod; after a
// hand-over (new process with the same flags, SIGTERM to the old one) every client must land on
// the same pod as before. Without the table a new process places them anew, round robin over
// three pods: asked in the same order they could all land where they were (a third of the time,
// seen on main), so after the hand-over they ask in reverse order, which round robin cannot map
// onto the same pods for all twelve. Both TCP engines.
func TestHandOverKeepsAffinity(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{"epoll", "io_uring"} {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			n := newClusterNode(t, 3)
			spec := webSpec(corev1.ServiceTypeClusterIP)
			spec.SessionAffinity = corev1.ServiceAffinityClientIP
			svc := n.createService(t, "sticky", spec)
			n.setEndpoints(t, svc, 1, 2, 3)
			target := targetsOf(t, svc).clusterTCP
			var clients []netip.Addr
			for i := range 12 {
				c := netip.AddrFrom4([4]byte{172, 30, 0, byte(10 + i)})
				n.bed.Client.MustExec(t, "ip", "addr", "add", c.String()+"/24", "dev", "eth0")
				clients = append(clients, c)
			}
			flags := []string{"--handover-socket=" + filepath.Join(n.dir, "run", "handover.sock"), "--shutdown-timeout=10s", "--io-engine=" + engine}
			first := n.startProxy(t, flags...)
			first.waitAnswers(t, n.bed.Client, target, "the service never answered")

			before := map[netip.Addr]string{}
			pods := map[string]bool{}
			for _, c := range clients {
				for i := range 3 { // the first pick, then the table
					who, err := whoFrom(n.bed.Client, c, target)
					if err != nil {
						t.Fatalf("client %s: %v", c, err)
					}
					if i > 0 && who != before[c] {
						t.Fatalf("client %s moved from %s to %s before the hand-over: no affinity", c, before[c], who)
					}
					before[c] = who
				}
				pods[before[c]] = true
			}
			if len(pods) < 2 {
				t.Fatalf("the twelve clients all went to %v: the test cannot tell a kept table from chance", pods)
			}

			second := n.startProxy(t, flags...)
			second.waitTookOver(t)
			if err := first.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			select {
			case <-first.Done():
			case <-time.After(proxyStopGrace):
				t.Fatalf("the old proxy did not exit within %v of SIGTERM", proxyStopGrace)
			}

			moved := 0
			for _, c := range slices.Backward(clients) {
				who, err := whoFrom(n.bed.Client, c, target)
				if err != nil {
					t.Fatalf("client %s after the hand-over: %v", c, err)
				}
				if who != before[c] {
					moved++
					t.Errorf("client %s: %s before the hand-over, %s after", c, before[c], who)
				}
			}
			kept := lineWith(second.LogTail(2000), "Kept the predecessor's ClientIP affinity")
			t.Logf("%s: %d of %d clients kept their pod across the hand-over (pods before: %v); new process: %s", engine, len(clients)-moved, len(clients), pods, kept)
			// Twelve clients, and the prober's own address (waitAnswers) when it is still in use.
			keptN := -1
			if m := regexp.MustCompile(`\bkept=(\d+)\b`).FindStringSubmatch(kept); m != nil {
				keptN, _ = strconv.Atoi(m[1])
			}
			if keptN < len(clients) {
				t.Errorf("the new process did not keep the twelve clients' entries: %q", kept)
			}
		})
	}
}
