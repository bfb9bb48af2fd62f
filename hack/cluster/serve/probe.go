// probe.go: the -probe mode, the load of make cluster-rollout. One goroutine per URL opens a new
// connection every -probe-every (no keep-alive: what a rolling update of the proxy could break
// is the accept of new connections) and counts the answers and the failures, until GET /stop or
// -probe-for. GET /stats and GET /stop answer one line per URL:
//
//	URL ok=N failed=N slowest=D answers=HOST:N,HOST:N errors="first errors; ..."
package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// maxErrors is how many failures a probe keeps the message of (the first ones).
const maxErrors = 5

// probe connects to one URL in a loop and counts.
type probe struct {
	url    string
	client *http.Client

	mu      sync.Mutex
	ok      int
	failed  int
	slowest time.Duration
	answers map[string]int
	errors  []string
}

func newProbe(url string, timeout time.Duration) *probe {
	return &probe{
		url: url,
		client: &http.Client{
			Timeout:   timeout,
			Transport: &http.Transport{DisableKeepAlives: true},
		},
		answers: map[string]int{},
	}
}

// run probes every interval until ctx is done; a request in flight when ctx ends is finished
// (its deadline bounds it) and counted, so no failure is made up by the stop itself.
func (p *probe) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		p.once()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (p *probe) once() {
	start := time.Now()
	body, err := p.get()
	took := time.Since(start)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.failed++
		if len(p.errors) < maxErrors {
			p.errors = append(p.errors, fmt.Sprintf("%s: %v", start.UTC().Format("15:04:05.000"), err))
		}
		return
	}
	p.ok++
	p.answers[body]++
	if took > p.slowest {
		p.slowest = took
	}
}

func (p *probe) get() (string, error) {
	resp, err := p.client.Get(p.url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("GET %s: read body: %w", p.url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", p.url, resp.Status)
	}
	body := strings.TrimSpace(string(b))
	if body == "" {
		return "", fmt.Errorf("GET %s: empty answer", p.url)
	}
	return body, nil
}

// String is the probe's line of /stats.
func (p *probe) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	hosts := make([]string, 0, len(p.answers))
	for h, n := range p.answers {
		hosts = append(hosts, fmt.Sprintf("%s:%d", h, n))
	}
	sort.Strings(hosts)
	return fmt.Sprintf("%s ok=%d failed=%d slowest=%s answers=%s errors=%q", p.url, p.ok, p.failed,
		p.slowest.Round(time.Millisecond), strings.Join(hosts, ","), strings.Join(p.errors, "; "))
}

// probes runs a probe per URL from start until stop (or the deadline) and serves their counts.
type probes struct {
	list   []*probe
	cancel context.CancelFunc
	done   chan struct{}
}

// startProbes starts a probe per URL; they stop after limit at the latest.
func startProbes(urls []string, every, timeout, limit time.Duration) *probes {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	ps := &probes{cancel: cancel, done: make(chan struct{})}
	var wg sync.WaitGroup
	for _, u := range urls {
		p := newProbe(u, timeout)
		ps.list = append(ps.list, p)
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.run(ctx, every)
		}()
	}
	go func() {
		wg.Wait()
		close(ps.done)
	}()
	return ps
}

// stop ends the probes and waits for their last requests.
func (ps *probes) stop() {
	ps.cancel()
	<-ps.done
}

func (ps *probes) String() string {
	var b strings.Builder
	for _, p := range ps.list {
		b.WriteString(p.String())
		b.WriteByte('\n')
	}
	return b.String()
}

// handle serves /stats and /stop; anything else goes to next.
func (ps *probes) handle(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/stop":
			ps.stop()
			fmt.Fprint(w, ps)
		case "/stats":
			fmt.Fprint(w, ps)
		default:
			next.ServeHTTP(w, r)
		}
	})
}
