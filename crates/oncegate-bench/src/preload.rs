//! Filling a store before a run, for figures on a store that already holds records.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Fills a data directory with `count` completed records (fresh keys, one-day ttl)
/// through the embedded engine, `in_flight` pairs at a time, so that a later run measures
/// a store that already holds them. Returns the time it took.
pub fn preload(
    data_dir: &std::path::Path,
    shards: u32,
    store: oncegate_engine::StoreConfig,
    count: u64,
    in_flight: u64,
) -> anyhow::Result<Duration> {
    let config =
        oncegate_engine::EngineConfig { data_dir: data_dir.to_owned(), shards, store, ..Default::default() };
    let engine = oncegate_engine::Engine::open(config)?;
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let next = Arc::new(AtomicU64::new(0));
    runtime.block_on(async {
        let mut workers = Vec::new();
        for _ in 0..in_flight {
            let (engine, next) = (engine.clone(), next.clone());
            workers.push(tokio::spawn(async move {
                let tenant = oncegate_core::Tenant::default_tenant();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return anyhow::Ok(());
                    }
                    let key = format!("preload-{i}");
                    let request = oncegate_engine::ReserveRequest {
                        namespace: "bench".into(),
                        key: key.clone(),
                        ttl_ms: 86_400_000,
                        ..Default::default()
                    };
                    let token = match engine.reserve(&tenant, request).await?.reply {
                        oncegate_core::ReserveReply::Granted { token, .. } => token,
                        _ => continue,
                    };
                    let commit = oncegate_engine::CommitRequest {
                        namespace: "bench".into(),
                        key,
                        token,
                        outcome: oncegate_core::Outcome::Succeeded,
                        response: vec![b'p'; 64],
                    };
                    engine.commit(&tenant, commit).await?;
                }
            }));
        }
        for worker in workers {
            worker.await??;
        }
        anyhow::Ok(())
    })?;
    engine.shutdown();
    Ok(started.elapsed())
}
