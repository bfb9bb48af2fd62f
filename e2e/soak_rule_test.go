package e2e

// The chaos soak's rule: what each fault kind may cost, and the pure function that charges the
// failures a run recorded to the fault windows they were in flight during (soak_classify_test.go
// tables it).

import (
	"fmt"
	"slices"
	"time"
)

const (
	// soakKillWindow bounds a SIGKILL's window: how long after the kill a new attempt may still
	// fail. (An attempt made at once may itself end later: a SYN the dying socket dropped is
	// retransmitted a second later and then refused.) Failures of attempts begun within it are
	// the only ones excused without a count: the process that held the sockets is gone, and
	// nothing answers until the new one has opened them.
	soakKillWindow = time.Second

	// soakNatFlushMaxWindow bounds a nat flush's window, from `iptables -t nat -F` until every
	// rule of the test's Services (portal rules, and the kernel path's chains for a Service on
	// it) is back. The proxy's cheap canary check runs at every periodic sync
	// (--iptables-sync-period=1s), so the flush is seen within 1 s and repaired by that sync;
	// the second and third seconds are the repair itself (iptables-restore waits for the xtables
	// lock the other mode's proxy may hold) and the test's 100 ms poll on a shared 2-core
	// machine. A window past it means the repair waited for something else (the minute's full
	// read-back: issue 34 item 1).
	soakNatFlushMaxWindow = 3 * time.Second
	// soakNatFlushMaxFailures and soakNatFlushMaxLost bound what one nat flush may cost. While
	// the table is empty a new flow meets no DNAT: a SYN to a cluster IP is dropped or answered
	// host unreachable, one to the node port reaches the node-port holder, and conntrack pins
	// the flow untranslated, so its retransmits fail too after the repair. Each TCP client (three
	// short-connection clients and the stream's reconnect: 4) has one attempt in flight and is
	// blocked by it for soakTimeout, longer than the window, so it loses at most one; the UDP
	// client asks from a new socket once a second after a loss, so it loses at most one answer
	// per second of the window (3).
	soakNatFlushMaxFailures = 4
	soakNatFlushMaxLost     = 3

	// soakFDExhaustMaxWindow bounds a descriptor exhaustion's window: the 1.5 s the limit stays
	// cut and the two prlimit runs around it, each a fork and exec in the node namespace (the
	// window was 1.52-1.81 s in four short soaks at load 2-8; the rest is slack for a loaded
	// machine).
	soakFDExhaustMaxWindow = 3 * time.Second
	// soakFDExhaustMaxFailures and soakFDExhaustMaxLost bound what one exhaustion may cost: no
	// connection is refused (a connection waits in the accept queue until a descriptor frees),
	// but a dial that finds no descriptor backs off until its attempt's time is spent and then
	// resets its client (one each for the 4 TCP clients, blocked meanwhile), and a UDP datagram
	// that needs a new session socket is dropped (one lost answer per second of the window: 3).
	soakFDExhaustMaxFailures = 4
	soakFDExhaustMaxLost     = 3

	// soakEndpointChangeMaxLost bounds the UDP answers an endpoint change may lose: the sessions
	// of an endpoint that left the slice are closed at once (as kube-proxy deletes the conntrack
	// entries of a removed UDP endpoint), so the answer that endpoint was sending right then has
	// nowhere to go; the client asks again from a new socket, balanced over the endpoints left.
	// One query is in flight at a time and the change is applied in one sync: one answer. No
	// TCP connection may fail (the pod behind a removed endpoint still serves, and established
	// connections are left to end).
	soakEndpointChangeMaxLost = 1

	// soakPropagationMaxWindow bounds the windows that last until the proxy has applied an API
	// write (churn, terminating: the endpoints written are in use; datapath: the Service is on
	// the path written). Usually milliseconds, but after an API server or etcd restart
	// client-go's reflectors back off, 0.8 s doubling to 30 s with jitter up to 2x (60 s), and
	// the soak restarts the control plane every few faults (up to 22.5 s was measured).
	soakPropagationMaxWindow = 65 * time.Second
	// soakControlPlaneMaxWindow bounds an API server or etcd restart: the daemon killed, started
	// again on the same port and data and healthy (the framework's own start-up wait, 30 s).
	soakControlPlaneMaxWindow = 35 * time.Second
	// soakHandOverMaxWindow bounds a hand-over: the new process's start until the old one,
	// SIGTERMed once the new one holds the sockets, has exited (proxyStopGrace: the old process
	// waits up to --shutdown-timeout=10s for its connections).
	soakHandOverMaxWindow = proxyStopGrace
)

// soakRule is what one fault kind may cost.
type soakRule struct {
	// excusedFor: failures of attempts begun within this long of the fault's start are excused
	// (SIGKILL only); one begun later inside the window fails the run.
	excusedFor time.Duration
	// maxFailures: the failed requests and exchanges one window may be charged, and maxLost the
	// lost UDP answers beyond them; more fail the run.
	maxFailures, maxLost int
	// maxWindow: the longest a window may last, its start until the proxy serves as wanted again;
	// 0 means no bound of its own (a SIGKILL's is its excuse: a failure after soakKillWindow).
	maxWindow time.Duration
}

