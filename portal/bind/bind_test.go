package bind

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan for the bind tests: cluster IPs 10.96.0.0/16 and fd00:96::/112, external IP
// 203.0.113.7, load-balancer IP 198.51.100.20, all put on kube-portal0 as host prefixes.

func bindSpecs() []portal.Spec {
	return []portal.Spec{
		{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
			ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ExternalIPs: addrs("203.0.113.7"),
			LoadBalancerIPs: addrs("198.51.100.20"), ProxyPort: 80},
		{Name: spn("kube-system", "dns", "dns"), Protocol: service.UDP, Port: 53,
			ClusterIPs: addrs("10.96.0.53"), ProxyPort: 53},
	}
}

func prefixes(s ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(s))
	for i, p := range s {
		out[i] = netip.MustParsePrefix(p)
	}
	return out
}

func quietLogger() (logrus.FieldLogger, *logtest.Hook) {
	l, hook := logtest.NewNullLogger()
	l.SetLevel(logrus.DebugLevel)
	return l, hook
}

const strictSysctls = "sysctl net/ipv4/conf/all/arp_announce=2\nsysctl net/ipv4/conf/all/arp_ignore=1\n"

func TestBindSync(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		setup   func(f *FakeLink)
		specs   []portal.Spec
		wantErr string
		// wantDump is FakeLink.Dump after the Sync; wantOps the changes, in order.
		wantDump string
		wantOps  []string
	}{
		{
			name:  "first_sync_sets_sysctls_then_creates_a_dummy_then_adds_every_service_address",
			specs: bindSpecs(),
			wantDump: "link kube-portal0 dummy up\n  10.96.0.10/32\n  10.96.0.53/32\n  198.51.100.20/32\n" +
				"  203.0.113.7/32\n  fd00:96::10/128\n" + strictSysctls,
			wantOps: []string{
				"set-sysctl net/ipv4/conf/all/arp_ignore=1",
				"set-sysctl net/ipv4/conf/all/arp_announce=2",
				"add-link kube-portal0 dummy",
				"add-addr kube-portal0 10.96.0.10/32",
				"add-addr kube-portal0 10.96.0.53/32",
				"add-addr kube-portal0 198.51.100.20/32",
				"add-addr kube-portal0 203.0.113.7/32",
				"add-addr kube-portal0 fd00:96::10/128",
			},
		},
		{
			name:     "falls_back_to_a_bridge_when_the_kernel_has_no_dummy",
			setup:    func(f *FakeLink) { f.Unsupported = map[string]bool{LinkTypeDummy: true} },
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 bridge up\n  10.96.0.53/32\n" + strictSysctls,
			wantOps: []string{
				"set-sysctl net/ipv4/conf/all/arp_ignore=1",
				"set-sysctl net/ipv4/conf/all/arp_announce=2",
				"add-link kube-portal0 bridge",
				"add-addr kube-portal0 10.96.0.53/32",
			},
		},
		{
			name:     "an_explicit_link_type_has_no_fallback",
			cfg:      Config{LinkType: "vrf"},
			setup:    func(f *FakeLink) { f.Unsupported = map[string]bool{"vrf": true} },
			specs:    bindSpecs()[1:],
			wantErr:  "portal bind kube-portal0: create link: link kube-portal0: link type not supported by the kernel: vrf",
			wantDump: strictSysctls,
			wantOps: []string{
				"set-sysctl net/ipv4/conf/all/arp_ignore=1",
				"set-sysctl net/ipv4/conf/all/arp_announce=2",
			},
		},
		{
			name:     "custom_interface_name",
			cfg:      Config{Interface: "svc0"},
			specs:    bindSpecs()[1:],
			wantDump: "link svc0 dummy up\n  10.96.0.53/32\n" + strictSysctls,
			wantOps: []string{
				"set-sysctl net/ipv4/conf/all/arp_ignore=1",
				"set-sysctl net/ipv4/conf/all/arp_announce=2",
				"add-link svc0 dummy",
				"add-addr svc0 10.96.0.53/32",
			},
		},
		{
			name: "an_address_shared_by_several_service_ports_is_added_once",
			setup: func(f *FakeLink) {
				strictARP(f)
			},
			specs: []portal.Spec{
				{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, ClusterIPs: addrs("10.96.0.10")},
				{Name: spn("default", "web", "https"), Protocol: service.TCP, Port: 443, ClusterIPs: addrs("10.96.0.10")},
				{Name: spn("default", "web", "quic"), Protocol: service.UDP, Port: 443, ClusterIPs: addrs("10.96.0.10"),
					ExternalIPs: addrs("10.96.0.10")},
			},
			wantDump: "link kube-portal0 dummy up\n  10.96.0.10/32\n" + strictSysctls,
			wantOps:  []string{"add-link kube-portal0 dummy", "add-addr kube-portal0 10.96.0.10/32"},
		},
		{
			name: "addresses_that_cannot_be_service_IPs_are_skipped_and_mapped_ones_unmapped",
			setup: func(f *FakeLink) {
				strictARP(f)
			},
			specs: []portal.Spec{{Name: spn("default", "odd", ""), Protocol: service.TCP, Port: 80,
				ClusterIPs:  []netip.Addr{{}, netip.MustParseAddr("::ffff:10.96.0.7")},
				ExternalIPs: addrs("0.0.0.0", "127.0.0.1", "::1", "fe80::1", "169.254.0.1", "224.0.0.1", "ff02::1")}},
			wantDump: "link kube-portal0 dummy up\n  10.96.0.7/32\n" + strictSysctls,
			wantOps:  []string{"add-link kube-portal0 dummy", "add-addr kube-portal0 10.96.0.7/32"},
		},
		{
			name: "sysctls_that_already_keep_service_IPs_off_the_LAN_are_left_alone",
			setup: func(f *FakeLink) {
				f.SetSysctlValue(sysctlARPIgnore, "2")
				f.SetSysctlValue(sysctlARPAnnounce, "2")
			},
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 dummy up\n  10.96.0.53/32\nsysctl net/ipv4/conf/all/arp_announce=2\nsysctl net/ipv4/conf/all/arp_ignore=2\n",
			wantOps:  []string{"add-link kube-portal0 dummy", "add-addr kube-portal0 10.96.0.53/32"},
		},
		{
			name:     "arp_ignore_3_still_answers_for_global_addresses_so_it_becomes_1",
			setup:    func(f *FakeLink) { f.SetSysctlValue(sysctlARPIgnore, "3") },
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 dummy up\n  10.96.0.53/32\n" + strictSysctls,
			wantOps: []string{
				"set-sysctl net/ipv4/conf/all/arp_ignore=1",
				"set-sysctl net/ipv4/conf/all/arp_announce=2",
				"add-link kube-portal0 dummy",
				"add-addr kube-portal0 10.96.0.53/32",
			},
		},
		{
			name:     "LeaveARPSysctls_touches_no_sysctl",
			cfg:      Config{LeaveARPSysctls: true},
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 dummy up\n  10.96.0.53/32\nsysctl net/ipv4/conf/all/arp_announce=0\nsysctl net/ipv4/conf/all/arp_ignore=0\n",
			wantOps:  []string{"add-link kube-portal0 dummy", "add-addr kube-portal0 10.96.0.53/32"},
		},
		{
			name: "a_sysctl_that_cannot_be_set_stops_the_sync_before_any_address",
			setup: func(f *FakeLink) {
				f.Fail = func(op, _ string) error {
					if op == "set-sysctl" {
						return errors.New("read-only file system")
					}
					return nil
				}
			},
			specs:    bindSpecs(),
			wantErr:  "portal bind kube-portal0: keep service IPs out of ARP: fake set-sysctl net/ipv4/conf/all/arp_ignore=1: read-only file system",
			wantDump: "sysctl net/ipv4/conf/all/arp_announce=0\nsysctl net/ipv4/conf/all/arp_ignore=0\n",
		},
		{
			name: "a_restart_keeps_wanted_addresses_removes_the_rest_and_leaves_link_local_alone",
			setup: func(f *FakeLink) {
				strictARP(f)
				f.AddLink(DefaultInterface, LinkTypeDummy, true,
					prefixes("10.96.0.53/32", "10.96.0.99/32", "fd00:96::99/128", "fe80::1/64")...)
			},
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 dummy up\n  10.96.0.53/32\n  fe80::1/64\n" + strictSysctls,
			wantOps:  []string{"del-addr kube-portal0 10.96.0.99/32", "del-addr kube-portal0 fd00:96::99/128"},
		},
		{
			name: "an_existing_bridge_from_an_earlier_fallback_is_ours",
			setup: func(f *FakeLink) {
				strictARP(f)
				f.AddLink(DefaultInterface, LinkTypeBridge, true, prefixes("10.96.0.53/32")...)
			},
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 bridge up\n  10.96.0.53/32\n" + strictSysctls,
		},
		{
			name: "a_link_of_ours_that_is_down_is_brought_up",
			setup: func(f *FakeLink) {
				strictARP(f)
				f.AddLink(DefaultInterface, LinkTypeDummy, false)
			},
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 dummy up\n  10.96.0.53/32\n" + strictSysctls,
			wantOps:  []string{"set-up kube-portal0", "add-addr kube-portal0 10.96.0.53/32"},
		},
		{
			name: "a_foreign_link_of_that_name_is_refused_and_left_alone",
			setup: func(f *FakeLink) {
				strictARP(f)
				f.AddLink(DefaultInterface, "veth", false, prefixes("192.168.7.1/24")...)
			},
			specs:    bindSpecs()[1:],
			wantErr:  `portal bind kube-portal0: a link of that name and kind "veth" exists and is not ours (we create [dummy bridge]); remove it or choose another interface name`,
			wantDump: "link kube-portal0 veth down\n  192.168.7.1/24\n" + strictSysctls,
		},
		{
			name: "a_wanted_address_with_another_prefix_length_is_replaced_first",
			setup: func(f *FakeLink) {
				strictARP(f)
				f.AddLink(DefaultInterface, LinkTypeDummy, true, prefixes("10.96.0.1/32", "10.96.0.53/24")...)
			},
			specs:    bindSpecs()[1:],
			wantDump: "link kube-portal0 dummy up\n  10.96.0.53/32\n" + strictSysctls,
			wantOps: []string{
				"del-addr kube-portal0 10.96.0.53/24",
				"add-addr kube-portal0 10.96.0.53/32",
				"del-addr kube-portal0 10.96.0.1/32",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := NewFakeLink()
			if tt.setup != nil {
				tt.setup(f)
			}
			cfg := tt.cfg
			cfg.Logger, _ = quietLogger()
			b := New(cfg, f)
			if ops := f.Ops(); len(ops) != 0 {
				t.Fatalf("New changed something: %v", ops)
			}
			checkOutcome(t, "Sync", b.Sync(t.Context(), tt.specs), tt.wantErr, f, tt.wantDump, tt.wantOps)
		})
	}
}

