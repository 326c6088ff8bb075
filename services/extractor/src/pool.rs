//! A region's provider deployments: the pool. Each deployment is its own provider key —
//! its congestion window, pause, circuit and metered budgets, shared by the fleet as for
//! a single key — and serves one model class.
//!
//! A review goes to a deployment of its class. Every deployment runs lane loops on the
//! same lane consumers, so a deployment with room pulls the next review and one without
//! room does not: the reviews spread over the deployments that can take them, each
//! within its own budgets. A deployment steps aside (`steps_aside`) while its circuit is
//! open or a 429 pauses it and another of its class is in routing (`Others::alive`), or
//! while its budgets refuse a call they have no room for yet and another can take it
//! (`Others::can_take`), or while one ranked ahead of it (`Rank`: a preference, then the
//! price) can take a review and has room. Its loops then pull nothing and a review it holds goes back to
//! the lane (`hand_over_delay`) for whichever has room first: never held through its
//! pause, never ended for its account or key. While every deployment of a class is
//! paused, its reviews wait on the lane for the first pause to end; a class whose
//! circuits are all open behaves as one deployment does.

use std::sync::Arc;
use std::time::Duration;

use reviewlane_core::job::{Charge, ServedBy, Tokens};

use crate::config::Price;
use crate::provider::Provider;
use crate::quota::{Quota, Scope};

/// One deployment of the pool.
pub struct Deployment {
    /// Its name in metrics and quota scopes.
    pub id: String,
    /// The model class it serves.
    pub class: String,
    /// Its provider's kind (`Provider::name`) and the model it calls.
    pub kind: &'static str,
    pub model: String,
    /// The most output tokens its calls ask for: what a tokens-per-minute budget counts
    /// at a call's start.
    pub output_reserve: u32,
    pub provider: Arc<dyn Provider>,
    pub quota: Quota,
    /// What its tokens cost (none: cost 0).
    pub price: Option<Price>,
    /// Where it goes among its class's deployments.
    pub rank: Rank,
}

impl Deployment {
    /// What it is doing now (`metrics::DEPLOYMENT_STATES`).
    pub fn state(&self) -> &'static str {
        use crate::quota::CircuitCause;
        match self.quota.circuit_cause() {
            Some(CircuitCause::InsufficientQuota) => "out_of_quota",
            Some(CircuitCause::KeyRefused) => "key_refused",
            Some(CircuitCause::Failing) => "failing",
            None if self.quota.paused_for().is_some() => "paused",
            None if self.quota.refusing() => "refusing",
            None => "routing",
        }
    }

    /// What this replica sees of it now, for operators (`pool_status`).
    pub async fn status(&self) -> reviewlane_shared::pool_status::DeploymentStatus {
        use reviewlane_shared::pool_status::{BudgetRoom, DeploymentStatus};
        let mut budgets = Vec::new();
        for (dim, limit) in self.quota.budgets().limits() {
            // A bucket that cannot be read now is left out of this look.
            if let Ok(level) = self.quota.budgets().bucket_level(dim, limit).await {
                budgets.push(BudgetRoom { dimension: dim.short().to_string(), limit, room: level.max(0.0) as u64 });
            }
        }
        DeploymentStatus {
            deployment: self.id.clone(),
            kind: self.kind.to_string(),
            model: self.model.clone(),
            model_class: self.class.clone(),
            state: self.state().to_string(),
            in_flight: self.quota.fleet_in_flight(),
            window: self.quota.fleet_window(),
            budgets,
            paused_for_ms: self.quota.paused_for().map(|d| d.as_millis() as u64),
            observed_at_ms: self.quota.now_ms(),
        }
    }

    /// A paid call of this deployment as charged to its job: `tokens` at its price.
    pub fn charge(&self, tokens: Tokens) -> Charge {
        Charge {
            tokens,
            cost_micro_usd: self.price.map_or(0, |p| p.cost_micro_usd(tokens)),
            served_by: ServedBy { deployment: self.id.clone(), model_class: self.class.clone() },
        }
    }

    /// The scope a tenant's reviews take on this deployment.
    pub fn scope(&self, tenant: &str) -> Scope {
        Scope { provider: self.id.clone(), model_class: self.class.clone(), tenant: tenant.to_string() }
    }
}

