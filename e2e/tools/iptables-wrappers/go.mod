// tessera's stand-in for sigs.k8s.io/iptables-wrappers, which Kubernetes 1.38's kubelet imports and which the Go
// module proxy does not serve (403 for every version, checked 2026-12-05). Only e2e/k8s/go.138.mod replaces
// the module with this directory; see pkg/iptables/iptables.go.
module sigs.k8s.io/iptables-wrappers

go 1.26.0
