package main

// ceiling.go builds and runs the ceiling target: ceiling/ceiling.c, the leanest TCP-bulk and UDP
// forwarder we can write, as a measuring stick for the goals that are ratios of the direct path.
// It is compiled with the machine's C compiler at the start of a run; without one it is skipped.

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
)

//go:embed ceiling/ceiling.c
var ceilingSource []byte

// buildCeiling compiles the ceiling forwarder into dir and returns its path, or why it cannot.
func buildCeiling(ctx context.Context, dir string) (string, error) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		return "", fmt.Errorf("no C compiler (cc): %w", err)
	}
	src, bin := filepath.Join(dir, "ceiling.c"), filepath.Join(dir, "ceiling")
	if err := os.WriteFile(src, ceilingSource, 0o644); err != nil {
		return "", err
	}
	if out, err := exec.CommandContext(ctx, cc, "-O2", "-pthread", "-o", bin, src).CombinedOutput(); err != nil {
		return "", fmt.Errorf("cc ceiling.c: %w\n%s", err, out)
	}
	return bin, nil
}

// ceilingTarget runs the forwarder in the node namespace on the node addresses HAProxy and nginx
// use. Only the bulk and UDP loads go through it: its thread-per-direction TCP path is built for
// one big stream, and its connection or idle figures would measure thread creation, not a bound.
func ceilingTarget(bin string) target {
	return target{name: "ceiling", start: func(ctx context.Context, b *bed) (*running, error) {
		return startInNode(ctx, b, running{echo: nodeEcho, sink: nodeSink, udp: nodeUDP, stopSig: syscall.SIGKILL, bulkAndUDPOnly: true},
			bin, "-tcp", nodeEcho.String(), podAddr(echoPort).String(),
			"-tcp", nodeSink.String(), podAddr(sinkPort).String(),
			"-udp", nodeUDP.String(), podAddr(udpPort).String())
	}}
}

// compareTarget runs another TCP proxy command in the node namespace, for A/B runs against an
// older build or an experiment: argv plus -listen-echo, -echo, -listen-sink and -sink, the flags
// of bench/tcp's proxy roles (e.g. -compare "/tmp/benchtcp -role evloop"). TCP loads only.
func compareTarget(argv []string) target {
	return target{name: "compare", start: func(ctx context.Context, b *bed) (*running, error) {
		args := append(append([]string{}, argv...),
			"-listen-echo", nodeEcho.String(), "-echo", podAddr(echoPort).String(),
			"-listen-sink", nodeSink.String(), "-sink", podAddr(sinkPort).String())
		return startInNode(ctx, b, running{echo: nodeEcho, sink: nodeSink, stopSig: syscall.SIGKILL}, args...)
	}}
}