/// Which of a class's deployments goes first: the lower `preference`, then the cheaper
/// (input and output price per million tokens together; none: free). Deployments of
/// the same rank compete for reviews; one ranked behind takes what those ahead cannot.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rank {
    pub preference: u32,
    pub price: f64,
}

impl Rank {
    pub fn of(preference: u32, price: Option<Price>) -> Rank {
        Rank { preference, price: price.map_or(0.0, |p| p.input_per_mtok + p.output_per_mtok) }
    }

    /// Whether a deployment of this rank goes before one of `other`'s.
    fn ahead_of(self, other: Rank) -> bool {
        self.cmp_order(other) == std::cmp::Ordering::Less
    }

    /// The order of two deployments' turns: `Less` when this one goes first.
    pub fn cmp_order(self, other: Rank) -> std::cmp::Ordering {
        (self.preference, self.price).partial_cmp(&(other.preference, other.price)).unwrap_or(std::cmp::Ordering::Equal)
    }
}

/// Where one call goes when it is not the deployment that admitted its review: another
/// deployment of the class, with the tenant's scope on it and the class's others as it
/// sees them. A split review's part runs there when the admitting one has no room.
#[derive(Clone)]
pub struct Callee {
    pub deployment: Arc<Deployment>,
    pub others: Others,
    pub scope: Scope,
}

/// The other deployments of a class, with their ranks, and this one's rank.
#[derive(Clone, Default)]
pub struct Others {
    own: Rank,
    others: Arc<Vec<(Quota, Rank)>>,
}

impl Others {
    pub fn new(own: Rank, others: Vec<(Quota, Rank)>) -> Others {
        Others { own, others: Arc::new(others) }
    }

    /// Whether another deployment of the class can take a review now (`Look::open`).
    /// Which replica takes it is the fleet's share of that deployment's window: this one
    /// may have none of it for the moment, another does.
    pub fn can_take(&self) -> bool {
        self.looks().any(|(o, _)| o.open())
    }

    /// Whether another deployment of the class is in routing at all: its circuit closed,
    /// though it may be paused or at its budgets for a moment. A review this deployment
    /// cannot serve waits for it rather than end.
    pub fn alive(&self) -> bool {
        self.looks().any(|(o, _)| o.alive())
    }

    fn looks(&self) -> impl Iterator<Item = (Look, Rank)> + '_ {
        self.others.iter().map(|(q, r)| (Look::of(q), *r))
    }
}

/// What a deployment's key looks like now, as routing sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Look {
    /// Out of routing: `insufficient_quota`, a refused key, failing.
    pub circuit_open: bool,
    /// Waiting out a 429's pause.
    pub paused: bool,
    /// Its budgets refused a call they have no room for yet.
    pub refusing: bool,
    /// The fleet's calls in flight on it are below its window: it could start another.
    pub room: bool,
}

impl Look {
    fn of(q: &Quota) -> Look {
        Look {
            circuit_open: q.circuit_open(),
            paused: q.paused_for().is_some(),
            refusing: q.refusing(),
            room: q.fleet_in_flight() < q.fleet_window(),
        }
    }

    /// It can take a review now.
    fn open(self) -> bool {
        !self.circuit_open && !self.paused && !self.refusing
    }

    /// It is in routing, though it may be paused or at its budgets for a moment.
    fn alive(self) -> bool {
        !self.circuit_open
    }
}

/// How long a review goes back to its lane when its deployment steps aside: not at all
/// when another deployment of the class can take it now, a moment when the others are
/// paused or at their budgets (the review waits for them rather than end).
pub fn hand_over_delay(others: &Others) -> Option<Duration> {
    (!others.can_take()).then_some(HAND_OVER_WAIT)
}

/// See `hand_over_delay`.
const HAND_OVER_WAIT: Duration = Duration::from_millis(500);

/// Whether a deployment whose quota is `own` steps aside for `others` (`steps_aside_for`).
pub fn steps_aside(own: &Quota, others: &Others) -> bool {
    steps_aside_for((Look::of(own), others.own), others.looks())
}

