package procstat

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

// A process started now is young; this test binary is older than it, and not older than the
// machine's uptime.
func TestAge(t *testing.T) {
	before := time.Now()
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	child, err := Age(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	// Clock ticks of 10 ms and /proc/uptime's two decimals: allow 20 ms either way.
	if bound := time.Since(before) + 20*time.Millisecond; child < -20*time.Millisecond || child > bound {
		t.Fatalf("a child started %v ago has age %v", time.Since(before), child)
	}
	self, err := Age(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if self+20*time.Millisecond < child {
		t.Fatalf("this process (age %v) is younger than its child (age %v)", self, child)
	}
	if _, err := Age(1 << 30); err == nil {
		t.Fatal("no error for a pid that does not exist")
	}
}
