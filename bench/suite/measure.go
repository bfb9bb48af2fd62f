package main

// measure.go runs every load against one started target, each from a fresh client child in the
// client namespace, and turns the children's counts into the suite's metrics.

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"strconv"
	"time"
)

// The metric keys of a sample (and of the JSON).
const (
	mBulk        = "bulk_gbit_s"
	mCPUPerGB    = "cpu_s_per_gb"
	mConn        = "conn_s"
	mCPUPerConn  = "cpu_us_per_conn"
	mReq         = "keepalive_req_s"
	mCPUPerReq   = "cpu_us_per_req"
	mUDP         = "udp_exchanges_s"
	mCPUPerUDP   = "cpu_us_per_udp_exchange"
	mIdleConns   = "idle_conns"
	mIdleRSS     = "idle_rss_mib"
	mIdleKiBConn = "idle_kib_per_conn"
	mIdleFds     = "idle_fds"
	mIdleFdsConn = "idle_fds_per_conn"
	mHalfClose   = "half_close" // 1: a client's FIN reaches the pod and the reply still comes back
)

// sample is one measurement of one target: metric key -> value. A metric the target does not
// have (UDP on HAProxy, CPU of the direct path) is absent.
type sample map[string]float64

// measure runs the loads -loads selects; withIdle adds the idle-connection memory test.
func measure(ctx context.Context, cfg config, b *bed, r *running, withIdle bool) (sample, error) {
	s := sample{}
	hasCPU := r.pid != 0
	if cfg.runs("bulk") {
		if err := measureBulk(ctx, cfg, b, r, s); err != nil {
			return s, err
		}
	}
	if r.bulkAndUDPOnly {
		if !cfg.runs("udp") {
			return s, nil
		}
		return s, measureUDP(ctx, cfg, b, r, s)
	}
	if cfg.runs("conn") {
		res, err := runLoad(ctx, b, loadSpec{Test: "conn", Addr: r.echo.String(), PID: r.pid, Dur: cfg.dur, Conc: cfg.conc})
		if err != nil {
			return s, fmt.Errorf("connections: %w", err)
		}
		perOp(s, res, mConn, mCPUPerConn, hasCPU)
	}
	if cfg.runs("keepalive") {
		res, err := runLoad(ctx, b, loadSpec{Test: "keepalive", Addr: r.echo.String(), PID: r.pid, Dur: cfg.dur,
			Warmup: cfg.warmup, Conc: cfg.conc, Size: 64})
		if err != nil {
			return s, fmt.Errorf("keep-alive: %w", err)
		}
		perOp(s, res, mReq, mCPUPerReq, hasCPU)
	}
	if cfg.runs("udp") {
		if err := measureUDP(ctx, cfg, b, r, s); err != nil {
			return s, err
		}
	}
	if cfg.real {
		if err := measureReal(ctx, cfg, b, r, s); err != nil {
			return s, err
		}
	}
	if withIdle && hasCPU && cfg.runs("idle") {
		if err := measureIdle(ctx, cfg, b, r, s); err != nil {
			return s, fmt.Errorf("idle: %w", err)
		}
	}
	return s, nil
}

// measureBulk checks half-close and sends cfg.bulkMiB through the sink.
func measureBulk(ctx context.Context, cfg config, b *bed, r *running, s sample) error {
	s[mHalfClose] = 0
	if b.halfClose(r.sink) {
		s[mHalfClose] = 1
	}
	bulkTest := "bulk"
	if s[mHalfClose] == 0 {
		bulkTest = "bulk-framed" // the plain test's ack could never come back
	}
	res, err := runLoad(ctx, b, loadSpec{Test: bulkTest, Addr: r.sink.String(), PID: r.pid, Bytes: cfg.bulkMiB << 20})
	if err != nil {
		return fmt.Errorf("bulk: %w", err)
	}
	s[mBulk] = float64(res.Ops) * 8 / res.Seconds / 1e9
	if r.pid != 0 {
		s[mCPUPerGB] = res.CPU / (float64(res.Ops) / 1e9)
	}
	return nil
}

