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
		a := newPortAllocator(PortRange{})
		if p, err := a.allocate(); p != 0 || err != nil {
			t.Errorf("allocate = %d, %v; want 0, nil", p, err)
		}
	})
	t.Run("fully_allocated_then_released", func(t *testing.T) {
		a := newPortAllocator(PortRange{Base: 1, Size: 1})
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
		a := newPortAllocator(PortRange{Base: 100, Size: 100})
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
}
