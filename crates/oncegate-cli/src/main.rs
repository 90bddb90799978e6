//! `oncegate`: the server (`serve`), a token helper (`hash-token`), client verbs
//! (`reserve`, `commit`, `release`, `heartbeat`, `get`), operator verbs (`status`,
//! `inspect`, `admin release|purge|add-shards|backup`, `reshard`), the Idempotency-Key reverse
//! proxy (`proxy`) and the HTTP API's description (`openapi`).

mod add_shards;
mod backup;
mod client;
mod proxy;
mod reshard;
mod serve;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's allocator: the front allocates per call (HTTP/2 frames,
/// messages, futures), and glibc's malloc and free were a tenth of the server's CPU
/// samples under load (docs/benchmarks.md measures the swap).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An idempotency gate: durably and at most once per key, may this attempt proceed?
#[derive(Parser)]
#[command(name = "oncegate", version = oncegate_server::build::long_version(), about)]
struct Cli {
    #[command(subcommand)]
    command: Verb,
}

#[derive(Subcommand)]
enum Verb {
    /// Runs the server: gRPC on --listen, data under --data-dir.
    Serve(serve::ServeArgs),
    /// Prints the SHA-256 to put in a tenant's `token_sha256`; with no TOKEN, makes a new
    /// random token and prints both.
    HashToken {
        /// The bearer token to hash.
        token: Option<String>,
    },
    /// Asks whether an attempt may proceed.
    Reserve(client::ReserveArgs),
    /// Stores the holder's outcome and response.
    Commit(client::CommitArgs),
    /// Gives the key up so a retry may proceed.
    Release(client::TokenArgs),
    /// Renews the holder's lease.
    Heartbeat(client::HeartbeatArgs),
    /// Reads a key's state.
    Get(client::KeyArgs),
    /// Operator: every shard's state and counters.
    Status(client::AdminTarget),
    /// Operator: the whole stored record of a key.
    Inspect(client::InspectArgs),
    /// Operator: adds shards to a stopped data directory, moving slots to the new shards.
    Reshard(reshard::ReshardArgs),
    /// Runs the Idempotency-Key reverse proxy in front of an HTTP service.
    Proxy(proxy::ProxyArgs),
    /// Prints the HTTP/JSON API's OpenAPI 3.1 document (the server serves it at
    /// /v1/openapi.json).
    Openapi,
    /// Operator: force-release a pending key, purge a record, or add shards online.
    Admin {
        #[command(subcommand)]
        action: client::AdminAction,
    },
}

/// Runs the verb; an error (a configuration typo, a refused data directory, a refusal
/// from the server) is printed as its message and causes, never as a backtrace, and the
/// process exits with status 1.
fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Verb::Serve(args) => serve::run(args),
        Verb::HashToken { token } => {
            let (token, fresh) = match token {
                Some(token) => (token, false),
                None => (new_token()?, true),
            };
            if fresh {
                println!("token:        {token}");
                println!("token_sha256: {}", oncegate_server::token_sha256(&token));
            } else {
                println!("{}", oncegate_server::token_sha256(&token));
            }
            Ok(())
        }
        Verb::Reserve(args) => client::run(client::Call::Reserve(args)),
        Verb::Commit(args) => client::run(client::Call::Commit(args)),
        Verb::Release(args) => client::run(client::Call::Release(args)),
        Verb::Heartbeat(args) => client::run(client::Call::Heartbeat(args)),
        Verb::Get(args) => client::run(client::Call::Get(args)),
        Verb::Status(args) => client::run(client::Call::Status(args)),
        Verb::Inspect(args) => client::run(client::Call::Inspect(args)),
        Verb::Admin { action } => client::run(client::Call::Admin(action)),
        Verb::Reshard(args) => reshard::run(args),
        Verb::Proxy(args) => proxy::run(args),
        Verb::Openapi => {
            println!("{}", oncegate_server::http::openapi_json());
            Ok(())
        }
    }
}

/// 32 random bytes from the kernel, as hex.
fn new_token() -> anyhow::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