// strictARP sets the ARP sysctls as Sync wants them, as a node where they are set already.
func strictARP(f *FakeLink) {
	f.SetSysctlValue(sysctlARPIgnore, "1")
	f.SetSysctlValue(sysctlARPAnnounce, "2")
}

// checkOutcome compares what op did to the fake link with the want: its error text ("" for nil),
// the link state after it and the changes it made.
func checkOutcome(t *testing.T, op string, err error, wantErr string, f *FakeLink, wantDump string, wantOps []string) {
	t.Helper()
	gotErr := ""
	if err != nil {
		gotErr = err.Error()
	}
	if gotErr != wantErr {
		t.Errorf("%s error:\n got %q\nwant %q", op, gotErr, wantErr)
	}
	if d := cmp.Diff(wantDump, f.Dump()); d != "" {
		t.Errorf("state after %s (-want +got):\n%s", op, d)
	}
	if d := cmp.Diff(wantOps, f.Ops()); d != "" {
		t.Errorf("changes (-want +got):\n%s", d)
	}
}

func TestBindFallbackLogsOnce(t *testing.T) {
	f := NewFakeLink()
	f.Unsupported = map[string]bool{LinkTypeDummy: true}
	logger, hook := quietLogger()
	b := New(Config{Logger: logger}, f)
	for range 3 {
		if err := b.Sync(t.Context(), bindSpecs()); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for _, e := range hook.AllEntries() {
		if strings.Contains(e.Message, "link type") {
			got = append(got, e.Message)
		}
	}
	want := []string{"The kernel has no dummy link type; the portal interface is a bridge without ports instead"}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("fallback log lines (-want +got):\n%s", d)
	}
	if got := b.Kind(); got != LinkTypeBridge {
		t.Errorf("Kind() = %q, want %q", got, LinkTypeBridge)
	}
}