// measureUDP runs the UDP load when the target serves UDP.
func measureUDP(ctx context.Context, cfg config, b *bed, r *running, s sample) error {
	if !r.udp.IsValid() {
		return nil
	}
	res, err := runLoad(ctx, b, loadSpec{Test: "udp", Addr: r.udp.String(), PID: r.pid, Dur: cfg.dur,
		Warmup: cfg.warmup, Conc: cfg.udpClients, Size: 64})
	if err != nil {
		return fmt.Errorf("udp: %w", err)
	}
	perOp(s, res, mUDP, mCPUPerUDP, r.pid != 0)
	return nil
}

func perOp(s sample, res loadResult, rate, cpu string, hasCPU bool) {
	s[rate] = float64(res.Ops) / res.Seconds
	if hasCPU && res.Ops > 0 {
		s[cpu] = res.CPU / float64(res.Ops) * 1e6
	}
	if res.Errors > 0 {
		fmt.Printf("    %s: %d failed operations\n", rate, res.Errors)
	}
}

// measureIdle opens cfg.idle connections through the proxy and reads its RSS and descriptors
// once they have been held for cfg.settle.
func measureIdle(ctx context.Context, cfg config, b *bed, r *running, s sample) error {
	rss0, fds0 := procstat.RSSKiB(r.pid), procstat.FDCount(r.pid)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	n := cfg.idle
	if r.idleMax > 0 && n > r.idleMax {
		n = r.idleMax
	}
	c, err := startSelf(ctx, b.tb.Client, "client", loadSpec{Test: "idle", Addr: r.echo.String(), N: n}.args()...)
	if err != nil {
		return err
	}
	defer c.stop(0, 30*time.Second)
	res, err := readResult(c)
	if err != nil {
		return err
	}
	if res.Open == 0 {
		return fmt.Errorf("no connection opened")
	}
	select { // holding the connections for a while is the measurement, not a synchronisation
	case <-time.After(cfg.settle):
	case <-ctx.Done():
		return ctx.Err()
	}
	if r.proc != nil && !r.proc.alive() {
		return fmt.Errorf("the proxy exited holding %d connections", res.Open)
	}
	rss1, fds1 := procstat.RSSKiB(r.pid), procstat.FDCount(r.pid)
	open := float64(res.Open)
	s[mIdleConns] = open
	s[mIdleRSS] = float64(rss1) / 1024
	s[mIdleKiBConn] = float64(rss1-rss0) / open
	s[mIdleFds] = float64(fds1)
	s[mIdleFdsConn] = float64(fds1-fds0) / open
	return nil
}

// runLoad runs one load in a client child and returns its result.
func runLoad(ctx context.Context, b *bed, spec loadSpec) (loadResult, error) {
	ctx, cancel := context.WithTimeout(ctx, spec.Warmup+spec.Dur+90*time.Second)
	defer cancel()
	c, err := startSelf(ctx, b.tb.Client, "client", spec.args()...)
	if err != nil {
		return loadResult{}, err
	}
	defer c.stop(0, 10*time.Second)
	return readResult(c)
}

func readResult(c *child) (loadResult, error) {
	var res loadResult
	line, err := c.line()
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal([]byte(line), &res); err != nil {
		return res, fmt.Errorf("client said %q: %w", line, err)
	}
	return res, nil
}

// args is spec as the client child's flags.
func (spec loadSpec) args() []string {
	if spec.Timeout == 0 {
		spec.Timeout = 5 * time.Second
	}
	return []string{"-test", spec.Test, "-addr", spec.Addr, "-pid", strconv.Itoa(spec.PID),
		"-dur", spec.Dur.String(), "-warmup", spec.Warmup.String(), "-conc", strconv.Itoa(spec.Conc),
		"-bytes", strconv.FormatInt(spec.Bytes, 10), "-size", strconv.Itoa(spec.Size), "-n", strconv.Itoa(spec.N),
		"-op-timeout", spec.Timeout.String()}
}
