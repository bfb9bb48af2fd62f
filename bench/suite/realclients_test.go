package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// The testdata files are real outputs: redis-benchmark 7.0.15 --csv and dnsperf 2.10.0 against
// unbound 1.17.1, both on loopback.

func TestParseRedisCSV(t *testing.T) {
	golden, err := os.ReadFile(filepath.Join("testdata", "redis-benchmark.csv"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		in      string
		want    map[string]redisRow
		wantErr string
	}{
		{name: "reads_rate_and_p99_of_each_test", in: string(golden), want: map[string]redisRow{
			"SET": {rps: 9132.42, p99ms: 4.119},
			"GET": {rps: 10416.67, p99ms: 3.671},
		}},
		{name: "finds_the_columns_by_their_header", in: "\"p99_latency_ms\",\"test\",\"rps\"\n\"0.5\",\"GET\",\"100\"\n",
			want: map[string]redisRow{"GET": {rps: 100, p99ms: 0.5}}},
		{name: "refuses_output_without_percentiles", in: "\"test\",\"rps\"\n\"GET\",\"100\"\n", wantErr: "lacks test, rps or p99_latency_ms"},
		{name: "refuses_empty_output", in: "", wantErr: "no rows"},
		{name: "refuses_a_bad_number", in: "\"test\",\"rps\",\"p99_latency_ms\"\n\"GET\",\"fast\",\"1\"\n", wantErr: "bad number"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseRedisCSV([]byte(tc.in))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got, cmp.AllowUnexported(redisRow{})); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseDNSPerf(t *testing.T) {
	golden, err := os.ReadFile(filepath.Join("testdata", "dnsperf.txt"))
	if err != nil {
		t.Fatal(err)
	}
	lossy := strings.Replace(string(golden), "Queries lost:         0 (0.00%)", "Queries lost:         371 (1.25%)", 1)
	for _, tc := range []struct {
		name    string
		in      string
		want    dnsperfResult
		wantErr bool
	}{
		{name: "reads_rate_latency_and_completed_queries", in: string(golden),
			want: dnsperfResult{qps: 37097.548294, avgLatencyMS: 0.293, completed: 37102}},
		{name: "reads_the_lost_share", in: lossy,
			want: dnsperfResult{qps: 37097.548294, avgLatencyMS: 0.293, completed: 37102, lostPct: 1.25}},
		{name: "refuses_output_without_statistics", in: "[Status] Sending queries\n", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseDNSPerf([]byte(tc.in))
			if tc.wantErr {
				if err == nil {
					t.Fatalf("no error, got %+v", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			approx := cmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })
			if diff := cmp.Diff(tc.want, got, cmp.AllowUnexported(dnsperfResult{}), approx); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestFinishShowsLatenciesAsMultiplesOfDirect(t *testing.T) {
	rep := &report{order: []string{"direct", "legacy v1.25"}}
	rep.add("direct", sample{mRedisGet: 40000, mRedisGetP99: 0.5, mDNSLatency: 0.2})
	rep.add("legacy v1.25", sample{mRedisGet: 20000, mRedisGetP99: 1.5, mDNSLatency: 0.5, mHalfClose: 0})
	rep.finish()
	want := map[string]float64{mRedisGet: 0.5, mRedisGetP99: 3, mDNSLatency: 2.5}
	approx := cmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })
	if diff := cmp.Diff(want, rep.Targets[1].VsDirect, approx); diff != "" {
		t.Errorf("legacy vs direct (-want +got):\n%s", diff)
	}
	var b strings.Builder
	rep.table(&b, realColumns)
	if !strings.Contains(b.String(), "1.500 (3.00×)") || !strings.Contains(b.String(), "20000 (50%)") {
		t.Errorf("table shows neither the p99 multiple nor the rate share:\n%s", b.String())
	}
}