// TestBindSyncDiff runs Syncs in a row and checks that each changes exactly the difference.
func TestBindSyncDiff(t *testing.T) {
	web, dns := bindSpecs()[0], bindSpecs()[1]
	moved := dns
	moved.ClusterIPs = addrs("10.96.0.54")
	steps := []struct {
		name    string
		specs   []portal.Spec
		wantOps []string
		want    []netip.Addr
	}{
		{
			name:    "one_service",
			specs:   []portal.Spec{dns},
			wantOps: []string{"add-addr kube-portal0 10.96.0.53/32"},
			want:    addrs("10.96.0.53"),
		},
		{
			name:  "adding_a_service_adds_only_its_addresses",
			specs: []portal.Spec{dns, web},
			wantOps: []string{
				"add-addr kube-portal0 10.96.0.10/32",
				"add-addr kube-portal0 198.51.100.20/32",
				"add-addr kube-portal0 203.0.113.7/32",
				"add-addr kube-portal0 fd00:96::10/128",
			},
			want: addrs("10.96.0.10", "10.96.0.53", "198.51.100.20", "203.0.113.7", "fd00:96::10"),
		},
		{
			name:    "nothing_changed_changes_nothing",
			specs:   []portal.Spec{web, dns},
			wantOps: nil,
			want:    addrs("10.96.0.10", "10.96.0.53", "198.51.100.20", "203.0.113.7", "fd00:96::10"),
		},
		{
			name:    "a_changed_address_is_added_before_the_old_one_is_removed",
			specs:   []portal.Spec{web, moved},
			wantOps: []string{"add-addr kube-portal0 10.96.0.54/32", "del-addr kube-portal0 10.96.0.53/32"},
			want:    addrs("10.96.0.10", "10.96.0.54", "198.51.100.20", "203.0.113.7", "fd00:96::10"),
		},
		{
			name:  "removing_a_service_removes_only_its_addresses",
			specs: []portal.Spec{moved},
			wantOps: []string{
				"del-addr kube-portal0 10.96.0.10/32",
				"del-addr kube-portal0 198.51.100.20/32",
				"del-addr kube-portal0 203.0.113.7/32",
				"del-addr kube-portal0 fd00:96::10/128",
			},
			want: addrs("10.96.0.54"),
		},
		{
			name:    "no_services_leave_the_link_empty_but_in_place",
			specs:   nil,
			wantOps: []string{"del-addr kube-portal0 10.96.0.54/32"},
			want:    []netip.Addr{},
		},
	}
	f := NewFakeLink()
	logger, _ := quietLogger()
	b := New(Config{Logger: logger}, f)
	if err := b.Sync(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			f.ResetOps()
			if err := b.Sync(t.Context(), s.specs); err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(s.wantOps, f.Ops()); d != "" {
				t.Errorf("changes (-want +got):\n%s", d)
			}
			if d := cmp.Diff(s.want, b.Addresses(), cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); d != "" {
				t.Errorf("Addresses() (-want +got):\n%s", d)
			}
		})
	}
}

