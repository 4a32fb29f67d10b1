# Sourced by the benchmarks that need a control plane of their own (bench-controller.sh, bench-prepare.sh,
# bench-scheduler.sh): etcd, kube-apiserver, kube-scheduler and kube-controller-manager from e2e/bin on the
# benchmark's own run dir and ports, so it runs beside `make up` and the other benchmarks; CRDs and
# DeviceClasses applied, no nodes, no tessera processes, no GpuPolicy. Each port can be overridden:
# BENCH_RUN_DIR, BENCH_ETCD_PORT, BENCH_ETCD_PEER_PORT, BENCH_API_PORT, BENCH_SCHEDULER_PORT,
# BENCH_CONTROLLER_MANAGER_PORT. Then `source common.sh` and `fresh_cluster` (KEEP_CLUSTER=1 leaves it running).

# bench_cluster_env RUN_DIR ETCD_PORT ETCD_PEER_PORT API_PORT SCHEDULER_PORT CONTROLLER_MANAGER_PORT: the
# defaults of one benchmark, exported for up.sh and down.sh.
bench_cluster_env() {
  export RUN_DIR="${BENCH_RUN_DIR:-$1}"
  export ETCD_PORT="${BENCH_ETCD_PORT:-$2}" ETCD_PEER_PORT="${BENCH_ETCD_PEER_PORT:-$3}"
  export API_PORT="${BENCH_API_PORT:-$4}" SCHEDULER_PORT="${BENCH_SCHEDULER_PORT:-$5}"
  export CONTROLLER_MANAGER_PORT="${BENCH_CONTROLLER_MANAGER_PORT:-$6}"
  export NODES=0 SKIP_DRIVER=1 SKIP_EXAMPLES=1 POLICY=none
}
