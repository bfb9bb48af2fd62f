// A module of its own, so that the repository's module (and go test ./...) never needs
// k8s.io/kubernetes: hack/conformance/build.sh copies this folder into the cache, adds the
// require and the staging replace lines there, and builds e2e.test from the copy.
module kpp.invalid/conformance/e2e

go 1.26
