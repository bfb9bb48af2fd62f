# sudo drops /usr/local/go/bin from PATH on most systems; find go anyway, and put its directory
# on PATH for the scripts and tests that run it.
GO ?= $(shell command -v go 2>/dev/null || echo /usr/local/go/bin/go)
export PATH := $(dir $(GO)):$(PATH)
BIN := bin/kube-portal-proxy
# Evaluated once per make run (a recursive variable would ask git again at every use, and a commit
# made meanwhile would give the image and the manifests different tags).
ifeq ($(origin VERSION),undefined)
VERSION := $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
endif
LDFLAGS := -X main.version=$(VERSION)

.PHONY: image-preflight cluster-preflight bench-preflight soak-preflight build test test-deps unit fuzz fuzz-ci allocs e2e e2e-epoll soak controlplane demo demo-deps deps lint bench bench-quick bench-micro bench-portal image image-oci image-oci-test cluster cluster-build cluster-smoke cluster-down cluster-test cluster-swap cluster-rollout conformance conformance-ci conformance-build clean

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) .

# demo runs the proxy on its embedded default (testdata/demo) in throwaway network namespaces
# and shows real traffic through the portals. Needs root (or sudo); installs iproute2 and
# iptables first when they are missing (apt-get), or says what to run.
demo: demo-deps build
	$(GO) run ./demo

demo-deps:
	@if [ "$$(id -u)" != 0 ]; then echo "make demo needs root for network namespaces: run it as root, or: sudo make demo" >&2; exit 2; fi
	@hack/install-deps.sh demo

# deps installs what the demo and the tests need (Debian/Ubuntu, as root), or says what to run.
deps:
	@hack/install-deps.sh demo test

# controlplane builds kube-apiserver, etcd and kubectl once into ~/.cache/kube-portal-proxy
# (about 8 minutes cold on 2 cores; a no-op when cached).
controlplane:
	hack/controlplane-build.sh >/dev/null

# test is the command README and CI run: every unit test and the end-to-end suite (real
# kube-apiserver + etcd, real iptables in network namespaces) with the race detector. Run as root:
# it first installs the packages the tests use when they are missing (test-deps), so a fresh
# Debian/Ubuntu machine needs only Go and make, and every test must run (KPP_E2E_REQUIRE=1).
# Without root the namespace tests skip with a message.
test: test-deps build controlplane
	KPP_BINARY=$(abspath $(BIN)) KPP_E2E_REQUIRE=$(if $(filter 0,$(shell id -u)),1,) $(GO) test -race -count=1 -timeout 20m ./...
	$(MAKE) --no-print-directory fuzz-ci
	$(MAKE) --no-print-directory allocs

# allocs runs the allocation guards on both engines without the race detector, under which
# sync.Pool drops a quarter of what is put back and so allocates where production does not.
allocs:
	KPP_E2E_REQUIRE=$(if $(filter 0,$(shell id -u)),1,) $(GO) test -count=1 -run 'TestKeepAliveRequestAllocatesNothing|TestEveryTestOnIOUring' ./tcp/

test-deps:
	@if [ "$$(id -u)" = 0 ]; then hack/install-deps.sh demo test; fi

# Fuzz targets (package:FuzzName), one per decoder of outside input: the restart snapshot, the
# PROXY header encoder and parser, the bind state file, the restart's iptables-save reader, the
# hand-over's messages from either side, the per-Service annotations, the services file and its
# fast decoder. go test already runs their seeds (f.Add and testdata/fuzz/) as tests; these
# search beyond them.
FUZZ_TARGETS := ./proxier/snapshot:FuzzDecode ./proxier/snapshot:FuzzDecodeBody ./proxyprotocol:FuzzHeaderRoundTrip ./proxyprotocol:FuzzParse ./portal/bind:FuzzDecodeState \
	./portal/iptables:FuzzReadSteered ./portal/iptables:FuzzParseRule ./handover:FuzzReceive ./handover:FuzzServe \
	./proxier:FuzzServiceAnnotations ./proxier/config:FuzzServicesFile ./proxier/config:FuzzDecodeDocument \
	./observe:FuzzParseRequest ./observe:FuzzAppendFlowItem ./observe/pcap:FuzzWriteItems
