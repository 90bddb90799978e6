//! PostgreSQL with `synchronous_commit = on`: `INSERT ... ON CONFLICT DO NOTHING`
//! reserves, an `UPDATE` fenced by token commits; one connection per worker.

use std::sync::Arc;

use anyhow::Context;

use super::{Reserved, Target};
use crate::Work;

/// Connected PostgreSQL clients.
#[derive(Clone)]
pub struct Postgres {
    clients: Arc<Vec<tokio_postgres::Client>>,
}

impl Postgres {
    /// Connects `connections` clients with `config` and creates (and empties) the table.
    pub async fn connect(config: &str, connections: usize) -> anyhow::Result<Postgres> {
        let mut clients = Vec::new();
        for _ in 0..connections.max(1) {
            let (client, connection) =
                tokio_postgres::connect(config, tokio_postgres::NoTls).await.context("postgres")?;
            tokio::spawn(connection);
            clients.push(client);
        }
        clients[0]
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS gate (
                    key text PRIMARY KEY, token bigint NOT NULL, done boolean NOT NULL DEFAULT false,
                    lease_until timestamptz NOT NULL, expires_at timestamptz NOT NULL, response bytea);
                 TRUNCATE gate;",
            )
            .await?;
        Ok(Postgres { clients: Arc::new(clients) })
    }

    fn client(&self, worker: usize) -> &tokio_postgres::Client {
        &self.clients[worker % self.clients.len()]
    }
}

impl Target for Postgres {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn reserve(&self, worker: usize, key: &str, token: u64, work: &Work) -> anyhow::Result<Reserved> {
        let client = self.client(worker);
        let inserted = client
            .execute(
                "INSERT INTO gate (key, token, lease_until, expires_at)
                 VALUES ($1, $2, now() + $3 * interval '1 millisecond', now() + $4 * interval '1 millisecond')
                 ON CONFLICT DO NOTHING",
                &[&key, &(token as i64), &(work.lease_ms as f64), &(work.ttl_ms as f64)],
            )
            .await?;
        if inserted == 1 {
            return Ok(Reserved::Granted(token));
        }
        let row = client.query_opt("SELECT done, response FROM gate WHERE key = $1", &[&key]).await?;
        Ok(match row {
            Some(row) if row.get::<_, bool>(0) => Reserved::Replayed,
            _ => Reserved::Busy,
        })
    }

    async fn commit(
        &self,
        worker: usize,
        key: &str,
        token: u64,
        response: &[u8],
        work: &Work,
    ) -> anyhow::Result<()> {
        let updated = self
            .client(worker)
            .execute(
                "UPDATE gate SET done = true, response = $3,
                     expires_at = greatest(expires_at, now() + $4 * interval '1 millisecond')
                 WHERE key = $1 AND token = $2 AND NOT done",
                &[&key, &(token as i64), &response, &(work.ttl_ms as f64)],
            )
            .await?;
        anyhow::ensure!(updated == 1, "postgres commit fenced off");
        Ok(())
    }
}
