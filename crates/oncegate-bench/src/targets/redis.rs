//! Redis with `appendfsync always`: `SET NX PX` reserves, a Lua script commits only for
//! the holder's token, and a duplicate reads the stored answer, as a gateway would.

use anyhow::Context;

use super::{Reserved, Target};
use crate::Work;

const COMMIT: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"#;

/// A multiplexed Redis connection.
#[derive(Clone)]
pub struct Redis {
    connection: redis::aio::MultiplexedConnection,
    commit: redis::Script,
}

impl Redis {
    /// Connects to `url` (for example `redis://127.0.0.1:6390`).
    pub async fn connect(url: &str) -> anyhow::Result<Redis> {
        let client = redis::Client::open(url)?;
        let connection = client.get_multiplexed_async_connection().await.context("redis")?;
        Ok(Redis { connection, commit: redis::Script::new(COMMIT) })
    }
}

impl Target for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn reserve(&self, _worker: usize, key: &str, token: u64, work: &Work) -> anyhow::Result<Reserved> {
        let mut connection = self.connection.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(format!("pending:{token}"))
            .arg("NX")
            .arg("PX")
            .arg(work.ttl_ms)
            .query_async(&mut connection)
            .await?;
        if set.is_some() {
            return Ok(Reserved::Granted(token));
        }
        let stored: Option<Vec<u8>> = redis::cmd("GET").arg(key).query_async(&mut connection).await?;
        Ok(match stored {
            Some(v) if v.starts_with(b"done:") => Reserved::Replayed,
            _ => Reserved::Busy,
        })
    }

    async fn commit(
        &self,
        _worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        work: &Work,
    ) -> anyhow::Result<()> {
        let mut connection = self.connection.clone();
        let mut done = b"done:".to_vec();
        done.extend_from_slice(response);
        let committed: i64 = self
            .commit
            .key(key)
            .arg(format!("pending:{token}"))
            .arg(done)
            .arg(work.ttl_ms)
            .invoke_async(&mut connection)
            .await?;
        anyhow::ensure!(committed == 1, "redis commit fenced off");
        Ok(())
    }
}