/// Whether a deployment that looks like `own` (of its rank) steps aside for the others
/// of its class:
/// - it is out of routing (its circuit open) or paused, and another is in routing — the
///   others wait out its pause for it, the review does not;
/// - it cannot take a review now (its budgets refusing for a moment) and another can;
/// - another ranked ahead of it can take a review now and has room in its window: the
///   preferred (or cheaper) deployment is used up to what it allows, this one for the
///   rest.
///
/// A deployment alone in its class never steps aside.
pub fn steps_aside_for((own, rank): (Look, Rank), others: impl Iterator<Item = (Look, Rank)>) -> bool {
    let (mut alive, mut can_take, mut ahead) = (false, false, false);
    for (o, r) in others {
        alive |= o.alive();
        can_take |= o.open();
        ahead |= o.open() && o.room && r.ahead_of(rank);
    }
    ((own.circuit_open || own.paused) && alive) || (!own.open() && can_take) || ahead
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: Look = Look { circuit_open: false, paused: false, refusing: false, room: true };
    const PAUSED: Look = Look { paused: true, ..OPEN };
    const REFUSING: Look = Look { refusing: true, ..OPEN };
    const OUT: Look = Look { circuit_open: true, ..OPEN };
    const FULL: Look = Look { room: false, ..OPEN };

    fn aside(own: Look, others: &[Look]) -> bool {
        steps_aside_for((own, Rank::default()), others.iter().map(|o| (*o, Rank::default())))
    }

    fn ranked(own: Rank, others: &[(Look, Rank)]) -> bool {
        steps_aside_for((OPEN, own), others.iter().copied())
    }

    #[test]
    fn a_deployment_ranked_behind_takes_only_what_those_ahead_cannot() {
        let (cheap, dear) = (Rank { preference: 0, price: 0.75 }, Rank { preference: 0, price: 12.0 });
        let preferred = Rank { preference: 0, price: 30.0 };
        let fallback = Rank { preference: 1, price: 0.1 };
        // The cheaper one has room: the dearer waits; not the other way round.
        assert!(ranked(dear, &[(OPEN, cheap)]));
        assert!(!ranked(cheap, &[(OPEN, dear)]));
        // The cheaper one is full, paused, at its budgets or out: the dearer takes reviews.
        for other in [FULL, PAUSED, REFUSING, OUT] {
            assert!(!ranked(dear, &[(other, cheap)]), "{other:?}");
        }
        // A preference goes before any price; the same rank competes.
        assert!(ranked(fallback, &[(OPEN, preferred)]));
        assert!(!ranked(preferred, &[(OPEN, fallback)]));
        assert!(!ranked(cheap, &[(OPEN, cheap)]));
        // Without prices or preferences every deployment ranks the same.
        assert_eq!(Rank::of(0, None), Rank::default());
    }

    #[test]
    fn a_deployment_that_can_take_reviews_or_is_alone_never_steps_aside() {
        for others in [&[][..], &[OPEN], &[PAUSED], &[REFUSING], &[OUT]] {
            assert!(!aside(OPEN, others), "{others:?}");
        }
        for own in [PAUSED, REFUSING, OUT] {
            assert!(!aside(own, &[]), "{own:?} alone");
        }
    }

    #[test]
    fn a_paused_or_failed_deployment_steps_aside_for_any_other_in_routing() {
        // Even one that cannot take a review this moment: the review waits on the lane
        // for whichever has room first, not through this one's pause.
        for own in [PAUSED, OUT] {
            for other in [OPEN, PAUSED, REFUSING] {
                assert!(aside(own, &[other]), "{own:?} for {other:?}");
            }
            assert!(!aside(own, &[OUT]), "{own:?}: the class is out, it is called as one");
        }
    }

    #[test]
    fn a_deployment_at_its_budgets_steps_aside_only_for_one_that_can_take_now() {
        assert!(aside(REFUSING, &[OPEN]));
        assert!(aside(REFUSING, &[OUT, OPEN]));
        for other in [PAUSED, REFUSING, OUT] {
            assert!(!aside(REFUSING, &[other]), "{other:?}: its budgets have room again first");
        }
    }
}