FUZZTIME ?= 10m
# CI budgets by executions, not by time: a -fuzztime duration races Go's fuzzing coordinator,
# which can fail a target with "context deadline exceeded" and no crasher when the deadline
# fires while a worker is mid-call on a loaded machine (CI failed so at stop 32). A count has no
# deadline to race; each minimisation is capped so a loaded run stays short.
FUZZ_CI_TIME ?= 10000x
FUZZ_CI_MINIMIZE ?= 5s
# FUZZ_PARALLEL=1 keeps a shared machine usable (default: one worker per CPU).
FUZZ_PARALLEL ?=
fuzz_run = for t in $(FUZZ_TARGETS); do pkg=$${t%%:*}; name=$${t\#\#*:}; \
	echo "== $$name ($$pkg), $(1)"; \
	$(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(1) $(2) $(if $(FUZZ_PARALLEL),-parallel $(FUZZ_PARALLEL)) $$pkg || exit 1; done

# fuzz runs every fuzz target for FUZZTIME (default 10m each), one after another. A crash stops
# it and leaves the input in the package's testdata/fuzz/<FuzzName>/: fix it and keep the file.
# Each new input is shrunk for at most FUZZ_MINIMIZE (Go's default, 60 s, showed as minutes at
# 0 executions/s on a loaded machine).
FUZZ_MINIMIZE ?= 10s
fuzz:
	@$(call fuzz_run,$(FUZZTIME),-fuzzminimizetime $(FUZZ_MINIMIZE))

# fuzz-ci is make test's short budget: FUZZ_CI_TIME (10000 executions) per target, about 80 s
# for all eleven on 2 cores.
fuzz-ci:
	@$(call fuzz_run,$(FUZZ_CI_TIME),-fuzzminimizetime $(FUZZ_CI_MINIMIZE))

# unit runs the tests without building the control plane (end-to-end tests skip).
unit:
	$(GO) test -race -count=1 ./...

# e2e-epoll runs the e2e suite once more with the daemon on the epoll engine (--io-engine=epoll);
# make test runs it on the default engine (io_uring where the kernel allows it).
e2e-epoll: test-deps build controlplane
	KPP_E2E_IO_ENGINE=epoll KPP_BINARY=$(abspath $(BIN)) KPP_E2E_REQUIRE=$(if $(filter 0,$(shell id -u)),1,) $(GO) test -race -count=1 -timeout 20m ./e2e/

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt: $$out"; exit 1; fi
	$(GO) vet ./...
	@if command -v staticcheck >/dev/null; then staticcheck ./...; else echo "staticcheck not installed; skipped"; fi

# soak runs the chaos soak (e2e/soak_test.go) for SOAK_DURATION per portal mode, both modes at
# once: clients through several Services while the proxy is killed, handed over, its endpoints
# churned, the nat table flushed and its descriptors taken away, with a recorded seed (SOAK_SEED
# repeats a run). Root; the test suite runs a short version.
SOAK_DURATION ?= 30m
soak: soak-preflight
	@$(MAKE) --no-print-directory build controlplane VERSION=$(VERSION)
	KPP_BINARY=$(abspath $(BIN)) KPP_E2E_REQUIRE=1 KPP_SOAK_DURATION=$(SOAK_DURATION) $(if $(SOAK_SEED),KPP_SOAK_SEED=$(SOAK_SEED)) \
		$(GO) test -count=1 -run TestChaosSoak -v -timeout 3h ./e2e/

# bench runs the side-by-side suite (needs root, haproxy, nginx, libnginx-mod-stream): direct,
# kube-portal-proxy in iptables and bind mode, HAProxy and nginx stream in one run; see
# bench/RESULTS.md. Not part of CI.
bench: bench-preflight
	@$(MAKE) --no-print-directory build VERSION=$(VERSION)
	$(GO) run ./bench/suite -proxy $(BIN) -json bench.json

bench-quick: bench-preflight
	@$(MAKE) --no-print-directory build VERSION=$(VERSION)
	$(GO) run ./bench/suite -quick -proxy $(BIN) -json bench.json

bench-micro:
	$(GO) test -run '^$$' -bench . -benchmem ./...

bench-portal:
	KPP_BENCH=1 $(GO) test -run TestBenchmarkPortalSync -v -timeout 30m ./portal/iptables/

# Preflight of the targets a user runs by hand that need root and system packages (cluster,
# conformance, cluster-test, image-oci, bench, soak): before anything is built, the group's
# missing packages are installed as root with apt-get (hack/install-deps.sh, the groups CI uses)
# or, without root or apt-get, named with the command to run; then a user who is not root is
# stopped at once. A first error in seconds, not after a 20-minute build
# (make_test.go checks it). The targets that need a running cluster (cluster-smoke,
# cluster-swap, cluster-rollout) say "no cluster (make cluster first)" at once; conformance and
# conformance-ci start the cluster themselves when it is not up.
preflight = hack/install-deps.sh $(1) && \
	if [ "$$(id -u)" != 0 ]; then echo "make $(or $(MAKECMDGOALS),$@) needs root ($(2)): run it as root, or with sudo" >&2; exit 2; fi
image-preflight:
	@$(call preflight,image,mmdebstrap builds the image's root filesystem)
cluster-preflight:
	@$(call preflight,cluster,network namespaces and containerd and kubelet)
bench-preflight:
	@$(call preflight,bench,the benchmark's network namespaces)
soak-preflight:
	@$(call preflight,test,the soak's network namespaces and iptables)

DOCKER ?= docker
IMAGE ?= ghcr.io/kube-portal-proxy/kube-portal-proxy:$(VERSION)
# image needs a container engine (docker, or DOCKER=podman); machines without one cannot build it.
image:
	$(DOCKER) build --build-arg VERSION=$(VERSION) -t $(IMAGE) .

# image-oci writes the same image as an OCI image layout tarball without a container engine
# (root; needs mmdebstrap for the Debian layer, cached in ~/.cache/kube-portal-proxy/images):
#   ctr -n k8s.io images import bin/kube-portal-proxy.oci.tar   (or docker load -i ...)
IMAGE_OCI := bin/kube-portal-proxy.oci.tar
image-oci: image-preflight
	@$(MAKE) --no-print-directory build VERSION=$(VERSION)
	hack/oci/image.sh $(BIN) $(IMAGE) $(IMAGE_OCI)

# image-oci-test checks the tarball against the Dockerfile (packages, alternatives, binary,
# symlink, entrypoint).
image-oci-test: image-oci
	KPP_IMAGE_OCI=$(abspath $(IMAGE_OCI)) $(GO) test -count=1 -run 'TestImageOCI|TestDockerfile' .

# cluster starts a real single-node cluster (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, containerd, kubelet) in a network namespace of its own, with kube-portal-proxy
# installed from deploy/ as its DaemonSet (root; see docs/cluster.md). cluster-build builds
# the node components once (~8 min cold); cluster-smoke checks a Service from a pod and from the
# node; cluster-down removes everything. Not part of make test. NODES=3: three nodes, each a
# network namespace with its own kubelet and containerd (docs/cluster.md).
NODES ?= 1
cluster-build: cluster-preflight
	hack/controlplane-build.sh >/dev/null
	hack/cluster/build.sh >/dev/null

cluster: cluster-preflight cluster-build image-oci
	IMAGE=$(IMAGE) IMAGE_OCI=$(abspath $(IMAGE_OCI)) NODES=$(NODES) hack/cluster/up.sh

cluster-smoke:
	hack/cluster/smoke.sh

cluster-down:
	hack/cluster/down.sh

# cluster-test: make cluster, cluster-smoke, cluster-down, and the host compared before and after.
cluster-test: cluster-preflight
	NODES=$(NODES) hack/cluster/test.sh

# conformance runs the upstream sig-network e2e specs that can run on one node (Services, the
# Services granular checks, EndpointSlice, KubeProxy, Conntrack; kube-proxy's kind-job skips) with
# e2e.test v1.36 against make cluster's cluster, starting it when it is not up (root;
# docs/cluster.md, "Conformance"). NODES=3 starts a three-node cluster and also runs the [Disruptive] specs. JUnit,
# log and summary.md in bin/conformance. conformance-ci runs the subset CI
# runs (hack/conformance/ci-focus.txt; on a cluster of several nodes, conformance-ci NODES=3,
# ci-focus-nodes.txt: one spec of each multi-node kind). conformance-build builds e2e.test,
# agnhost and the other test binaries once.
CONFORMANCE_OUT := bin/conformance
# Parallel ginkgo processes (the specs mostly wait on the API server and pods).
CONFORMANCE_PROCS ?= 4
conformance-build: cluster-preflight
	hack/controlplane-build.sh >/dev/null
	hack/conformance/build.sh >/dev/null

conformance: cluster-preflight cluster-build conformance-build image-oci
	IMAGE=$(IMAGE) IMAGE_OCI=$(abspath $(IMAGE_OCI)) NODES=$(NODES) CONFORMANCE_PROCS=$(CONFORMANCE_PROCS) hack/conformance/run.sh $(abspath $(CONFORMANCE_OUT))

conformance-ci: cluster-preflight cluster-build conformance-build image-oci
	IMAGE=$(IMAGE) IMAGE_OCI=$(abspath $(IMAGE_OCI)) NODES=$(NODES) CONFORMANCE_FOCUS=ci CONFORMANCE_PROCS=2 hack/conformance/run.sh $(abspath $(CONFORMANCE_OUT))

# cluster-swap: on a running make cluster, kube-proxy's own DaemonSet and ConfigMap as kubeadm
# writes them, with this image swapped in, take over from the kube-portal-proxy DaemonSet; a
# Service is checked before, during and after (docs/install.md).
cluster-swap:
	hack/cluster/swap.sh

# cluster-rollout: on a running make cluster, kubectl rollout restart of the kube-portal-proxy
# DaemonSet while a client pod connects every 20 ms through a cluster IP and a node port: the new
# pod takes the old one's sockets over (docs/restarts.md), zero failures allowed
# (~20 s).
cluster-rollout:
	hack/cluster/rollout.sh

clean:
	rm -rf bin
