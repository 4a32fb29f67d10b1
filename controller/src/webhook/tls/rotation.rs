//! When the webhook's own serving certificate is issued, staged, promoted and its old CA dropped: plain
//! state, no I/O, so every step is decided by [`plan`] from certificate lifetimes and the time.
//!
//! Each serving certificate has a CA of its own. A rotation makes a new pair (CA + serving certificate),
//! **stages** it (the webhook configuration's `caBundle` trusts both CAs, the old certificate is still
//! served), **promotes** it once the API server has trusted the new CA for [`Policy::stage`] (every
//! replica then serves the new certificate) and keeps the old CA in the bundle until it expires, so a
//! replica or an API server that has not caught up yet still verifies. No CA key is kept after its one
//! serving certificate is signed.

use std::time::{Duration, SystemTime};

/// How long certificates live and when they are replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Lifetime of each CA and its serving certificate.
    pub validity: Duration,
    /// A rotation starts when the served certificate has this little left.
    pub renew_before: Duration,
    /// How long the new CA is in the webhook configuration before its certificate is served: the API
    /// servers' informers must have loaded it (well under a second on one API server).
    pub stage: Duration,
}

/// How much longer than the policy's validity a served certificate may live before it counts as issued
/// under another policy: room for clocks that differ between replicas.
pub const OUTLIVES_SLACK: Duration = Duration::from_secs(60);

/// The longest staging: enough for several API servers to load a changed webhook configuration.
pub const MAX_STAGE: Duration = Duration::from_secs(10);

impl Policy {
    /// Renew with a third of the lifetime left (cert-manager's default), stage for [`MAX_STAGE`] or a
    /// sixth of the lifetime when that is shorter, so a short-lived test certificate still rotates
    /// before it expires.
    pub fn for_validity(validity: Duration) -> Self {
        let renew_before = validity / 3;
        Self {
            validity,
            renew_before,
            stage: MAX_STAGE.min(renew_before / 2),
        }
    }
}

/// What the Secret holds, reduced to what [`plan`] needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Times {
    /// Expiry of the served pair (CA and certificate expire together); `None` when there is none or it
    /// does not parse.
    pub current: Option<SystemTime>,
    /// The served certificate names every DNS name the API server may dial.
    pub current_names_ok: bool,
    /// Expiry of the staged pair.
    pub next: Option<SystemTime>,
    /// Since when this process has seen the staged CA in the webhook configuration.
    pub next_trusted_since: Option<SystemTime>,
    /// Expiry of the CA of the previously served certificate, kept in the bundle.
    pub previous: Option<SystemTime>,
}

/// The one change to make now, or how long nothing needs doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing usable is served: make a pair and serve it at once (there is nothing to overlap with).
    Issue,
    /// Make a new pair and add its CA to the bundle; keep serving the current certificate.
    Stage,
    /// Serve the staged pair; its predecessor's CA stays in the bundle until it expires.
    Promote,
    /// The previous CA has expired: drop it from the bundle.
    DropPrevious,
    /// Nothing to do for this long (or until the Secret or the webhook configuration changes).
    Wait(Duration),
}

fn live(expiry: Option<SystemTime>, now: SystemTime) -> bool {
    expiry.is_some_and(|t| t > now)
}

/// The next step for `t` at `now`.
pub fn plan(t: &Times, now: SystemTime, policy: &Policy) -> Step {
    let current_live = live(t.current, now);
    if live(t.next, now) {
        if !current_live {
            return Step::Promote;
        }
        return match t.next_trusted_since {
            Some(since) => match (since + policy.stage).duration_since(now) {
                Ok(left) if !left.is_zero() => Step::Wait(left),
                _ => Step::Promote,
            },
            // Waiting for the bundle to be written (a change of the configuration wakes the caller).
            None => Step::Wait(policy.stage),
        };
    }
    let Some(expiry) = t.current.filter(|_| current_live) else {
        return Step::Issue;
    };
    if !t.current_names_ok {
        return Step::Stage;
    }
    // A certificate that outlives this policy (`webhook.certValidity` shortened by an upgrade, or issued
    // by a replica of the release before, still terminating when this one's empty Secret appeared) is
    // rotated now, with overlap, rather than served for the rest of its old lifetime.
    if expiry > now + policy.validity + OUTLIVES_SLACK {
        return Step::Stage;
    }
    let renew_at = expiry.checked_sub(policy.renew_before).unwrap_or(now);
    if now >= renew_at {
        return Step::Stage;
    }
    if t.previous.is_some() && !live(t.previous, now) {
        return Step::DropPrevious;
    }
    let mut wait = renew_at.duration_since(now).unwrap_or_default();
    if let Some(previous) = t.previous
        && let Ok(left) = previous.duration_since(now)
    {
        wait = wait.min(left);
    }
    Step::Wait(wait)
}

/// Which CAs the webhook configuration's `caBundle` holds at `now`: every one whose certificate may be
/// served (the current and the staged pair's) or may still be in a replica's hands (the previous), as
/// long as it has not expired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bundle {
    pub current: bool,
    pub next: bool,
    pub previous: bool,
}

