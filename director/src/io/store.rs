//! The core's store calls, run on a [`TopologyStore`].

use cellmesh_stores::topology::{TopologyError, TopologyStore};

use crate::core::{StoreReply, StoreRequest, WorldRead};

/// Runs `request` on `store`: the answer to give the core.
pub async fn call(store: &dyn TopologyStore, request: StoreRequest) -> StoreReply {
    match request {
        StoreRequest::Acquire { holder, ttl } => {
            StoreReply::Acquired(store.acquire_director(&holder, ttl).await)
        }
        StoreRequest::Renew { lease, ttl } => {
            StoreReply::Renewed(store.renew_director(&lease, ttl).await)
        }
        StoreRequest::Read { players } => {
            StoreReply::Read(read(store, players).await.map(Box::new))
        }
        StoreRequest::Commit {
            lease,
            expected_epoch,
            next,
        } => StoreReply::Committed(
            store
                .commit_partition_as(&lease, expected_epoch, &next)
                .await,
        ),
        StoreRequest::Release { lease } => {
            StoreReply::Released(store.release_director(&lease).await)
        }
    }
}

async fn read(store: &dyn TopologyStore, players: bool) -> Result<WorldRead, TopologyError> {
    Ok(WorldRead {
        partition: store.partition().await?,
        loads: store.loads().await?,
        nodes: store.nodes().await?,
        players: if players {
            store.players().await?
        } else {
            Default::default()
        },
    })
}
