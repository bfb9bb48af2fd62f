package main

// churn.go is -cluster's steady churn: -churn-rate EndpointSlice changes a second, each to a random
// bulk service (one endpoint's address replaced), stamped with the annotation the EndpointSlice
// controller sets (endpoints.kubernetes.io/last-change-trigger-time: when the change that caused
// the update happened), from which both kube-proxy and the daemon compute their
// network_programming_duration_seconds. Beside it, a probe measures the same latency from outside,
// as a user sees it: the churn probe service's only endpoint moves to another real pod, and a
// client connects through its cluster IP every few milliseconds until the new pod answers. That
// service is not the cold start's probe (whose endpoints are all the pods): it starts each period
// with endpoints nobody answers on, so no answer can come from a state before the change.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// churnResult is one target's churn period.
type churnResult struct {
	sent, failed int             // bulk changes sent, and of those refused by the API server
	dropped      int             // ticks that found every sender busy (the API server was slow)
	probes       []time.Duration // probe change -> the new pod answers through the cluster IP
	lost         int             // probes whose pod never answered within probeLimit
}

const (
	probePoll  = 5 * time.Millisecond
	probeLimit = 15 * time.Second
	// probeGap separates one probe's success from the next probe change.
	probeGap = 200 * time.Millisecond
)

// churner changes EndpointSlices of the bulk namespace.
type churner struct {
	c        kubernetes.Interface
	n, eps   int
	probeIdx int // the churn probe service: bulk/s<probeIdx>; the churn leaves it and the next one alone
	seq      atomic.Int64
}

// jsonPatch is one RFC 6902 operation.
type jsonPatch struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// stamp is the trigger-time annotation op: the moment of the change, as the controller writes it.
func stamp(at time.Time) jsonPatch {
	return jsonPatch{Op: "add", Path: "/metadata/annotations",
		Value: map[string]string{corev1.EndpointsLastChangeTriggerTime: at.UTC().Format(time.RFC3339Nano)}}
}

func (ch *churner) patch(ctx context.Context, i int, ops ...jsonPatch) error {
	body, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("s%d-1", i)
	if _, err := ch.c.DiscoveryV1().EndpointSlices("bulk").Patch(ctx, name, types.JSONPatchType, body, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("endpointslice bulk/%s: %w", name, err)
	}
	return nil
}

// change replaces one endpoint of a random bulk service (not the probe's) by a new address.
func (ch *churner) change(ctx context.Context) error {
	i := rand.IntN(ch.n - 2) // the two probe services are the last two

	k := ch.seq.Add(1)
	addr := fmt.Sprintf("10.246.%d.%d", k/250%250, k%250+1)
	return ch.patch(ctx, i, stamp(time.Now()),
		jsonPatch{Op: "replace", Path: fmt.Sprintf("/endpoints/%d/addresses/0", rand.IntN(ch.eps)), Value: addr})
}

// probeEndpoints sets the churn probe service's endpoints to addrs (ready), stamped now.
func (ch *churner) probeEndpoints(ctx context.Context, addrs []string) (time.Time, error) {
	var eps []map[string]any
	for _, a := range addrs {
		eps = append(eps, map[string]any{"addresses": []string{a}, "conditions": map[string]bool{"ready": true}})
	}
	at := time.Now()
	return at, ch.patch(ctx, ch.probeIdx, stamp(at), jsonPatch{Op: "replace", Path: "/endpoints", Value: eps})
}

// run churns at rate changes a second for d, and probes meanwhile through the churn probe
// service's cluster IP from the bed's client. That service ends with the endpoints it was created
// with (addresses nobody answers on), so the next target starts from the same objects.
func (ch *churner) run(ctx context.Context, bed *testbed.Bed, vip netip.AddrPort, pods []netip.Addr, rate int, d time.Duration) (churnResult, error) {
	var r churnResult
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var mu sync.Mutex
	var wg sync.WaitGroup
	// A pool of senders, so a slow API response does not lower the rate; a tick that finds every
	// sender busy is counted as dropped rather than queued.
	work := make(chan struct{})
	for range 8 {
		wg.Go(func() {
			for range work {
				err := ch.change(ctx)
				mu.Lock()
				r.sent++
				if err != nil && ctx.Err() == nil {
					r.failed++
				}
				mu.Unlock()
			}
		})
	}
	wg.Go(func() {
		defer close(work)
		tick := time.NewTicker(time.Second / time.Duration(rate))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			select {
			case work <- struct{}{}:
			default:
				mu.Lock()
				r.dropped++
				mu.Unlock()
			}
		}
	})

	var probeErr error
	for k := 0; ctx.Err() == nil; k++ {
		pod := k % len(pods)
		at, err := ch.probeEndpoints(ctx, []string{pods[pod].String()})
		if err != nil {
			if ctx.Err() == nil {
				probeErr = err
			}
			break
		}
		want := fmt.Sprintf("pod%d", pod+1)
		lat, ok := waitAnswer(ctx, bed, vip, want, at)
		if ctx.Err() != nil {
			break // the period ended before this probe did: not a sample
		}
		if !ok {
			r.lost++
		} else {
			r.probes = append(r.probes, lat)
		}
		select {
		case <-ctx.Done():
		case <-time.After(probeGap): // pacing the probes, not synchronising
		}
	}
	wg.Wait()
	// Back to the starting state, outside the period's deadline.
	restoreCtx, cancelRestore := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancelRestore()
	if _, err := ch.probeEndpoints(restoreCtx, bulkEndpoints(ch.probeIdx, ch.eps)); err != nil {
		probeErr = err
	}
	slices.Sort(r.probes)
	return r, probeErr
}

// waitAnswer connects to vip from the client every probePoll until pod want answers, for at most
// probeLimit from at, and returns how long after at it answered.
func waitAnswer(ctx context.Context, bed *testbed.Bed, vip netip.AddrPort, want string, at time.Time) (time.Duration, bool) {
	for time.Since(at) < probeLimit {
		if who, err := testbed.Who(bed.Client, vip, 100*time.Millisecond); err == nil && who == want {
			return time.Since(at), true
		}
		select {
		case <-ctx.Done():
			return 0, false
		case <-time.After(probePoll): // polling interval
		}
	}
	return 0, false
}

// quantile is the q-quantile of sorted durations (nearest rank).
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
