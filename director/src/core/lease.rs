//! The director's lease: one active director per world. A standby asks for it every
//! `standby_poll_ms`; the active one renews it every quarter of it (at most every half second)
//! and counts it valid until the lease's length, less the clock drift allowed, after it *asked*
//! for the grant or renewal the store answered. Past that, unrenewed, it may have lapsed at the
//! store and a standby may hold it: the director commits nothing more and stands by.

use cellmesh_stores::topology::{writable_ms, DirectorAcquire, DirectorLease, TopologyError};
use cellmesh_world::balance::Balancer;

use super::stats::Role;
use super::{Active, DirectorCore, Event, Phase};

/// How soon a renewal the store failed is tried again, at most.
const RENEW_RETRY_MS: u64 = 100;

impl DirectorCore {
    /// The answer to a lease request asked at `asked`.
    pub(super) fn acquired(
        &mut self,
        t: u64,
        asked: u64,
        answer: Result<DirectorAcquire, TopologyError>,
    ) {
        let poll = self.cfg.standby_poll_ms;
        match answer {
            Ok(DirectorAcquire::Granted(lease)) => {
                self.set_ready();
                self.metrics.active.set(1);
                self.metrics.leases_granted.inc();
                self.event(Event::LeaseGranted { epoch: lease.epoch });
                let s = &mut self.stats;
                s.role = Role::Active;
                s.lease = Some(lease.clone());
                s.other = None;
                s.leases_granted += 1;
                // A fresh start: another director may have changed the world since this one
                // last balanced it, and the layout it reads now is the truth.
                self.balancer = Balancer::new(self.cfg.balance.clone());
                self.last_reason.clear();
                // The bubbles too: what this director placed before may have been moved since,
                // and a fresh placement starts each group where it is simulated now.
                self.bubbles = self
                    .cfg
                    .bubbles
                    .as_ref()
                    .and_then(super::bubbles::Bubbles::new);
                self.phase = Phase::Active(Active {
                    lease,
                    valid_until: asked + writable_ms(self.cfg.lease_ms),
                    renew_at: asked + self.renew_every(),
                    round_at: t,
                });
                return;
            }
            Ok(DirectorAcquire::Held(other)) => {
                self.set_ready();
                self.stats.other = Some(other);
                self.stats.idle_because = None;
            }
            Err(TopologyError::NoPartition) => {
                self.set_ready();
                self.stats.idle_because = Some("no partition is committed yet".into());
            }
            Err(e) => self.failed("acquire", "store", e),
        }
        self.phase = Phase::Standby { ask_at: t + poll };
    }

    /// The answer to a renewal asked at `asked`.
    pub(super) fn renewed(
        &mut self,
        t: u64,
        asked: u64,
        answer: Result<Option<DirectorLease>, TopologyError>,
    ) {
        let renew = self.renew_every();
        let writable = writable_ms(self.cfg.lease_ms);
        let Phase::Active(a) = &mut self.phase else {
            return;
        };
        match answer {
            Ok(Some(lease)) => {
                a.lease = lease.clone();
                a.valid_until = asked + writable;
                a.renew_at = asked + renew;
                self.stats.lease = Some(lease);
            }
            Ok(None) => self.stand_by(t, None, "lapsed"),
            Err(e) => {
                a.renew_at = t + renew.min(RENEW_RETRY_MS);
                // The store would refuse a commit past the lease anyway; standing by is for the
                // readers of `/state` and the metrics.
                let lapsed = t >= a.valid_until;
                self.failed("renew", "store", e);
                if lapsed {
                    self.stand_by(t, None, "lapsed");
                }
            }
        }
    }

    /// The lease is lost (`other`: the lease the store holds now, if known): ask for it again
    /// at once, as a standby.
    pub(super) fn stand_by(&mut self, t: u64, other: Option<DirectorLease>, why: &'static str) {
        self.event(Event::LeaseLost { why });
        self.metrics.active.set(0);
        self.metrics.leases_lost.inc();
        let s = &mut self.stats;
        s.role = Role::Standby;
        s.lease = None;
        s.other = other;
        s.leases_lost += 1;
        self.phase = Phase::Standby { ask_at: t };
    }

    /// The answer to giving the lease back on stop.
    pub(super) fn released(&mut self, answer: Result<bool, TopologyError>) {
        match answer {
            Ok(released) => self.event(Event::LeaseReleased { released }),
            Err(e) => self.failed("release", "store", e),
        }
        self.finish();
    }
}
