//! Another geo's board, connected on first use: a proxy must start (and keep serving its own geo)
//! while the other geo is out of reach, as during a cut between the datacenters. Each call made
//! while the board is not connected tries to connect, and fails as a call to a board that went
//! away does.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::OnceCell;

use super::{open_board, redact_url, EdgeBoard, FarRtt, StoreError};

pub struct LazyBoard {
    url: String,
    geo: String,
    board: OnceCell<Arc<dyn EdgeBoard>>,
}

impl LazyBoard {
    /// A board for `url` that connects at its first call. A URL no board can have is refused
    /// now, not at the first call.
    pub fn new(url: &str, geo: &str) -> Result<Self, StoreError> {
        let redis = super::is_redis_url(url);
        if !(matches!(url, "memory" | "") || redis) {
            return Err(StoreError::BadUrl(redact_url(url)));
        }
        #[cfg(feature = "redis")]
        if redis && ::redis::Client::open(url).is_err() {
            return Err(StoreError::BadUrl(redact_url(url)));
        }
        #[cfg(not(feature = "redis"))]
        if redis {
            return Err(super::not_built_in(url, "Redis", "redis"));
        }
        if redis && !super::valid_geo(geo) {
            return Err(StoreError::InvalidGeo(geo.to_string()));
        }
        Ok(Self {
            url: url.to_string(),
            geo: geo.to_string(),
            board: OnceCell::new(),
        })
    }

    async fn board(&self) -> Result<&Arc<dyn EdgeBoard>, StoreError> {
        self.board
            .get_or_try_init(|| open_board(&self.url, &self.geo))
            .await
    }
}

#[async_trait]
impl EdgeBoard for LazyBoard {
    async fn put_hint(
        &self,
        account: &str,
        sealed: &[u8],
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.board().await?.put_hint(account, sealed, ttl).await
    }

    async fn take_hint(&self, account: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.board().await?.take_hint(account).await
    }

    async fn use_nonce(
        &self,
        account: &str,
        nonce: &[u8],
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.board().await?.use_nonce(account, nonce, ttl).await
    }

    async fn put_far_rtt(
        &self,
        account: &str,
        geo: &str,
        rtt: FarRtt,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.board()
            .await?
            .put_far_rtt(account, geo, rtt, ttl)
            .await
    }

    async fn far_rtts(&self, account: &str) -> Result<Vec<(String, FarRtt)>, StoreError> {
        self.board().await?.far_rtts(account).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unreachable_board_is_made_at_once_and_each_call_fails_until_it_answers() {
        // Nothing listens on port 1.
        let board = LazyBoard::new("redis://127.0.0.1:1", "us").expect("a well-formed URL");
        let err = board.take_hint("alice").await.expect_err("nothing answers");
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
        assert!(
            board.board.get().is_none(),
            "a failed connect is tried again"
        );
    }

    #[tokio::test]
    async fn a_memory_board_works_through_it() {
        let board = LazyBoard::new("memory", "us").unwrap();
        board
            .put_hint("alice", b"sealed", Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(
            board.take_hint("alice").await.unwrap(),
            Some(b"sealed".to_vec())
        );
    }

    #[test]
    fn a_url_no_board_can_have_is_refused_at_once() {
        assert!(matches!(
            LazyBoard::new("mongodb://x", "us"),
            Err(StoreError::BadUrl(_))
        ));
        assert!(LazyBoard::new("redis://127.0.0.1:6379", "bad geo!").is_err());
    }
}