// TestBindRestartReconciles runs a second Bind on the link a first one left behind.
func TestBindRestartReconciles(t *testing.T) {
	f := NewFakeLink()
	logger, _ := quietLogger()
	if err := New(Config{Logger: logger}, f).Sync(t.Context(), bindSpecs()); err != nil {
		t.Fatal(err)
	}
	f.ResetOps()

	restarted := New(Config{Logger: logger}, f)
	if got := restarted.Addresses(); len(got) != 0 {
		t.Errorf("Addresses() before the first Sync = %v, want none", got)
	}
	kept := bindSpecs()[0]
	kept.ExternalIPs = nil
	if err := restarted.Sync(t.Context(), []portal.Spec{kept}); err != nil {
		t.Fatal(err)
	}
	want := []string{"del-addr kube-portal0 10.96.0.53/32", "del-addr kube-portal0 203.0.113.7/32"}
	if d := cmp.Diff(want, f.Ops()); d != "" {
		t.Errorf("changes after the restart (-want +got):\n%s", d)
	}
	wantAddrs := addrs("10.96.0.10", "198.51.100.20", "fd00:96::10")
	if d := cmp.Diff(wantAddrs, restarted.Addresses(), cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); d != "" {
		t.Errorf("Addresses() (-want +got):\n%s", d)
	}
}

