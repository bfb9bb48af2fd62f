package main

// run.go is the bench role: it checks the machine, picks the idle-connection count that fits the
// descriptor limit, runs the rounds (targets rotated each round, a fresh bed per measurement),
// the rules-sync measurement, and reports.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// fdHeadroom is what a proxy needs besides two descriptors per idle connection (listeners,
// epoll, logs, the rate tests' stragglers).
const fdHeadroom = 600

func runBench(ctx context.Context, cfg config) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root to create network namespaces (sudo make bench)")
	}
	if cfg.reps < 1 || cfg.reps > 10 || cfg.dur > 30*time.Second {
		return errors.New("keep runs bounded: 1 <= -reps <= 10, -dur <= 30s")
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	start := time.Now()
	rep := newReport(cfg)
	var err error
	if cfg.proxy, err = filepath.Abs(cfg.proxy); err != nil {
		return err
	}
	if cfg.oldProxy != "" {
		if cfg.oldProxy, err = filepath.Abs(cfg.oldProxy); err != nil {
			return err
		}
		if _, err := os.Stat(cfg.oldProxy); err != nil {
			return fmt.Errorf("-old-proxy: %w", err)
		}
		rep.note("old iptables and old bind run %s, the others %s", cfg.oldProxy, cfg.proxy)
	}
	if !cfg.runs("real") {
		cfg.real = false
	}
	if _, err := os.Stat(cfg.proxy); err != nil {
		return fmt.Errorf("the daemon binary: %w (run make build)", err)
	}
	hard, err := fdHardLimit()
	if err != nil {
		return err
	}
	// Each process (client child, proxy, backend) may raise its soft limit to the hard one; a proxy
	// holds two descriptors per connection, so it is the one that bounds N.
	if fit := (int(hard) - fdHeadroom) / 2; cfg.idle > fit {
		rep.note("idle connections lowered from %d to %d: the descriptor hard limit is %d and a proxy holds 2 per connection", cfg.idle, fit, hard)
		cfg.idle = fit
	}
	rep.Config["idle_conns"] = cfg.idle
	rep.note("each client load runs in a child process in the client namespace (its own descriptor limit); "+
		"the idle test holds %d connections, so the proxy holds about %d descriptors, under the hard limit of %d", cfg.idle, 2*cfg.idle, hard)

	rep.note("every (round, target) runs in fresh namespaces: no TIME_WAIT sockets, conntrack entries or rules carry over; " +
		"the idle-connection test runs in round 1 only")
	rep.note("direct is routed through the node namespace (ip_forward there, no nat table, so no conntrack); " +
		"kpp iptables adds the nat table's REDIRECT and conntrack; bind, haproxy and nginx need neither")
	rep.note("UDP exch = one 64-byte request and its reply; conn = connect, 4 bytes there and back, close; " +
		"req = 64 bytes there and back on a kept connection; CPU counts the kernel time charged to the proxy process")
	ceiling, ceilingSkip := "", ""
	if cfg.wants("ceiling") {
		dir, err := os.MkdirTemp("", "kpp-bench-ceiling")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if ceiling, err = buildCeiling(ctx, dir); err != nil {
			ceilingSkip = err.Error()
		}
		rep.note("ceiling is bench/suite/ceiling/ceiling.c, the leanest bulk-TCP and UDP forwarder we can write " +
			"(blocking splice, a thread per direction; recvmmsg/sendmmsg): a reference for how much of the direct rate a forwarder keeps here")
	}
	api := &legacyAPI{}
	defer func() {
		if err := api.close(); err != nil {
			fmt.Fprintf(os.Stderr, "bench/suite: control plane: %v\n", err)
		}
	}()
	if cfg.real {
		if skip := realClientsSkip(); skip != "" {
			rep.note("real clients skipped: %s", skip)
			cfg.real = false
		} else {
			rep.note("real clients: redis-benchmark -c %d -n %d -t set,get against redis-server, and dnsperf -c %d -T 2 -q 64 "+
				"for %s against unbound (one static local zone, one thread), both servers in the pod; %s; %s",
				cfg.conc, cfg.redisReqs, cfg.udpClients, cfg.dur, toolVersion("redis-server", "--version"), toolVersion("unbound", "-V"))
		}
	}
	if cfg.wants("legacy") {
		rep.note("legacy v1.25 holds %d descriptors per connection and panics when it runs out (EMFILE in accept or dial); "+
			"its idle test holds at most %d connections", legacyFDsPerConn, legacyIdleMax())
	}
	targets := rep.selectTargets(cfg, int(hard), ceiling, ceilingSkip, api)
	for round := range cfg.reps {
		for i := range targets {
			t := targets[(i+round)%len(targets)]
			withIdle := round == 0
			fmt.Printf("round %d/%d: %s%s\n", round+1, cfg.reps, t.name, map[bool]string{true: " (+ idle connections)"}[withIdle])
			s, err := runOne(ctx, cfg, t, withIdle)
			if ctx.Err() != nil {
				return fmt.Errorf("stopped: %w", ctx.Err())
			}
			if err != nil {
				rep.note("%s, round %d: %v", t.name, round+1, err)
				fmt.Printf("  %s: %v\n", t.name, err)
			}
			if len(s) > 0 {
				rep.add(t.name, s)
			}
		}
	}
	if cfg.syncServices > 0 {
		fmt.Printf("rules sync: bench/scale at %d service ports (iptables portals)\n", cfg.syncServices)
		sr, err := runScale(ctx, cfg)
		if err != nil {
			rep.note("rules sync: %v", err)
			fmt.Printf("  rules sync: %v\n", err)
		}
		rep.Sync = sr
	}
	rep.ElapsedS = time.Since(start).Seconds()
	rep.finish()
	rep.print(os.Stdout)
	if cfg.jsonPath != "" {
		if err := rep.writeJSON(cfg.jsonPath); err != nil {
			return err
		}
		fmt.Printf("JSON: %s\n", cfg.jsonPath)
	}
	return nil
}

