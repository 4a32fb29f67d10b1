//! `kubectl-tessera top` as a user runs it, over the controller's golden slices (`--from-file`).

use std::process::Command;

fn top(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .arg("top")
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .expect("kubectl-tessera runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn golden(name: &str) -> String {
    format!("{}/tests/golden/{name}.json", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn a_static_mig_layout_of_a_file_is_drawn_within_80_columns_and_says_use_is_not_shown() {
    let (code, out, err) = top(&["--from-file", &golden("mixed-static-mig-fallback")]);
    assert_eq!(code, 0, "{err}");
    for line in out.lines() {
        assert!(line.chars().count() <= 80, "over 80 columns: {line:?}");
    }
    assert!(out.starts_with("== node mixed-node  (8 GPUs)\n"), "{out}");
    // A100 80GB: 3g.40gb spans 4 of the 8 memory slices.
    assert!(out.contains("    D 3g.40gb    slices 4-7  free\n"), "{out}");
    assert!(out.ends_with("use: not shown, read from a file\n"), "{out}");
}

#[test]
fn a_node_that_publishes_no_gpus_is_an_error_that_says_how_to_look() {
    let (code, out, err) = top(&["--from-file", &golden("h100-dynamic-mig"), "--node", "nope"]);
    assert_eq!((code, out.as_str()), (2, ""));
    assert!(
        err.contains("node \"nope\" publishes no tessera GPUs; `kubectl get resourceslices --field-selector spec.nodeName=nope`"),
        "{err}"
    );
}
