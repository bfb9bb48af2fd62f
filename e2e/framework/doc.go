// Package framework gives end-to-end tests a real Kubernetes control plane: etcd and kube-apiserver,
// built once by hack/controlplane-build.sh, started on loopback with free ports, with kubeconfigs for
// an admin and for the system:kube-proxy identity the proxy runs as, and stopped by PID afterwards.
package framework
