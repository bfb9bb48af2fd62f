// Command kube-portal-proxy is a node-level Kubernetes service proxy that revives kube-proxy's
// userspace ("portal") mode: a visible proxy socket per service port, fed by portal rules.
//
// main parses flags, builds clients, wires the packages together and runs them; it is the only
// place that exits.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/sirupsen/logrus"
	"github.com/spf13/pflag"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

// run is main without the exit, for tests. Exit codes: 0 done, 1 failed, 2 bad command line.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, fs, err := parseOptions(args)
	if errors.Is(err, pflag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kube-portal-proxy: %v\n", err)
		return 2
	}
	if o.version {
		fmt.Fprintf(stdout, "kube-portal-proxy %s\n", version)
		return 0
	}
	if o.writeConfigTo != "" {
		if err := writeConfigFile(o, fs); err != nil {
			fmt.Fprintf(stderr, "kube-portal-proxy: %v\n", err)
			return 1
		}
		return 0
	}
	log := newLogger(o, stderr)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if o.cleanup {
		if err := cleanup(ctx, o, log); err != nil {
			log.WithError(err).Error("Cleanup failed")
			return 1
		}
		log.Info("Cleanup done")
		return 0
	}
	log.WithFields(logrus.Fields{"version": version, "mode": "userspace", "portal": o.portalMode, "config": o.configFile,
		"flags": changedFlags(fs)}).Info("Starting kube-portal-proxy")
	logConfigNotes(log, o)
	if err := serve(ctx, o, log); err != nil {
		log.WithError(err).Error("Exiting")
		return 1
	}
	log.Info("Stopped")
	return 0
}

func newLogger(o *options, out io.Writer) *logrus.Logger {
	log := logrus.New()
	log.SetOutput(out)
	level, _ := parseLevel(o.logLevel)
	log.SetLevel(level)
	if o.logFormat == "json" {
		log.SetFormatter(&logrus.JSONFormatter{})
	} else {
		log.SetFormatter(&logrus.TextFormatter{FullTimestamp: true})
	}
	return log
}

func parseLevel(s string) (logrus.Level, error) {
	switch strings.ToLower(s) {
	case "debug", "info", "warn", "warning", "error":
		return logrus.ParseLevel(s)
	}
	return 0, fmt.Errorf("%q: want debug, info, warn or error", s)
}

// changedFlags lists the flags given on the command line, for the startup line.
func changedFlags(fs *pflag.FlagSet) string {
	var parts []string
	fs.Visit(func(f *pflag.Flag) { parts = append(parts, "--"+f.Name+"="+f.Value.String()) })
	return strings.Join(parts, " ")
}
