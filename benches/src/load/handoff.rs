//! `handoff`: not measured yet.

use serde_json::Value;

use super::Options;

pub async fn run(_opts: &Options) -> anyhow::Result<Value> {
    anyhow::bail!("the handoff scenario is not built yet")
}