pub fn bundle(t: &Times, now: SystemTime) -> Bundle {
    Bundle {
        current: live(t.current, now),
        next: live(t.next, now),
        previous: live(t.previous, now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn at(hours: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + HOUR * hours as u32
    }

    fn year() -> Policy {
        Policy::for_validity(HOUR * 8760)
    }

    fn served(expiry: SystemTime) -> Times {
        Times {
            current: Some(expiry),
            current_names_ok: true,
            ..Times::default()
        }
    }

    #[test]
    fn a_fresh_install_issues_a_certificate_and_serves_it_at_once() {
        assert_eq!(plan(&Times::default(), at(0), &year()), Step::Issue);
    }

    #[test]
    fn an_expired_certificate_without_a_staged_one_is_replaced_at_once() {
        assert_eq!(plan(&served(at(10)), at(10), &year()), Step::Issue);
    }

    #[test]
    fn a_certificate_with_two_thirds_of_its_life_left_is_kept_until_a_third_is_left() {
        let p = year();
        let t = served(at(8760));
        assert_eq!(plan(&t, at(0), &p), Step::Wait(HOUR * 5840));
        assert_eq!(plan(&t, at(5839), &p), Step::Wait(HOUR));
        assert_eq!(plan(&t, at(5840), &p), Step::Stage);
    }

    #[test]
    fn a_certificate_issued_under_a_longer_validity_is_rotated_at_once_with_overlap() {
        let minute = Policy::for_validity(Duration::from_secs(60));
        let start = at(0);
        let t = served(start + HOUR * 8760);
        assert_eq!(plan(&t, start, &minute), Step::Stage);
        let own = served(start + Duration::from_secs(60) + OUTLIVES_SLACK);
        assert_eq!(
            plan(&own, start, &minute),
            Step::Wait(Duration::from_secs(100)),
            "one of its own validity, from a clock a little ahead, is kept"
        );
    }

    #[test]
    fn a_certificate_missing_a_service_name_is_rotated_with_overlap_not_replaced() {
        let t = Times {
            current_names_ok: false,
            ..served(at(8760))
        };
        assert_eq!(plan(&t, at(1), &year()), Step::Stage);
    }

    #[test]
    fn a_staged_certificate_is_served_only_after_its_ca_has_been_trusted_for_the_stage_time() {
        let p = Policy::for_validity(Duration::from_secs(3600));
        let start = at(0);
        let mut t = Times {
            next: Some(start + Duration::from_secs(3600)),
            ..served(start + Duration::from_secs(1000))
        };
        // Not yet in the webhook configuration: keep serving the old certificate.
        assert_eq!(plan(&t, start, &p), Step::Wait(p.stage));
        t.next_trusted_since = Some(start);
        assert_eq!(
            plan(&t, start + Duration::from_secs(3), &p),
            Step::Wait(Duration::from_secs(7))
        );
        assert_eq!(plan(&t, start + p.stage, &p), Step::Promote);
    }

    #[test]
    fn a_staged_certificate_is_served_at_once_when_the_current_one_has_expired() {
        let t = Times {
            next: Some(at(9000)),
            ..served(at(10))
        };
        assert_eq!(plan(&t, at(11), &year()), Step::Promote);
    }

    #[test]
    fn the_bundle_trusts_the_old_and_the_new_ca_while_the_new_certificate_rolls_out() {
        let staged = Times {
            next: Some(at(9000)),
            previous: None,
            ..served(at(8760))
        };
        assert_eq!(
            bundle(&staged, at(5841)),
            Bundle {
                current: true,
                next: true,
                previous: false
            }
        );
        // After the promotion the old pair's CA is the previous one: kept until it expires.
        let promoted = Times {
            current: Some(at(5842 + 8760)),
            current_names_ok: true,
            previous: Some(at(8760)),
            ..Times::default()
        };
        assert_eq!(
            bundle(&promoted, at(5842)),
            Bundle {
                current: true,
                next: false,
                previous: true
            }
        );
        // The next wake-up is the old CA's expiry, before the new certificate's renewal.
        assert_eq!(
            plan(&promoted, at(5842), &year()),
            Step::Wait(HOUR * (8760 - 5842))
        );
        assert!(!bundle(&promoted, at(8760)).previous);
        assert_eq!(plan(&promoted, at(8760), &year()), Step::DropPrevious);
    }

    #[test]
    fn a_short_validity_stages_for_a_sixth_of_it_and_renews_with_a_third_left() {
        let p = Policy::for_validity(Duration::from_secs(60));
        assert_eq!(p.renew_before, Duration::from_secs(20));
        assert_eq!(p.stage, Duration::from_secs(10));
        let p = Policy::for_validity(Duration::from_secs(30));
        assert_eq!(p.stage, Duration::from_secs(5));
        assert_eq!(year().stage, MAX_STAGE);
    }
}
