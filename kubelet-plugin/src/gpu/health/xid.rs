//! Which NVML events make a GPU unhealthy.
//!
//! The event mask and the list of XIDs that are not the GPU's fault follow NVIDIA's own components:
//! NVIDIA/k8s-device-plugin `internal/rm/health.go` and NVIDIA's DRA driver
//! (kubernetes-sigs/dra-driver-nvidia-gpu) `cmd/gpu-kubelet-plugin/device_health.go` both register
//! `nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeSingleBitEccError` and skip
//! the same "application" XIDs (13, 31, 43, 45, 68, 109), which a faulty CUDA program raises on a healthy
//! GPU. tessera registers the same mask; a single-bit ECC error is corrected by the hardware and is only
//! logged.

use tessera_api::inventory::HealthReason;

/// `nvmlEventTypeSingleBitEccError` (`nvml.h`).
pub const EVENT_SINGLE_BIT_ECC: u64 = 0x1;
/// `nvmlEventTypeDoubleBitEccError`.
pub const EVENT_DOUBLE_BIT_ECC: u64 = 0x2;
/// `nvmlEventTypeXidCriticalError`.
pub const EVENT_XID_CRITICAL: u64 = 0x8;
/// `nvmlEventMigConfigChange`: registered besides [`EVENT_MASK`] only as the cue to register the event set
/// again (a MIG change may reset the GPU and drop its registration); it says nothing about health.
pub const EVENT_MIG_CONFIG_CHANGE: u64 = 0x100;
/// The events tessera registers per GPU: NVIDIA's set (see the module docs).
pub const EVENT_MASK: u64 = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC | EVENT_SINGLE_BIT_ECC;

/// XIDs a misbehaving application causes on a healthy GPU: Graphics Engine Exception (13), GPU memory page
/// fault (31), GPU stopped processing (43), preemptive cleanup (45), video processor exception (68) and
/// context switch timeout (109). The list of NVIDIA's device plugin and DRA driver (module docs).
pub const APPLICATION_XIDS: [u32; 6] = [13, 31, 43, 45, 68, 109];

/// `eventData` of an XID event whose number NVML does not know.
pub const UNKNOWN_XID: u32 = 999;

/// What one NVML event means for the device it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The device is unhealthy for this reason.
    Unhealthy(HealthReason),
    /// Logged only: an application XID or a corrected single-bit ECC error.
    Ignore,
}

/// Classifies an event of type `event_type` carrying `data` (the XID for XID events). `extra_ignored` are
/// XIDs an administrator declared harmless on top of [`APPLICATION_XIDS`].
pub fn classify(event_type: u64, data: u64, extra_ignored: &[u32]) -> Verdict {
    if event_type & EVENT_DOUBLE_BIT_ECC != 0 {
        return Verdict::Unhealthy(HealthReason::DoubleBitEcc);
    }
    if event_type & EVENT_XID_CRITICAL != 0 {
        let xid = u32::try_from(data).unwrap_or(UNKNOWN_XID);
        return classify_xid(xid, extra_ignored);
    }
    Verdict::Ignore
}

/// Classifies one XID; an unknown one (999) counts as critical, as NVIDIA's components treat it.
pub fn classify_xid(xid: u32, extra_ignored: &[u32]) -> Verdict {
    if APPLICATION_XIDS.contains(&xid) || extra_ignored.contains(&xid) {
        Verdict::Ignore
    } else {
        Verdict::Unhealthy(HealthReason::Xid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_xids_are_ignored_and_the_others_are_critical() {
        for xid in APPLICATION_XIDS {
            assert_eq!(classify_xid(xid, &[]), Verdict::Ignore, "XID {xid}");
        }
        for xid in [48, 63, 64, 74, 79, 92, 94, 95, 119, UNKNOWN_XID] {
            assert_eq!(
                classify_xid(xid, &[]),
                Verdict::Unhealthy(HealthReason::Xid),
                "XID {xid}"
            );
        }
        assert_eq!(classify_xid(94, &[94]), Verdict::Ignore);
    }

    #[test]
    fn double_bit_ecc_is_unhealthy_and_single_bit_ecc_is_only_logged() {
        assert_eq!(
            classify(EVENT_DOUBLE_BIT_ECC, 0, &[]),
            Verdict::Unhealthy(HealthReason::DoubleBitEcc)
        );
        assert_eq!(classify(EVENT_SINGLE_BIT_ECC, 0, &[]), Verdict::Ignore);
        assert_eq!(classify(EVENT_XID_CRITICAL, 31, &[]), Verdict::Ignore);
        assert_eq!(
            classify(EVENT_XID_CRITICAL, 79, &[]),
            Verdict::Unhealthy(HealthReason::Xid)
        );
        assert_eq!(
            classify(EVENT_XID_CRITICAL, u64::MAX, &[]),
            Verdict::Unhealthy(HealthReason::Xid)
        );
    }
}
