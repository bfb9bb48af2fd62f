package main

// cluster.go is -cluster: the same cold start with the proxy reading a real API server (etcd +
// kube-apiserver from e2e/framework on the root namespace's loopback, reached from the node
// namespace through framework's relay) instead of a services file.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// listedMessage is the proxy's info line once both informers' initial lists are in its caches.
const listedMessage = "Informers' initial lists done"

// clusterRun is one cold start's figures.
type clusterRun struct {
	listed, inForce   time.Duration // from process start; listed 0 when the binary does not log it
	cpuSelf, cpuChild time.Duration
	rssKiB, peakKiB   int64
	allRules          time.Duration // from process start until iptables-save showed every portal rule (polled every 250 ms)
	incomplete        string        // why not every portal rule was in force 30 s after the last one worked
}

// runCluster starts the control plane, creates the objects once, then cold-starts each binary
// in proxies (round robin, rounds times) in a fresh node namespace each time, so the binaries
// are compared in one run on the same API server.
func runCluster(ctx context.Context, proxies []string, nServices, nEndpoints, workers, rounds int) (err error) {
	startCtx, cancel := context.WithTimeout(ctx, framework.DefaultStartTimeout)
	cp, err := framework.Start(startCtx, framework.Options{})
	cancel()
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	defer func() { err = errors.Join(err, cp.Stop()) }()

	t0 := time.Now()
	if err := createBulk(ctx, cp, nServices, nEndpoints, workers); err != nil {
		return err
	}
	created := time.Since(t0)
	fmt.Printf("cluster mode: service ports: %d, endpoints: %d\n", nServices, nServices*nEndpoints)
	fmt.Printf("creating %d Services + %d EndpointSlices with %d workers: %v (%.0f objects/s)\n", nServices, nServices, workers,
		created.Round(time.Millisecond), float64(2*nServices)/created.Seconds())

	results := make([][]clusterRun, len(proxies))
	for round := range rounds {
		for i, proxy := range proxies {
			r, err := coldStartCluster(ctx, cp, proxy, nServices)
			if err != nil {
				return fmt.Errorf("%s, round %d: %w", proxy, round+1, err)
			}
			results[i] = append(results[i], r)
			fmt.Printf("%s round %d: lists done %v, last service's portal works %v (after the lists %v), every portal rule seen %v; CPU %v (proxy %v, iptables %v); RSS %.1f MiB, peak %.1f MiB\n",
				proxy, round+1, r.listed.Round(time.Millisecond), r.inForce.Round(time.Millisecond), (r.inForce - r.listed).Round(time.Millisecond), r.allRules.Round(time.Millisecond),
				(r.cpuSelf + r.cpuChild).Round(time.Millisecond), r.cpuSelf.Round(time.Millisecond), r.cpuChild.Round(time.Millisecond),
				float64(r.rssKiB)/1024, float64(r.peakKiB)/1024)
			if r.incomplete != "" {
				fmt.Printf("    INCOMPLETE: %s\n", r.incomplete)
			}
		}
	}
	for i, proxy := range proxies {
		rs := results[i]
		med := func(f func(clusterRun) time.Duration) time.Duration {
			var v []time.Duration
			for _, r := range rs {
				v = append(v, f(r))
			}
			slices.Sort(v)
			return v[len(v)/2].Round(time.Millisecond)
		}
		fmt.Printf("%s, median of %d: process start -> lists done %v; lists done -> last portal works %v; cold start %v (every rule seen %v); CPU %v\n",
			proxy, len(rs), med(func(r clusterRun) time.Duration { return r.listed }),
			med(func(r clusterRun) time.Duration { return r.inForce - r.listed }),
			med(func(r clusterRun) time.Duration { return r.inForce }),
			med(func(r clusterRun) time.Duration { return r.allRules }),
			med(func(r clusterRun) time.Duration { return r.cpuSelf + r.cpuChild }))
	}
	return nil
}

