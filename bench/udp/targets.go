package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// target is something to send the load to: it starts, returns the address to load and the pid
// whose CPU to measure (0: none), and a stop function.
type target struct {
	name  string
	start func(ctx context.Context) (addr netip.AddrPort, pid int, stop func(), err error)
}

func directTarget(echo netip.AddrPort) target {
	return target{name: "direct", start: func(context.Context) (netip.AddrPort, int, func(), error) {
		return echo, 0, func() {}, nil
	}}
}

// proxyTarget runs this binary (or bin) as "-role proxy" in front of echo.
// bin is the binary to run ("" for this one), to compare builds.
func proxyTarget(name, bin string, echo netip.AddrPort, batch int, profile string) target {
	return target{name: name, start: func(ctx context.Context) (netip.AddrPort, int, func(), error) {
		return startChild(ctx, bin, "-role", "proxy", "-backend", echo.String(),
			"-batch", strconv.Itoa(batch), "-cpuprofile", profile)
	}}
}

// startChild runs bin ("" for this binary) with args; the child prints the address it serves on
// its first stdout line and runs until SIGTERM.
func startChild(ctx context.Context, bin string, args ...string) (netip.AddrPort, int, func(), error) {
	if bin == "" {
		self, err := os.Executable()
		if err != nil {
			return netip.AddrPort{}, 0, nil, err
		}
		bin = self
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the harness
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return netip.AddrPort{}, 0, nil, err
	}
	if err := cmd.Start(); err != nil {
		return netip.AddrPort{}, 0, nil, err
	}
	stop := func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		stop()
		return netip.AddrPort{}, 0, nil, fmt.Errorf("child %v: %w", args, err)
	}
	addr, err := netip.ParseAddrPort(strings.TrimSpace(line))
	if err != nil {
		stop()
		return netip.AddrPort{}, 0, nil, err
	}
	return addr, cmd.Process.Pid, stop, nil
}

// runEchoChild serves the echo endpoint until SIGTERM, printing its address first.
func runEchoChild(listen string) error {
	e, err := startEcho(listen)
	if err != nil {
		return err
	}
	defer e.close()
	fmt.Println(e.addr)
	ctx, cancel := signalContext()
	defer cancel()
	<-ctx.Done()
	return nil
}

type onePicker netip.AddrPort

func (p onePicker) Next(netip.Addr, bool) (netip.AddrPort, error) { return netip.AddrPort(p), nil }

// runProxyChild serves one UDP service port until SIGTERM, printing its address first.
func runProxyChild(listen, backend string, batch int, profile string) error {
	if profile != "" {
		f, err := os.Create(profile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	ep, err := netip.ParseAddrPort(backend)
	if err != nil {
		return err
	}
	logger := logrus.New()
	logger.SetLevel(logrus.WarnLevel)
	p := udp.New(service.ServicePortName{Namespace: "bench", Name: "echo"}, onePicker(ep),
		udp.Config{Logger: logger, BatchSize: batch})
	if err := p.Listen(netip.MustParseAddrPort(listen)); err != nil {
		return err
	}
	fmt.Println(p.Addr())
	ctx, cancel := signalContext()
	defer cancel()
	return p.Run(ctx)
}

func signalContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, os.Interrupt)
	go func() {
		select {
		case <-ch:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

const nginxConf = `load_module /usr/lib/nginx/modules/ngx_stream_module.so;
daemon off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
stream {
    server {
        listen %[2]s udp;
        proxy_pass %[3]s;
        proxy_timeout 10s;
    }
}
`

// nginxTarget runs nginx (master and one worker, like one proxy loop) with a stream server in
// front of echo.
func nginxTarget(bin string, echo netip.AddrPort) target {
	return target{name: "nginx stream udp", start: func(ctx context.Context) (netip.AddrPort, int, func(), error) {
		dir, err := os.MkdirTemp("", "bench-udp-nginx-")
		if err != nil {
			return netip.AddrPort{}, 0, nil, err
		}
		port, err := freeUDPPort()
		if err != nil {
			os.RemoveAll(dir)
			return netip.AddrPort{}, 0, nil, err
		}
		addr := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)
		conf := filepath.Join(dir, "nginx.conf")
		if err := os.WriteFile(conf, fmt.Appendf(nil, nginxConf, dir, addr, echo), 0o644); err != nil {
			os.RemoveAll(dir)
			return netip.AddrPort{}, 0, nil, err
		}
		cmd := exec.CommandContext(ctx, bin, "-c", conf, "-p", dir, "-e", filepath.Join(dir, "error.log"))
		cmd.Stdout, cmd.Stderr = io.Discard, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // the worker exits with its master
		if err := cmd.Start(); err != nil {
			os.RemoveAll(dir)
			return netip.AddrPort{}, 0, nil, err
		}
		stop := func() {
			cmd.Process.Signal(syscall.SIGQUIT)
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				cmd.Process.Kill()
				<-done
			}
			os.RemoveAll(dir)
		}
		return addr, cmd.Process.Pid, stop, nil
	}}
}

func freeUDPPort() (uint16, error) {
	c, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return 0, err
	}
	defer c.Close()
	return uint16(c.LocalAddr().(*net.UDPAddr).Port), nil
}
