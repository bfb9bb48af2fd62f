# syntax=docker/dockerfile:1
#
# kube-portal-proxy container image: the static binary on Debian slim with the only tools it
# execs, iptables and ip6tables (both nft and legacy backends), and nft (the transparent source
# mode's bridge table). Links, addresses and conntrack
# entries go over netlink, so unlike kube-proxy's image it ships neither conntrack nor iproute2.
#
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) \
#     -t ghcr.io/kube-portal-proxy/kube-portal-proxy:dev .
#
# The build needs a container engine (Docker, Podman, BuildKit); machines without one cannot
# build the image, but `make build` produces the same binary.

ARG GO_VERSION=1.26

FROM golang:${GO_VERSION} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
# The same flags as `make build`: static, reproducible paths, version stamped.
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-X main.version=${VERSION}" -o /out/kube-portal-proxy .

FROM debian:bookworm-slim
# iptables ships iptables-nft and iptables-legacy (and the ip6tables and -save/-restore
# variants); the alternatives choose nft, the backend of current distributions. On a node whose
# rules are in the legacy backend, run the proxy with --iptables-variant=legacy.
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables \
 && rm -rf /var/lib/apt/lists/* \
 && update-alternatives --set iptables /usr/sbin/iptables-nft \
 && update-alternatives --set ip6tables /usr/sbin/ip6tables-nft
COPY --from=build /out/kube-portal-proxy /usr/local/bin/kube-portal-proxy
# kube-proxy's DaemonSets run /usr/local/bin/kube-proxy: swapping the image in is enough.
RUN ln -s kube-portal-proxy /usr/local/bin/kube-proxy
ENTRYPOINT ["/usr/local/bin/kube-portal-proxy"]