// soakRuleOf is the rule of a fault kind. API server and etcd restarts, hand-overs and data path
// switches may cost nothing: the data path does not depend on the control plane, a hand-over
// passes the listeners over, and a Service moved between paths keeps its established
// connections (the proxy socket is retired only after the kernel chains are in,
// TestDataPathSwitchesLive) and its UDP flows (only the entries redirected to the old proxy
// socket are cleared). Churn and pods turning terminating may lose one UDP answer, no more.
func soakRuleOf(kind string) soakRule {
	switch kind {
	case "sigkill":
		return soakRule{excusedFor: soakKillWindow}
	case "natflush":
		return soakRule{maxFailures: soakNatFlushMaxFailures, maxLost: soakNatFlushMaxLost, maxWindow: soakNatFlushMaxWindow}
	case "fdexhaust":
		return soakRule{maxFailures: soakFDExhaustMaxFailures, maxLost: soakFDExhaustMaxLost, maxWindow: soakFDExhaustMaxWindow}
	case "churn", "terminating":
		return soakRule{maxLost: soakEndpointChangeMaxLost, maxWindow: soakPropagationMaxWindow}
	case "datapath":
		return soakRule{maxWindow: soakPropagationMaxWindow}
	case "apiserver", "etcd":
		return soakRule{maxWindow: soakControlPlaneMaxWindow}
	case "handover":
		return soakRule{maxWindow: soakHandOverMaxWindow}
	}
	return soakRule{} // an unknown kind excuses nothing
}

// soakCharge is one window with what the run charged to it.
type soakCharge struct {
	window  soakWindow
	index   int           // its index among the windows of its kind
	charged []soakFailure // failures and lost answers in flight during it, counted against its bound
	excused []soakFailure // SIGKILL: those begun within soakKillWindow of the kill
	late    []soakFailure // SIGKILL: those begun after it, inside the window
}

// soakVerdict is the rule applied to a run: each window's charges, the failures in flight during
// no window, and every breach of a bound (the run fails when there is one).
type soakVerdict struct {
	charges  []soakCharge
	outside  []soakFailure
	breaches []string
}

// overBound reports whether the failures charged to a window break r.
func (r soakRule) overBound(charged []soakFailure) bool {
	lost := lostIn(charged)
	return r.excusedFor == 0 && (len(charged)-lost > r.maxFailures || len(charged) > r.maxFailures+r.maxLost)
}

// lostIn counts the lost UDP answers among fs.
func lostIn(fs []soakFailure) int {
	n := 0
	for _, f := range fs {
		if f.lost {
			n++
		}
	}
	return n
}

// overlaps reports whether a failure was in flight during a window (both ends included).
func (w soakWindow) overlaps(f soakFailure) bool {
	return !f.end.Before(w.from) && !f.start.After(w.to)
}

// classifySoak charges every failure (lost UDP answers included) to each window it was in flight
// during, never to only one of them: a failure inside a SIGKILL's excuse that also overlaps a
// nat flush counts against the flush's bound too, and one that overlaps a window allowed
// nothing (a hand-over, a churn) breaches that window's bound whatever else it overlaps. So no
// window's allowance can launder a failure another window, or no window, would not allow. A
// failure in flight during no window breaches the rule: nothing may fail between faults, a UDP
// answer included (the client and the pods are namespaces on one host joined by veth pairs, at a
// datagram every 20 ms: nothing drops one but the proxy or a fault).
func classifySoak(windows []soakWindow, failures []soakFailure) soakVerdict {
	var v soakVerdict
	seen := map[string]int{}
	for _, w := range windows {
		v.charges = append(v.charges, soakCharge{window: w, index: seen[w.kind]})
		seen[w.kind]++
	}
	for _, f := range failures {
		in := false
		for i := range v.charges {
			c := &v.charges[i]
			if !c.window.overlaps(f) {
				continue
			}
			in = true
			r := soakRuleOf(c.window.kind)
			switch {
			case r.excusedFor > 0 && f.start.Sub(c.window.from) < r.excusedFor:
				c.excused = append(c.excused, f)
			case r.excusedFor > 0:
				c.late = append(c.late, f)
			default:
				c.charged = append(c.charged, f)
			}
		}
		if !in {
			v.outside = append(v.outside, f)
		}
	}
	for _, c := range v.charges {
		r := soakRuleOf(c.window.kind)
		at := c.window.from.Format("15:04:05.000")
		if d := c.window.to.Sub(c.window.from); r.maxWindow > 0 && d > r.maxWindow {
			v.breaches = append(v.breaches, fmt.Sprintf("%s %d at %s lasted %v, bound %v",
				c.window.kind, c.index+1, at, d.Round(time.Millisecond), r.maxWindow))
		}
		if len(c.late) > 0 {
			last := slices.MaxFunc(c.late, func(a, b soakFailure) int { return a.start.Compare(b.start) })
			v.breaches = append(v.breaches, fmt.Sprintf("%s %d at %s: %d attempts begun %v or more after it failed (the last +%v), bound: none after %v",
				c.window.kind, c.index+1, at, len(c.late), r.excusedFor, last.start.Sub(c.window.from).Round(time.Millisecond), r.excusedFor))
		}
		if lost := lostIn(c.charged); r.overBound(c.charged) {
			v.breaches = append(v.breaches, fmt.Sprintf("%s %d at %s: %d failures and %d lost answers in flight during it, bound %d and %d more lost answers",
				c.window.kind, c.index+1, at, len(c.charged)-lost, lost, r.maxFailures, r.maxLost))
		}
	}
	if len(v.outside) > 0 {
		v.breaches = append(v.breaches, fmt.Sprintf("%d failures and lost answers in flight during no fault, bound 0", len(v.outside)))
	}
	return v
}
