package proxier

import (
	"errors"
	"testing"
)

func TestParsePortRange(t *testing.T) {
	tests := []struct {
		in      string
		want    PortRange
		wantErr bool
	}{
		{"", PortRange{}, false},
		{"0", PortRange{}, false},
		{"0-0", PortRange{}, false},
		{"30000-30009", PortRange{Base: 30000, Size: 10}, false},
		{"30000+9", PortRange{Base: 30000, Size: 10}, false},
		{"40000", PortRange{Base: 40000, Size: 1}, false},
		{"10-5", PortRange{}, true},
		{"1-70000", PortRange{}, true},
		{"a-b", PortRange{}, true},
		{"5+-1", PortRange{}, true},
	}
	for _, tc := range tests {
		got, err := ParsePortRange(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParsePortRange(%q) = %+v, %v; want %+v, err=%v", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestPortAllocator(t *testing.T) {
	t.Run("kernel_chosen_is_zero", func(t *testing.T) {
		a := newPortAllocator(PortRange{}, KernelPorts{})
		if p, err := a.allocate(); p != 0 || err != nil {
			t.Errorf("allocate = %d, %v; want 0, nil", p, err)
		}
	})
	t.Run("fully_allocated_then_released", func(t *testing.T) {
		a := newPortAllocator(PortRange{Base: 1, Size: 1}, KernelPorts{})
		if p, err := a.allocate(); p != 1 || err != nil {
			t.Fatalf("allocate = %d, %v; want 1", p, err)
		}
		if _, err := a.allocate(); !errors.Is(err, ErrPortsExhausted) {
			t.Fatalf("second allocate err = %v, want ErrPortsExhausted", err)
		}
		a.release(1)
		if p, err := a.allocate(); p != 1 || err != nil {
			t.Fatalf("after release allocate = %d, %v; want 1", p, err)
		}
	})
	t.Run("every_port_once", func(t *testing.T) {
		a := newPortAllocator(PortRange{Base: 100, Size: 100}, KernelPorts{})
		seen := map[uint16]bool{}
		for range 100 {
			p, err := a.allocate()
			if err != nil || p < 100 || p > 199 || seen[p] {
				t.Fatalf("allocate = %d, %v (seen before: %v)", p, err, seen[p])
			}
			seen[p] = true
		}
		if _, err := a.allocate(); !errors.Is(err, ErrPortsExhausted) {
			t.Fatalf("101st allocate err = %v, want ErrPortsExhausted", err)
		}
		a.release(150)
		a.release(7) // outside the range: ignored
		if p, _ := a.allocate(); p != 150 {
			t.Errorf("allocate after releasing 150 = %d", p)
		}
	})
	t.Run("kernel_range_handed_out_without_reserved_ports", func(t *testing.T) {
		a := newPortAllocator(PortRange{}, KernelPorts{Range: PortRange{Base: 32768, Size: 4},
			Reserved: []PortRange{{Base: 32769, Size: 1}, {Base: 40000, Size: 1}}})
		seen := map[uint16]bool{}
		for range 3 {
			p, err := a.allocate()
			if err != nil || p < 32768 || p > 32771 || p == 32769 || seen[p] {
				t.Fatalf("allocate = %d, %v; want a free port of 32768-32771 other than reserved 32769 (seen: %v)", p, err, seen)
			}
			seen[p] = true
		}
		if p, err := a.allocate(); p != 0 || err != nil {
			t.Errorf("allocate with the range used up = %d, %v; want 0 (the kernel chooses), nil", p, err)
		}
	})
}

func TestPortAllocatorTake(t *testing.T) {
	tests := []struct {
		name  string
		r     PortRange
		kp    KernelPorts
		port  uint16
		twice bool // taken again after the first take
		want  bool
	}{
		{"kernel_chosen_any_port", PortRange{}, KernelPorts{}, 45000, false, true},
		{"in_range", PortRange{Base: 34000, Size: 10}, KernelPorts{}, 34005, false, true},
		{"in_range_already_used", PortRange{Base: 34000, Size: 10}, KernelPorts{}, 34005, true, false},
		{"outside_range", PortRange{Base: 34000, Size: 10}, KernelPorts{}, 35000, false, false},
		{"kernel_range", PortRange{}, KernelPorts{Range: PortRange{Base: 32768, Size: 100}}, 32800, true, false},
		{"outside_kernel_range", PortRange{}, KernelPorts{Range: PortRange{Base: 32768, Size: 100}}, 20000, false, true},
		{"zero", PortRange{}, KernelPorts{}, 0, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := newPortAllocator(tt.r, tt.kp)
			got := a.take(tt.port)
			if tt.twice {
				got = a.take(tt.port)
			}
			if got != tt.want {
				t.Errorf("take(%d) = %v, want %v", tt.port, got, tt.want)
			}
		})
	}
}
