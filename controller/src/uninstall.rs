//! `tessera-controller uninstall`: what `helm uninstall` runs first (the chart's pre-delete hook), so that
//! removing tessera leaves no device that nothing serves.
//!
//! Without it the controller's ResourceSlices outlive the chart — kubelet only deletes the slices a node's
//! plugin published itself, and tessera's are the controller's — so the scheduler keeps allocating devices no
//! driver can prepare. And a reinstall waits out the leader Lease of a deleted pod, because helm deletes the
//! controller's Role before the controller stops and the release is then forbidden.
//!
//! The order matters: the controller is scaled to zero first and its pods waited for, so none republishes
//! what is deleted next; then every slice of the driver, then the leader Lease. A rolling update never runs
//! this (the hook is for deletion only), so it needs no way of telling the two apart. Each step tolerates
//! what an earlier, interrupted run already did.

use std::time::Duration;

use k8s_openapi::api::{
    apps::v1::Deployment, coordination::v1::Lease, core::v1::Pod, resource::v1::ResourceSlice,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams},
};
use tessera_api::DRIVER_NAME;

/// What an uninstall run removes, and where.
#[derive(Clone, Debug)]
pub struct Uninstall {
    /// The release namespace (the controller's Deployment and its leader Lease).
    pub namespace: String,
    pub deployment: String,
    /// Label selector of the controller's pods.
    pub selector: String,
    pub lease_name: String,
    /// How long to wait for the controller's pods to be gone.
    pub wait: Duration,
}

/// What a run did, for its log (the hook pod's output is what `helm uninstall --debug` shows).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub scaled_down: bool,
    pub slices_deleted: usize,
    pub lease_deleted: bool,
}

/// Why an uninstall step failed.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error("failed to scale Deployment {namespace}/{name} to 0: {source}")]
    ScaleDown {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error(
        "the controller's pods ({selector}) still run after {waited:?}; delete them, then run uninstall again"
    )]
    PodsStillRunning { selector: String, waited: Duration },
    #[error("failed to list the controller's pods: {0}")]
    ListPods(kube::Error),
    #[error("failed to delete the ResourceSlices of {DRIVER_NAME}: {0}")]
    DeleteSlices(kube::Error),
    #[error("failed to delete Lease {namespace}/{name}: {source}")]
    DeleteLease {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_not_found())
}

impl Uninstall {
    /// Scales the controller to zero, waits for its pods, deletes the driver's slices and the leader Lease.
    pub async fn run(&self, client: Client) -> Result<Report, UninstallError> {
        let mut report = Report::default();
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &self.namespace);
        let scale = Patch::Merge(serde_json::json!({"spec": {"replicas": 0}}));
        match deployments
            .patch(&self.deployment, &PatchParams::default(), &scale)
            .await
        {
            Ok(_) => report.scaled_down = true,
            Err(e) if not_found(&e) => {}
            Err(source) => {
                return Err(UninstallError::ScaleDown {
                    namespace: self.namespace.clone(),
                    name: self.deployment.clone(),
                    source,
                });
            }
        }

        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        let started = tokio::time::Instant::now();
        loop {
            let left = pods
                .list(&ListParams::default().labels(&self.selector))
                .await
                .map_err(UninstallError::ListPods)?;
            if left.items.is_empty() {
                break;
            }
            if started.elapsed() >= self.wait {
                return Err(UninstallError::PodsStillRunning {
                    selector: self.selector.clone(),
                    waited: self.wait,
                });
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }

        let slices: Api<ResourceSlice> = Api::all(client.clone());
        let ours = ListParams::default().fields(&format!("spec.driver={DRIVER_NAME}"));
        let listed = slices
            .list_metadata(&ours)
            .await
            .map_err(UninstallError::DeleteSlices)?;
        for s in &listed.items {
            let Some(name) = s.metadata.name.as_deref() else {
                continue;
            };
            match slices.delete(name, &DeleteParams::default()).await {
                Ok(_) => report.slices_deleted += 1,
                Err(e) if not_found(&e) => {}
                Err(e) => return Err(UninstallError::DeleteSlices(e)),
            }
        }

        let leases: Api<Lease> = Api::namespaced(client, &self.namespace);
        match leases.delete(&self.lease_name, &DeleteParams::default()).await {
            Ok(_) => report.lease_deleted = true,
            Err(e) if not_found(&e) => {}
            Err(source) => {
                return Err(UninstallError::DeleteLease {
                    namespace: self.namespace.clone(),
                    name: self.lease_name.clone(),
                    source,
                });
            }
        }
        Ok(report)
    }
}
