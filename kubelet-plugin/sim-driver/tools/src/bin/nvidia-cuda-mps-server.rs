//! tessera's simulated `nvidia-cuda-mps-server`: started by the control daemon for its first client,
//! it logs its devices and limits to `server.log` and runs until the daemon stops it. See
//! [`tessera_kubelet_plugin::devices::sharing::mps::run_server`].

fn main() {
    if let Err(e) = tessera_kubelet_plugin::devices::sharing::mps::run_server() {
        eprintln!("nvidia-cuda-mps-server: {e}");
        std::process::exit(1);
    }
}
