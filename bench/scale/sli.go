package main

// sli.go reads a target's network programming SLI, kubeproxy_network_programming_duration_seconds,
// from its /metrics on the node namespace's loopback: the observations of a period (the difference
// of two scrapes) and the bucket that holds a quantile.

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

const sliName = "kubeproxy_network_programming_duration_seconds"

// histogram is cumulative counts by upper bound (le), summed over label sets.
type histogram map[float64]float64

// scrapeSLI fetches the target's SLI histogram.
// On a loaded machine a scrape of 10,000 ports' series can take long: three tries of 30 s.
func scrapeSLI(ctx context.Context, bed *testbed.Bed) (histogram, error) {
	var err error
	for range 3 {
		var out []byte
		if out, err = bed.Node.Exec(ctx, "curl", "-sf", "--max-time", "30", "http://"+metricsAddr+"/metrics"); err == nil {
			return parseHistogram(string(out), sliName)
		}
		if ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("scrape /metrics: %w", err)
}

// parseHistogram sums the _bucket series of name over their labels by le.
func parseHistogram(text, name string) (histogram, error) {
	h := histogram{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, name+"_bucket{") {
			continue
		}
		i := strings.Index(l, `le="`)
		if i < 0 {
			continue
		}
		rest := l[i+4:]
		j := strings.IndexByte(rest, '"')
		if j < 0 {
			continue
		}
		le, err := strconv.ParseFloat(rest[:j], 64)
		if err != nil {
			return nil, fmt.Errorf("%s: le %q: %w", name, rest[:j], err)
		}
		f := strings.Fields(l[strings.LastIndexByte(l, '}')+1:])
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return nil, fmt.Errorf("%s: value %q: %w", name, f[0], err)
		}
		h[le] += v
	}
	return h, sc.Err()
}

// sub is h - before: the observations made between two scrapes.
func (h histogram) sub(before histogram) histogram {
	out := histogram{}
	for le, v := range h {
		out[le] = v - before[le]
	}
	return out
}

// count is the number of observations.
func (h histogram) count() float64 { return h[math.Inf(1)] }

// bucketOf is the upper bound of the bucket that holds the q-quantile: with kube-proxy's buckets
// (0.25 s, 0.5 s, then whole seconds) the honest resolution of the SLI. NaN without observations.
func (h histogram) bucketOf(q float64) float64 {
	n := h.count()
	if n == 0 {
		return math.NaN()
	}
	les := make([]float64, 0, len(h))
	for le := range h {
		les = append(les, le)
	}
	slices.Sort(les)
	for _, le := range les {
		if h[le] >= q*n {
			return le
		}
	}
	return math.Inf(1)
}