// runOne measures one target in a bed of its own.
func runOne(ctx context.Context, cfg config, t target, withIdle bool) (_ sample, err error) {
	b, err := newBed(ctx, cfg.real)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, b.close()) }()
	r, err := t.start(ctx, b)
	if err != nil {
		return nil, fmt.Errorf("start: %w", err)
	}
	defer r.stop()
	s, err := measure(ctx, cfg, b, r, withIdle)
	if r.proc != nil && !r.proc.alive() {
		err = errors.Join(err, errors.New("the proxy exited during the run"))
	}
	return s, err
}

// candidate is a target -only may select (by key); skip says why it cannot run here.
type candidate struct {
	key  string
	t    target
	skip string
}

// namedOnly are the A/B targets an empty -only leaves out: they run when -only names them.
var namedOnly = map[string]bool{"iptables-2loops": true, "bind-2loops": true}

// selectTargets returns the targets to run, noting the ones skipped. ceiling is the built ceiling
// forwarder, or ceilingSkip why there is none.
func (rep *report) selectTargets(cfg config, hard int, ceiling, ceilingSkip string, api *legacyAPI) []target {
	all := []candidate{
		{"direct", directTarget(), ""},
		{"iptables", kppTarget("kpp iptables", cfg.proxy, "iptables"), available("iptables-restore")},
		{"kernel", kppTarget("kpp kernel", cfg.proxy, "iptables", "--default-data-path", "kernel"), available("iptables-restore")},
		{"iptables-epoll", kppTarget("kpp iptables epoll", cfg.proxy, "iptables", "--io-engine", "epoll"), available("iptables-restore")},
		{"bind", kppTarget("kpp bind", cfg.proxy, "bind"), ""},
		{"bind-epoll", kppTarget("kpp bind epoll", cfg.proxy, "bind", "--io-engine", "epoll"), ""},
		{"iptables-2loops", kppTarget("kpp iptables 2 UDP loops", cfg.proxy, "iptables", "--udp-loops", "2"), available("iptables-restore")},
		{"bind-2loops", kppTarget("kpp bind 2 UDP loops", cfg.proxy, "bind", "--udp-loops", "2"), ""},
		{"haproxy", haproxyTarget(cfg.idle + fdHeadroom/4), available("haproxy")},
		{"nginx", nginxTarget(cfg.nginxModule, hard), available("nginx", cfg.nginxModule)},
		{"legacy", legacyTarget(cfg.legacy, api), legacySkip(cfg.legacy)},
		{"ceiling", ceilingTarget(ceiling), ceilingSkip},
	}
	if cfg.oldProxy != "" {
		all = append(all,
			candidate{"old-iptables", kppTarget("old iptables", cfg.oldProxy, "iptables"), available("iptables-restore")},
			candidate{"old-bind", kppTarget("old bind", cfg.oldProxy, "bind"), ""})
	}
	if cfg.compare != "" {
		all = append(all, candidate{"compare", compareTarget(strings.Fields(cfg.compare)), ""})
	}
	var out []target
	for _, a := range all {
		if !cfg.wants(a.key) || (namedOnly[a.key] && cfg.only == "") {
			continue
		}
		if a.skip != "" {
			rep.note("%s skipped: %s", a.t.name, a.skip)
			continue
		}
		out = append(out, a.t)
		rep.order = append(rep.order, a.t.name)
	}
	return out
}

// runs says whether -loads selects the load.
func (cfg config) runs(load string) bool {
	return cfg.loads == "" || strings.Contains(","+cfg.loads+",", ","+load+",")
}

// wants says whether -only selects the target with this key.
func (cfg config) wants(key string) bool {
	return cfg.only == "" || strings.Contains(","+cfg.only+",", ","+key+",")
}

func fdHardLimit() (uint64, error) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("descriptor limit: %w", err)
	}
	return lim.Max, nil
}
