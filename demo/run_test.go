package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// The demo end to end, as `make demo` runs it: the address plan is testbed's (client 172.30.0.2,
// pods 10.244.{1,2}.10, cluster IPs 10.96.0.0/16, node ports on 192.0.2.1), all inside the
// namespaces the demo creates and deletes.

// requireRootAndProxy returns the proxy binary ($KPP_BINARY, relative to the repository root as
// `make test` passes it, or built here). Without root it skips, or fails when KPP_E2E_REQUIRE is set.
func requireRootAndProxy(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		if v := os.Getenv("KPP_E2E_REQUIRE"); v != "" && v != "0" {
			t.Fatal("needs root to create network namespaces, and KPP_E2E_REQUIRE is set")
		}
		t.Skip("needs root to create network namespaces (run the tests as root to cover the demo)")
	}
	if p := os.Getenv("KPP_BINARY"); p != "" {
		if !filepath.IsAbs(p) {
			p = filepath.Join("..", p)
		}
		return p
	}
	out := filepath.Join(t.TempDir(), "kube-portal-proxy")
	cmd := exec.Command("go", "build", "-o", out, "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the proxy (or set KPP_BINARY): %v\n%s", err, msg)
	}
	return out
}

// namespacesLeft returns the namespaces whose names start with the prefix the demo printed.
func namespacesLeft(t *testing.T, out string) []string {
	t.Helper()
	m := regexp.MustCompile(`Namespaces (kpp-[0-9a-f]+-)\{`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("the demo did not name its namespaces:\n%s", out)
	}
	list, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		t.Fatalf("ip netns list: %v", err)
	}
	var left []string
	for _, line := range strings.Split(string(list), "\n") {
		if strings.HasPrefix(line, m[1]) {
			left = append(left, line)
		}
	}
	return left
}

func TestRunShowsTrafficAndCleansUp(t *testing.T) {
	proxy := requireRootAndProxy(t)
	if err := checkTools("iptables"); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"iptables", "bind"} {
		t.Run(mode, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
			defer cancel()
			var out bytes.Buffer
			err := run(ctx, &out, config{proxy: proxy, manifests: "../testdata/demo", mode: mode})
			if err != nil {
				t.Fatalf("run: %v\noutput:\n%s", err, out.String())
			}
			for _, want := range []string{"answered by pod1", "answered by pod2", "connection refused after",
				"kube-portal-proxy observe --service demo/web", " forwarded ", "(pod1)", "(pod2)"} {
				if !strings.Contains(out.String(), want) {
					t.Errorf("output has no %q:\n%s", want, out.String())
				}
			}
			if left := namespacesLeft(t, out.String()); len(left) > 0 {
				t.Errorf("namespaces left behind: %v", left)
			}
		})
	}
}

// A proxy that cannot start (here: no iptables in its PATH) must end the demo at once with the
// proxy's own message, not hang it, and leave nothing behind.
func TestRunReportsProxyThatExitsEarly(t *testing.T) {
	proxy := requireRootAndProxy(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	start := time.Now()
	err := run(ctx, &out, config{proxy: proxy, manifests: "../testdata/demo", mode: "iptables",
		proxyEnv: []string{"PATH=" + t.TempDir()}})
	took := time.Since(start)
	if err == nil {
		t.Fatalf("run: no error, want the proxy's exit\noutput:\n%s", out.String())
	}
	for _, want := range []string{"proxy exited early", "exit status 1", "iptables not found in PATH"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	// Before the readiness deadline: the exit is seen when it happens, not when polling gives up.
	if took >= readyTimeout {
		t.Errorf("run took %v to report the exit", took)
	}
	if left := namespacesLeft(t, out.String()); len(left) > 0 {
		t.Errorf("namespaces left behind: %v", left)
	}
}
