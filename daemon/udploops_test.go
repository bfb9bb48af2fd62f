package daemon

import "testing"

func TestUDPLoopsDefault(t *testing.T) {
	for _, c := range []struct {
		flag  int
		mode  string
		procs int
		want  int
	}{
		{0, "bind", 2, 2},
		{0, "bind", 1, 1},
		{0, "iptables", 2, 1},
		{0, "iptables", 8, 1},
		{3, "iptables", 2, 3},
		{1, "bind", 4, 1},
	} {
		if got := udpLoops(c.flag, c.mode, c.procs); got != c.want {
			t.Errorf("udpLoops(--udp-loops %d, %s mode, %d CPUs) = %d, want %d", c.flag, c.mode, c.procs, got, c.want)
		}
	}
}