func TestBindPartialFailure(t *testing.T) {
	f := NewFakeLink()
	failing := "kube-portal0 10.96.0.53/32"
	f.Fail = func(op, obj string) error {
		if obj == failing {
			return errors.New("no buffer space available")
		}
		return nil
	}
	logger, _ := quietLogger()
	b := New(Config{Logger: logger}, f)
	err := b.Sync(t.Context(), bindSpecs())
	want := "portal kube-system/dns:dns: bind kube-portal0: add address 10.96.0.53/32: fake add-addr kube-portal0 10.96.0.53/32: no buffer space available"
	if err == nil || err.Error() != want {
		t.Fatalf("Sync error:\n got %v\nwant %s", err, want)
	}
	t.Run("the_other_addresses_are_in_place_and_Addresses_says_what_is_there", func(t *testing.T) {
		wantAddrs := addrs("10.96.0.10", "198.51.100.20", "203.0.113.7", "fd00:96::10")
		if d := cmp.Diff(wantAddrs, b.Addresses(), cmp.Comparer(func(a, b netip.Addr) bool { return a == b })); d != "" {
			t.Errorf("Addresses() (-want +got):\n%s", d)
		}
	})
	t.Run("the_next_sync_adds_only_the_failed_address", func(t *testing.T) {
		f.Fail = nil
		f.ResetOps()
		if err := b.Sync(t.Context(), bindSpecs()); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff([]string{"add-addr kube-portal0 10.96.0.53/32"}, f.Ops()); d != "" {
			t.Errorf("changes (-want +got):\n%s", d)
		}
	})
	t.Run("a_failed_removal_is_retried", func(t *testing.T) {
		failing = "kube-portal0 203.0.113.7/32"
		f.Fail = func(op, obj string) error {
			if obj == failing {
				return errors.New("busy")
			}
			return nil
		}
		if err := b.Sync(t.Context(), bindSpecs()[1:]); err == nil || !strings.Contains(err.Error(), "remove address 203.0.113.7/32") {
			t.Fatalf("Sync error = %v, want one naming the removal of 203.0.113.7/32", err)
		}
		if !slices.Contains(b.Addresses(), netip.MustParseAddr("203.0.113.7")) {
			t.Errorf("Addresses() = %v, want 203.0.113.7 still listed", b.Addresses())
		}
		f.Fail = nil
		f.ResetOps()
		if err := b.Sync(t.Context(), bindSpecs()[1:]); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff([]string{"del-addr kube-portal0 203.0.113.7/32"}, f.Ops()); d != "" {
			t.Errorf("changes (-want +got):\n%s", d)
		}
	})
}

