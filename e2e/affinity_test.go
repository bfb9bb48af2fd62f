package e2e

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// TestClientIPAffinity checks sessionAffinity: ClientIP with a short timeoutSeconds: a client
// sticks to one pod while it keeps using it, another client gets its own pick, and the stick
// expires once the client has been idle for the timeout.
func TestClientIPAffinity(t *testing.T) {
	t.Parallel()
	const timeout = 3 * time.Second
	n := newClusterNode(t, 3)
	spec := webSpec(corev1.ServiceTypeClusterIP)
	spec.SessionAffinity = corev1.ServiceAffinityClientIP
	spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(int32(timeout / time.Second))}}
	svc := n.createService(t, "sticky", spec)
	n.setEndpoints(t, svc, 1, 2, 3)
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterTCP
	client, node := n.bed.Client, n.bed.Node

	var stuck string
	eventually(t, 30*time.Second, "the sticky service never answered", func() error {
		if err := proxy.exited(); err != nil {
			return err
		}
		var err error
		stuck, err = whoTCP(client, addr)
		return err
	})
	lastUse := time.Now()

	t.Run("a_client_sticks_to_one_pod", func(t *testing.T) {
		got := tally(t, whoTCP, client, addr, 9)
		lastUse = time.Now()
		if len(got) != 1 || got[stuck] != 9 {
			t.Fatalf("answers to the client pod: %v, want all 9 from %s", got, stuck)
		}
	})
	t.Run("another_client_gets_the_next_pod", func(t *testing.T) {
		got := tally(t, whoTCP, node, addr, 3)
		if len(got) != 1 || got[stuck] != 0 {
			t.Errorf("answers to the node: %v, want all 3 from one pod other than the client's %s", got, stuck)
		}
	})
	t.Run("the_stick_slides_while_the_client_keeps_using_it", func(t *testing.T) {
		// Requests every timeout/6 for 1.5 timeouts: each one renews the stick.
		tick := time.NewTicker(timeout / 6)
		defer tick.Stop()
		for end := time.Now().Add(timeout * 3 / 2); time.Now().Before(end); <-tick.C {
			who, err := whoTCP(client, addr)
			if err != nil {
				t.Fatalf("request to %s: %v", addr, err)
			}
			lastUse = time.Now()
			if who != stuck {
				t.Fatalf("answered by %s %v after the stick began, want %s (the timeout slides with use)", who, time.Since(end.Add(-timeout*3/2)).Round(time.Millisecond), stuck)
			}
		}
	})
	t.Run("the_stick_expires_after_timeoutSeconds_idle", func(t *testing.T) {
		// The timeout is real time in the proxy: wait until the client has been idle for it.
		waitUntil(t, lastUse.Add(timeout+300*time.Millisecond))
		who, err := whoTCP(client, addr)
		if err != nil {
			t.Fatalf("request to %s: %v", addr, err)
		}
		if who == stuck {
			t.Fatalf("answered by %s again after %v idle, want a new round-robin pick (timeoutSeconds %d)",
				who, time.Since(lastUse).Round(time.Millisecond), timeout/time.Second)
		}
		if got := tally(t, whoTCP, client, addr, 4); got[who] != 4 {
			t.Errorf("after the new pick %s: answers %v, want all 4 from %s", who, got, who)
		}
	})
}

// waitUntil blocks until the wall clock passes deadline (or the test ends): for timeouts the
// proxy measures in real time, the passing of time is the condition.
func waitUntil(t *testing.T, deadline time.Time) {
	t.Helper()
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-t.Context().Done():
		t.Fatal("test ended while waiting")
	}
}