// coldStartCluster starts proxy in a fresh node namespace on cp (through a relay) and measures
// until every portal is in force.
func coldStartCluster(ctx context.Context, cp *framework.ControlPlane, proxy string, nServices int) (r clusterRun, err error) {
	bed, closeBed, err := testbed.Start(ctx, 1, 8080, 5353)
	defer func() { err = errors.Join(err, closeBed()) }()
	if err != nil {
		return r, err
	}
	dir, err := os.MkdirTemp("", "kpp-scale-cluster-")
	if err != nil {
		return r, err
	}
	defer os.RemoveAll(dir)
	server, err := url.Parse(cp.Server)
	if err != nil {
		return r, err
	}
	rl, err := framework.StartRelay(bed.Node, server.Host)
	if err != nil {
		return r, err
	}
	defer rl.Close()
	kubeconfig := filepath.Join(dir, "kube-proxy.kubeconfig")
	if err := framework.WriteRelayedKubeconfig(cp.ProxyKubeconfig, kubeconfig, "https://"+rl.Addr()); err != nil {
		return r, err
	}

	start := time.Now()
	cmd := exec.Command("ip", "netns", "exec", bed.Node.Name, proxy, "--kubeconfig", kubeconfig, "--hostname-override", "node1",
		"--healthz-bind-address", "", "--metrics-bind-address", "127.0.0.1:10249", "--log-level", "info",
		"--iptables-min-sync-period", "100ms",
		"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return r, err
	}
	cmd.Stdout = os.Stderr
	if err := cmd.Start(); err != nil {
		return r, err
	}
	defer func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() }()
	listed := watchLog(stderr, listedMessage)
	profiled := profileStart(ctx, bed)

	synced, err := waitPortal(ctx, bed, netip.AddrPortFrom(apiClusterIP(nServices-1), 80))
	if err != nil {
		return r, err
	}
	r.cpuSelf, r.cpuChild = procstat.OwnCPUTime(cmd.Process.Pid)
	r.inForce = synced.Sub(start)
	select { // the line comes before the first sync: read by now, or never (an older binary)
	case at := <-listed:
		r.listed = at.Sub(start)
	default:
	}
	// A proxy that synced part of the initial lists may never catch up (main before the fix of
	// the informers' synced report): record it and go on with the other runs.
	if err := waitRulesFor(ctx, bed, nServices, 30*time.Second); err != nil {
		if ctx.Err() != nil {
			return r, err
		}
		r.incomplete = err.Error()
	} else {
		r.allRules = time.Since(start)
	}
	if err := <-profiled; err != nil {
		return r, err
	}
	pid, err := proxyPID(cmd.Process.Pid)
	if err != nil {
		return r, err
	}
	r.rssKiB, r.peakKiB = procstat.RSSKiB(pid), procstat.PeakRSSKiB(pid)
	return r, nil
}

// klogInfo matches client-go's info lines (klog: "I1123 16:11:02.377184 ...").
var klogInfo = regexp.MustCompile(`^I\d{4} `)

// watchLog copies the proxy's log to our stderr (all but its and client-go's info lines) and yields the time the
// first line holding msg was read.
func watchLog(r io.Reader, msg string) <-chan time.Time {
	at := make(chan time.Time, 1)
	go func() {
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			if !seen && strings.Contains(line, msg) {
				at <- time.Now()
				seen = true
			}
			if !strings.Contains(line, "level=info") && !klogInfo.MatchString(line) {
				fmt.Fprintln(os.Stderr, line)
			}
		}
		_, _ = io.Copy(io.Discard, r)
	}()
	return at
}

// createBulk creates namespace bulk with n Services (apiClusterIP) and an
// EndpointSlice of eps endpoints for each, with workers concurrent requests and no client-side
// rate limit.
func createBulk(ctx context.Context, cp *framework.ControlPlane, n, eps, workers int) error {
	cfg := cp.AdminConfig()
	cfg.QPS, cfg.Burst = -1, 0 // no client-side rate limit: the API server's own limits apply
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bulk"}},
		metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("namespace bulk: %w", err)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := createOne(ctx, c, i, eps); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func createOne(ctx context.Context, c kubernetes.Interface, i, eps int) error {
	name := fmt.Sprintf("s%d", i)
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "bulk"},
		Spec: corev1.ServiceSpec{ClusterIP: apiClusterIP(i).String(),
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}},
	}
	if _, err := c.CoreV1().Services("bulk").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("service bulk/%s: %w", name, err)
	}
	slice := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-1", Namespace: "bulk",
			Labels: map[string]string{discovery.LabelServiceName: name}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	for e := range eps {
		k := i*eps + e
		slice.Endpoints = append(slice.Endpoints, discovery.Endpoint{
			Addresses:  []string{fmt.Sprintf("10.245.%d.%d", k/250%250, k%250+1)},
			Conditions: discovery.EndpointConditions{Ready: ptr.To(true)},
		})
	}
	if _, err := c.DiscoveryV1().EndpointSlices("bulk").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("endpointslice bulk/%s-1: %w", name, err)
	}
	return nil
}

// apiClusterIP is the file mode's clusterIP moved up 100 /24s, clear of the API server's own
// kubernetes Service (10.96.0.1); for up to 38,750 service ports.
func apiClusterIP(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 96, byte(100 + i/250), byte(i%250 + 1)})
}
