// Command kube-portal-proxy is a node-level Kubernetes service proxy that revives kube-proxy's
// userspace ("portal") mode: a visible proxy socket per service port, fed by portal rules.
//
// main parses the command line, builds the daemon (package daemon) and runs it, or runs the
// `observe` subcommand (package observe/cli) that watches a running proxy's flows; it is the only
// place that exits.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/kube-portal-proxy/kube-portal-proxy/daemon"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe/cli"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe/pcap"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

// capture writes observe --pcap's file and says, when it is closed, what went in and what was
// left out.
type capture struct {
	*pcap.Writer
	stderr io.Writer
}

func (c *capture) Close() error {
	err := c.Writer.Close()
	st := c.Stats()
	fmt.Fprintf(c.stderr, "capture: %d packets of %d flows, %d bytes", st.Packets, st.Flows, st.Bytes)
	if st.TruncatedFlows > 0 {
		fmt.Fprintf(c.stderr, "; %d flows cut at their capture cap", st.TruncatedFlows)
	}
	if st.CapReached {
		fmt.Fprintf(c.stderr, "; the file cap left out %d packets", st.PacketsOverCap)
	}
	if st.UnmatchedPayloadBytes > 0 {
		fmt.Fprintf(c.stderr, "; %d payload bytes without their flow's event were dropped", st.UnmatchedPayloadBytes)
	}
	fmt.Fprintln(c.stderr)
	return err
}

// run is main without the exit, for tests. Exit codes: 0 done, 1 failed, 2 bad command line.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "observe" {
		ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		return cli.Main(ctx, args[1:], cli.Env{Stdout: stdout, Stderr: stderr, NewCapture: func(w io.Writer) (cli.CaptureWriter, error) {
			return &capture{Writer: pcap.NewWriter(w, pcap.Options{}), stderr: stderr}, nil
		}})
	}
	o, err := daemon.ParseOptions(args)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kube-portal-proxy: %v\n", err)
		return 2
	}
	switch o.Action() {
	case daemon.ActionVersion:
		fmt.Fprintf(stdout, "kube-portal-proxy %s\n", version)
		return 0
	case daemon.ActionWriteConfig:
		if err := o.WriteConfig(version); err != nil {
			fmt.Fprintf(stderr, "kube-portal-proxy: %v\n", err)
			return 1
		}
		return 0
	}
	log := daemon.NewLogger(o, stderr)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if o.Action() == daemon.ActionCleanup {
		if err := daemon.Cleanup(ctx, o, log); err != nil {
			log.WithError(err).Error("Cleanup failed")
			return 1
		}
		log.Info("Cleanup done")
		return 0
	}
	if err := daemon.New(o, version, log).Run(ctx); err != nil {
		log.WithError(err).Error("Exiting")
		return 1
	}
	log.Info("Stopped")
	return 0
}