func TestBindRecreatesADeletedLink(t *testing.T) {
	f := NewFakeLink()
	logger, _ := quietLogger()
	b := New(Config{Logger: logger}, f)
	if err := b.Sync(t.Context(), bindSpecs()[1:]); err != nil {
		t.Fatal(err)
	}
	if err := f.DeleteLink(t.Context(), DefaultInterface); err != nil {
		t.Fatal(err)
	}
	f.ResetOps()
	if err := b.Sync(t.Context(), bindSpecs()[1:]); err != nil {
		t.Fatal(err)
	}
	want := []string{"add-link kube-portal0 dummy", "add-addr kube-portal0 10.96.0.53/32"}
	if d := cmp.Diff(want, f.Ops()); d != "" {
		t.Errorf("changes (-want +got):\n%s", d)
	}
}

func TestBindCleanup(t *testing.T) {
	tests := []struct {
		name     string
		setup    func(f *FakeLink)
		wantErr  string
		wantDump string
		wantOps  []string
	}{
		{
			name:     "deletes_our_link",
			setup:    func(f *FakeLink) { f.AddLink(DefaultInterface, LinkTypeDummy, true, prefixes("10.96.0.10/32")...) },
			wantDump: "sysctl net/ipv4/conf/all/arp_announce=0\nsysctl net/ipv4/conf/all/arp_ignore=0\n",
			wantOps:  []string{"del-link kube-portal0"},
		},
		{
			name:     "deletes_a_bridge_left_by_the_fallback",
			setup:    func(f *FakeLink) { f.AddLink(DefaultInterface, LinkTypeBridge, true) },
			wantDump: "sysctl net/ipv4/conf/all/arp_announce=0\nsysctl net/ipv4/conf/all/arp_ignore=0\n",
			wantOps:  []string{"del-link kube-portal0"},
		},
		{
			name:     "no_link_is_fine",
			wantDump: "sysctl net/ipv4/conf/all/arp_announce=0\nsysctl net/ipv4/conf/all/arp_ignore=0\n",
		},
		{
			name:     "a_foreign_link_is_left_alone",
			setup:    func(f *FakeLink) { f.AddLink(DefaultInterface, "", true) },
			wantErr:  `portal bind kube-portal0: cleanup: the link has kind "", not one of ours ([dummy bridge]); left alone`,
			wantDump: "link kube-portal0  up\nsysctl net/ipv4/conf/all/arp_announce=0\nsysctl net/ipv4/conf/all/arp_ignore=0\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := NewFakeLink()
			if tt.setup != nil {
				tt.setup(f)
			}
			logger, _ := quietLogger()
			b := New(Config{Logger: logger}, f)
			checkOutcome(t, "Cleanup", b.Cleanup(t.Context()), tt.wantErr, f, tt.wantDump, tt.wantOps)
		})
	}
}

func TestBindCleanupAfterSyncForgetsAddresses(t *testing.T) {
	f := NewFakeLink()
	logger, _ := quietLogger()
	b := New(Config{Logger: logger}, f)
	if err := b.Sync(t.Context(), bindSpecs()); err != nil {
		t.Fatal(err)
	}
	if err := b.Cleanup(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := b.Addresses(); len(got) != 0 {
		t.Errorf("Addresses() after Cleanup = %v, want none", got)
	}
	if got := b.Kind(); got != "" {
		t.Errorf("Kind() after Cleanup = %q, want none", got)
	}
}
