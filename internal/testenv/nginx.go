package testenv

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// nginxBody is what the nginx of StartNginxProxyProtocol answers every request with:
// the addresses the PROXY protocol header gave it, "client-ip:client-port server-ip:server-port"
// ($proxy_protocol_addr:$proxy_protocol_port $proxy_protocol_server_addr:$proxy_protocol_server_port).
const nginxBody = `"$proxy_protocol_addr:$proxy_protocol_port $proxy_protocol_server_addr:$proxy_protocol_server_port"`

// FindNginx returns the nginx binary, or ends the test as Unavailable (Debian's nginx-light:
// hack/install-deps.sh test).
func FindNginx(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"nginx", "/usr/sbin/nginx"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	Unavailable(t, "nginx is not installed (apt-get install nginx-light, or hack/install-deps.sh test)")
	return ""
}

// StartNginxProxyProtocol runs a real nginx, one process in the foreground with its files in a
// temporary directory, whose HTTP server at listen expects the PROXY protocol (`listen ...
// proxy_protocol`, which takes v1 and v2 alike) and answers every request with the addresses the
// header carried: "client-ip:client-port server-ip:server-port". prefix, if any, is prepended to the command (for
// example "ip netns exec pod1" to run it in a namespace). The test's cleanup stops it. It
// returns when nginx has bound its port (checked with the test dialing it through dial, which is
// nil for a plain dial from this namespace).
func StartNginxProxyProtocol(t testing.TB, listen netip.AddrPort, prefix []string, dial func(netip.AddrPort) (net.Conn, error)) {
	t.Helper()
	bin := FindNginx(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(fmt.Sprintf(nginxConf, dir, listen, nginxBody)), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, prefix...), bin, "-p", dir, "-c", path, "-e", filepath.Join(dir, "error.log"))
	exited := runNginx(t, dir, args)
	if dial == nil {
		dial = func(a netip.AddrPort) (net.Conn, error) { return net.DialTimeout("tcp", a.String(), time.Second) }
	}
	WaitFor(t, "nginx to listen on "+listen.String(), func() bool {
		select {
		case err := <-exited:
			exited <- err
			log, _ := os.ReadFile(filepath.Join(dir, "stderr"))
			t.Fatalf("nginx exited: %v\n%s", err, log)
		default:
		}
		c, err := dial(listen)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
}

// nginxConf is StartNginxProxyProtocol's nginx.conf: %[1]s its directory, %[2]s the address it
// listens on, %[3]s the body it answers with.
const nginxConf = `daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log info;
events { worker_connections 64; }
http {
    access_log off;
    client_body_temp_path %[1]s/body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    server {
        listen %[2]s proxy_protocol;
        location / {
            default_type text/plain;
            return 200 %[3]s;
        }
    }
}
`

// runNginx starts the command args, nginx in the foreground with its files in dir, as
// runPeerProcess does, and on a failed test also logs nginx's error log. The channel returned
// receives its exit.
func runNginx(t testing.TB, dir string, args []string) chan error {
	t.Helper()
	exited := runPeerProcess(t, "nginx", dir, args)
	t.Cleanup(func() { // runs before runPeerProcess's: nginx may still be writing, which is fine
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.Logf("nginx error log:\n%s", log)
		}
	})
	return exited
}
