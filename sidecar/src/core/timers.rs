//! The node's named deadlines: each periodic check has a name, a period and the time it is
//! next due, and the table says which are due now. The core runs what is due on
//! [`super::Input::Timer`] and asks the table when to be woken next.

use crate::config::SidecarConfig;

/// How often the state is published (if it changed), a drain checked, and the sweeps run.
pub(crate) const SWEEP_EVERY_MS: u64 = 100;

/// A periodic check of the node, in the order the checks due together run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timer {
    /// The directory leases of this gateway's sessions are renewed.
    RenewSessions,
    /// Render ghosts no longer refreshed by their owner are dropped.
    StaleGhosts,
    /// Frames the epoch fence held too long are let go.
    OverdueFrames,
    /// Reals due a checkpoint are asked of the game.
    AskCheckpoints,
    /// Entities kept for a game that went away are dropped once its grace is over.
    GameGrace,
    /// Checkpoints the game sent are written to the store.
    FlushCheckpoints,
    /// Offers sent long ago and never answered are forgotten.
    SentOffers,
    /// Dead nodes' worlds are restored.
    Restore,
    /// One avatar per account: masters looked up, leaves retried.
    Avatars,
    /// Commands waiting past their deadline or for a target's whereabouts.
    Commands,
    /// Claims' renewals, rebinds and lapses.
    Claims,
    /// Spawn points due a stock.
    Spawners,
    /// Player records due a save.
    PlayerRecords,
    /// Where this node's masters are, told to the directory.
    Whereabouts,
    /// Whether new sessions are admitted again.
    Admission,
    /// The state published if it changed, and a drained node stopped.
    Publish,
}

impl Timer {
    /// Every timer, in the order the checks due together run.
    pub(crate) const ALL: [Timer; 16] = [
        Timer::RenewSessions,
        Timer::StaleGhosts,
        Timer::OverdueFrames,
        Timer::AskCheckpoints,
        Timer::GameGrace,
        Timer::FlushCheckpoints,
        Timer::SentOffers,
        Timer::Restore,
        Timer::Avatars,
        Timer::Commands,
        Timer::Claims,
        Timer::Spawners,
        Timer::PlayerRecords,
        Timer::Whereabouts,
        Timer::Admission,
        Timer::Publish,
    ];

    /// How long after it ran the timer is due again.
    fn period_ms(self, config: &SidecarConfig) -> u64 {
        match self {
            Timer::RenewSessions => (config.session_lease_ms / 3).max(1),
            _ => SWEEP_EVERY_MS,
        }
    }

    /// When it is first due, for a node started at `now_ms`: the sessions' leases a third of
    /// a lease after the start, every other check at once.
    fn first_ms(self, config: &SidecarConfig, now_ms: u64) -> u64 {
        match self {
            Timer::RenewSessions => now_ms + config.session_lease_ms / 3,
            _ => now_ms,
        }
    }
}

/// When each timer is next due (monotonic ms).
pub(crate) struct Timers {
    next_ms: [u64; Timer::ALL.len()],
}

impl Timers {
    pub(crate) fn new(config: &SidecarConfig, now_ms: u64) -> Self {
        Self {
            next_ms: Timer::ALL.map(|t| t.first_ms(config, now_ms)),
        }
    }

    /// The timers due at `now_ms`, in order, each set to its next time.
    pub(crate) fn take_due(&mut self, config: &SidecarConfig, now_ms: u64) -> Vec<Timer> {
        let mut due = Vec::new();
        for (timer, next) in Timer::ALL.iter().zip(self.next_ms.iter_mut()) {
            if now_ms >= *next {
                *next = now_ms + timer.period_ms(config);
                due.push(*timer);
            }
        }
        due
    }

    /// When the first timer is due.
    pub(crate) fn next_due(&self) -> u64 {
        self.next_ms.iter().copied().min().unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_due_run_in_order_and_come_back_after_their_period() {
        let config = SidecarConfig {
            session_lease_ms: 3_000,
            ..SidecarConfig::default()
        };
        let mut timers = Timers::new(&config, 1_000);
        assert_eq!(timers.next_due(), 1_000);
        let due = timers.take_due(&config, 1_000);
        assert_eq!(due.first(), Some(&Timer::StaleGhosts));
        assert_eq!(due.last(), Some(&Timer::Publish));
        assert_eq!(
            due.len(),
            Timer::ALL.len() - 1,
            "the leases wait a third of one"
        );
        assert!(timers.take_due(&config, 1_099).is_empty());
        assert_eq!(timers.next_due(), 1_100);
        let due = timers.take_due(&config, 2_000);
        assert_eq!(due.first(), Some(&Timer::RenewSessions));
        assert_eq!(due.len(), Timer::ALL.len());
        assert_eq!(timers.next_due(), 2_100);
        timers.take_due(&config, 2_100);
        assert_eq!(timers.take_due(&config, 3_000), Timer::ALL.to_vec());
    }
}
