package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The data-path annotation against the real API server and the proxy binary. Address plan:
// internal/testbed (pods 10.244.<i>.10 serving TCP 8080: a greeting "pod<i>", then an echo; the
// client 172.30.0.2 dials the cluster IP through the node).

const annotationDataPath = "portal-proxy.kubernetes.io/data-path"

// kernelView is the part of a /debug/services entry these tests read.
type kernelView struct {
	Name     string `json:"name"`
	DataPath string `json:"dataPath"`
	Kernel   []struct {
		Endpoint string `json:"endpoint"`
		Packets  uint64 `json:"packets"`
	} `json:"kernel"`
}

// debugViewOf reads one service port's /debug/services entry.
func debugViewOf(n *clusterNode, name string) (kernelView, error) {
	code, body, err := httpGet(n.bed.Node, "http://"+metricsAddr+"/debug/services?format=json")
	if err != nil || code != 200 {
		return kernelView{}, fmt.Errorf("GET /debug/services: %d %v", code, err)
	}
	var views []kernelView
	if err := json.Unmarshal([]byte(body), &views); err != nil {
		return kernelView{}, err
	}
	for _, v := range views {
		if v.Name == name {
			return v, nil
		}
	}
	return kernelView{}, fmt.Errorf("%s not in /debug/services", name)
}

// TestDataPathSwitchesLive puts a Service on the kernel path by annotation, checks that its
// traffic goes through kube-proxy's chains (KUBE-SVC-<hash> in the node's nat table, the
// KUBE-SEP counters in /debug/services), then switches it to the proxy path and back while a
// client connects every 10 ms and long connections talk throughout: no connection fails, and
// the long ones opened on either path keep answering until the end.
func TestDataPathSwitchesLive(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 3)
	svc := n.annotatedService(t, "web", map[string]string{annotationDataPath: "kernel"})
	n.setEndpoints(t, svc, 1, 2, 3)
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterTCP
	name := service.ServicePortName{Namespace: svc.Namespace, Name: "web", Port: "http"}
	svcChain := kernel.ServiceChain(kernel.PrefixService, name, service.TCP)

	waitPath := func(path string) {
		t.Helper()
		eventually(t, 30*time.Second, "the "+path+" path in force", func() error {
			v, err := debugViewOf(n, name.String())
			if err != nil {
				return err
			}
			if v.DataPath != path {
				return fmt.Errorf("/debug/services says path %q", v.DataPath)
			}
			nat, err := n.bed.Node.Exec(t.Context(), "iptables-save", "-t", "nat")
			if err != nil {
				return err
			}
			if has := strings.Contains(string(nat), "-j "+svcChain); has != (path == "kernel") {
				return fmt.Errorf("path %s, yet the nat table has the jump to %s: %v", path, svcChain, has)
			}
			return nil
		})
	}
	proxy.waitAnswers(t, n.bed.Client, addr, "the kernel-path service never answered")
	waitPath("kernel")
	if got := tally(t, whoTCP, n.bed.Client, addr, 30); len(got) != 3 {
		t.Errorf("answers on the kernel path %v, want all three pods", got)
	}
	eventually(t, 30*time.Second, "KUBE-SEP counters in /debug/services", func() error {
		v, err := debugViewOf(n, name.String())
		if err != nil {
			return err
		}
		var sum uint64
		for _, k := range v.Kernel {
			sum += k.Packets
		}
		if len(v.Kernel) != 3 || sum < 30 {
			return fmt.Errorf("counters %+v, want 3 endpoints with at least 30 connections", v.Kernel)
		}
		return nil
	})

	var ok, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	fail := func(format string, args ...any) {
		failed.Add(1)
		mu.Lock()
		failures = append(failures, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // a new connection every 10 ms
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := whoTCP(n.bed.Client, addr); err != nil {
				fail("short connection: %v", err)
			} else {
				ok.Add(1)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	})
	long := func(opened string) { // a connection that echoes every 50 ms until the end
		c, err := testbed.Dial(n.bed.Client, addr, requestTimeout)
		if err != nil {
			fail("long connection opened on the %s path: %v", opened, err)
			return
		}
		wg.Go(func() {
			defer c.Close()
			r := bufio.NewReader(c)
			_ = c.SetDeadline(time.Now().Add(requestTimeout))
			if _, err := r.ReadString('\n'); err != nil {
				fail("long connection opened on the %s path: greeting: %v", opened, err)
				return
			}
			echoes := 0
			for {
				select {
				case <-stop:
					if echoes < 5 {
						fail("long connection opened on the %s path echoed only %d times", opened, echoes)
					}
					return
				case <-time.After(50 * time.Millisecond): // the client's pace
				}
				_ = c.SetDeadline(time.Now().Add(requestTimeout))
				buf := make([]byte, 5)
				if _, err := io.WriteString(c, "ping\n"); err != nil {
					fail("long connection opened on the %s path, after %d echoes: %v", opened, echoes, err)
					return
				}
				if _, err := io.ReadFull(r, buf); err != nil || string(buf) != "ping\n" {
					fail("long connection opened on the %s path, after %d echoes: %q %v", opened, echoes, buf, err)
					return
				}
				echoes++
			}
		})
	}
	waitOK := func(more int64) {
		t.Helper()
		target := ok.Load() + more
		eventually(t, 30*time.Second, fmt.Sprintf("%d more answered connections", more), func() error {
			if ok.Load() < target && failed.Load() == 0 {
				return fmt.Errorf("%d answered", ok.Load())
			}
			return nil
		})
	}
	annotate := func(path string) { t.Helper(); n.setDataPath(t, svc, path) }

	long("kernel")
	long("kernel")
	waitOK(30)
	annotate("proxy")
	waitPath("proxy")
	long("proxy")
	long("proxy")
	waitOK(30)
	annotate("kernel")
	waitPath("kernel")
	long("kernel")
	waitOK(30)
	close(stop)
	wg.Wait()
	t.Logf("%d short connections answered across kernel -> proxy -> kernel, %d failures", ok.Load(), failed.Load())
	if failed.Load() > 0 {
		t.Errorf("%d failures:\n%s", failed.Load(), strings.Join(failures, "\n"))
	}
}
