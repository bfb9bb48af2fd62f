package main

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestMediansTakeEachMetricOverTheSamplesThatHaveIt(t *testing.T) {
	got := medians([]sample{
		{mConn: 300, mUDP: 10},
		{mConn: 100},
		{mConn: 200, mUDP: 30},
	})
	want := sample{mConn: 200, mUDP: 20}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("medians (-want +got):\n%s", diff)
	}
}

func TestFinishComparesRatesToDirectAndKeepsTheSelectedOrder(t *testing.T) {
	rep := &report{order: []string{"direct", "kpp iptables", "haproxy"}}
	rep.add("haproxy", sample{mConn: 50, mCPUPerConn: 9})
	rep.add("direct", sample{mConn: 100, mUDP: 40})
	rep.add("kpp iptables", sample{mConn: 25, mUDP: 10, mCPUPerConn: 7})
	rep.finish()

	var names []string
	ratios := map[string]map[string]float64{}
	for _, tr := range rep.Targets {
		names = append(names, tr.Name)
		ratios[tr.Name] = tr.VsDirect
	}
	if diff := cmp.Diff([]string{"direct", "kpp iptables", "haproxy"}, names); diff != "" {
		t.Errorf("order (-want +got):\n%s", diff)
	}
	want := map[string]map[string]float64{
		"direct":       {mConn: 1, mUDP: 1},
		"kpp iptables": {mConn: 0.25, mUDP: 0.25},
		"haproxy":      {mConn: 0.5}, // no UDP, and CPU is not a rate
	}
	if diff := cmp.Diff(want, ratios); diff != "" {
		t.Errorf("ratios to direct (-want +got):\n%s", diff)
	}
}

func TestPrintMarksMissingFiguresAndShares(t *testing.T) {
	rep := &report{order: []string{"direct", "haproxy"}, Config: map[string]any{"reps": 1}}
	rep.add("direct", sample{mBulk: 10, mConn: 100, mReq: 1000, mUDP: 40})
	rep.add("haproxy", sample{mBulk: 5, mConn: 50, mReq: 500, mCPUPerConn: 9})
	rep.finish()
	var b strings.Builder
	rep.print(&b)
	for _, want := range []string{"5.00 (50%)", "50 (50%)", "500 (50%)", "9.0"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
	if line := lineOf(b.String(), "haproxy|"); !strings.Contains(line, "-|") {
		t.Errorf("haproxy's UDP cell should be '-': %q", line)
	}
}

func lineOf(s, prefix string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), prefix) {
			return l
		}
	}
	return ""
}

func TestParseScaleReadsBenchScaleReport(t *testing.T) {
	out := `service ports: 1000, endpoints: 5000
cold start to all portals programmed: 693ms
RSS with everything loaded: 48.2 MiB
idle CPU over 1s: 1.00% of one core
network programming latency (file change -> traffic works), 3 samples: [210.4ms 250ms 1.2s]
`
	got, err := parseScale(out, 1000)
	if err != nil {
		t.Fatal(err)
	}
	got.Output = nil
	want := &syncResult{Services: 1000, ColdStartS: 0.693, RSSMiB: 48.2, IdleCPUPct: 1,
		LatencyS: []float64{0.2104, 0.25, 1.2}, LatencyMedian: 0.25}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("parseScale (-want +got):\n%s", diff)
	}
}

func TestParseScaleFailsWithoutAColdStart(t *testing.T) {
	if _, err := parseScale("scale: boom\n", 1000); err == nil {
		t.Error("parseScale accepted output without a cold start")
	}
}

func TestLoadsAndOnlySelectWholeKeys(t *testing.T) {
	for _, tt := range []struct {
		loads, load string
		want        bool
	}{
		{"", "udp", true},
		{"udp,real", "udp", true},
		{"udp,real", "real", true},
		{"udp,real", "bulk", false},
		{"keepalive", "alive", false},
	} {
		if got := (config{loads: tt.loads}).runs(tt.load); got != tt.want {
			t.Errorf("-loads %q: runs(%q) = %t, want %t", tt.loads, tt.load, got, tt.want)
		}
	}
	if !(config{only: "bind,old-bind"}).wants("old-bind") || (config{only: "old-bind"}).wants("bind") {
		t.Error("-only old-bind must select old-bind and not bind")
	}
}

func TestRedisGoalComparesEachTargetWithDirect(t *testing.T) {
	rep := &report{order: []string{"direct", "kpp iptables", "nginx"}}
	rep.add("direct", sample{mRedisSet: 100, mRedisSetP99: 1, mRedisGet: 100, mRedisGetP99: 1})
	rep.add("kpp iptables", sample{mRedisSet: 90, mRedisSetP99: 1.2, mRedisGet: 85, mRedisGetP99: 1.5})
	rep.add("nginx", sample{mRedisSet: 70, mRedisSetP99: 1.2, mRedisGet: 90, mRedisGetP99: 1.6})
	rep.finish()
	var b strings.Builder
	rep.printRedisGoal(&b)
	for _, want := range []string{
		"kpp iptables: SET rate 0.90×, p99 1.20×; GET rate 0.85×, p99 1.50×: met",
		"nginx: SET rate 0.70×, p99 1.20×; GET rate 0.90×, p99 1.60×: missed",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("redis goal lines lack %q:\n%s", want, b.String())
		}
	}
}
