//! Client verbs for operators: one gRPC call, the answer printed as one JSON object.
//!
//! Exit status: 0 for an answer (including `in_progress`, `completed` and `mismatch`),
//! 1 for a refusal (the JSON then has an `error` object with the gRPC and stable codes),
//! 2 for a usage or connection problem.

use std::path::PathBuf;

use anyhow::Context;
use oncegate_client::{
    Client, ClientError, CommitRequest, Gate, KeyRequest, Refusal, Renewed, ReserveRequest, Reserved,
    RetryPolicy, Transport,
};
use oncegate_core::{Outcome, Previous, ReserveReply, State, View};
use oncegate_proto::v1 as pb;
use oncegate_proto::v1::admin_client::AdminClient;
use serde_json::{Value, json};
use tonic::Request;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// The server's address and, for an `https://` address, how to trust it and how to
/// present this client to a server that requires mutual TLS.
#[derive(clap::Args)]
pub struct Connection {
    /// The server's address: `http://HOST:PORT`, or `https://HOST:PORT` for TLS.
    #[arg(long, env = "ONCEGATE_ADDR", default_value = "http://127.0.0.1:50051")]
    addr: String,
    /// The CA certificate (PEM) that signed the server's certificate; without it, the
    /// system's trusted roots.
    #[arg(long, env = "ONCEGATE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), for a server that requires mutual TLS.
    #[arg(long, env = "ONCEGATE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "ONCEGATE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the address's host.
    #[arg(long, env = "ONCEGATE_TLS_DOMAIN")]
    tls_domain: Option<String>,
}

impl Connection {
    /// Connects, over TLS when the address is `https://`.
    /// Refuses TLS flags on a plaintext address, and warns before a token crosses the
    /// network in plaintext.
    fn check(&self, token: Option<&String>) -> anyhow::Result<()> {
        let uri: tonic::codegen::http::Uri = self.addr.parse().with_context(|| self.addr.clone())?;
        if uri.scheme_str() == Some("https") {
            return Ok(());
        }
        if self.tls_ca.is_some() || self.tls_cert.is_some() {
            anyhow::bail!("--tls-ca and --tls-cert need an https:// address; {} is plaintext", self.addr);
        }
        if token.is_some() && !oncegate_server::is_loopback_host(uri.host().unwrap_or_default()) {
            eprintln!(
                "oncegate: warning: sending the bearer token in plaintext to {}; use https://",
                self.addr
            );
        }
        Ok(())
    }

    async fn channel(&self, token: Option<&String>) -> anyhow::Result<Channel> {
        self.check(token)?;
        let mut endpoint = Endpoint::from_shared(self.addr.clone()).with_context(|| self.addr.clone())?;
        if endpoint.uri().scheme_str() == Some("https") {
            endpoint = endpoint.tls_config(self.tls()?)?;
        }
        // The causes matter (a handshake failure says why only in one); `{:#}` prints them.
        endpoint.connect().await.map_err(|e| anyhow::Error::new(e).context(self.addr.clone()))
    }

    fn tls(&self) -> anyhow::Result<ClientTlsConfig> {
        let read = |path: &PathBuf| std::fs::read(path).with_context(|| path.display().to_string());
        let mut tls = ClientTlsConfig::new();
        tls = match &self.tls_ca {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(read(ca)?)),
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        if let Some(domain) = &self.tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        Ok(tls)
    }
}

/// Where and as whom to call.
#[derive(clap::Args)]
pub struct Target {
    #[command(flatten)]
    connection: Connection,
    /// A file holding the bearer token; without it, `ONCEGATE_TOKEN` (neither is needed
    /// when the server has no tenants).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Refused: the process list would show the token to every user of the machine.
    #[arg(long, hide = true)]
    token: Option<String>,
    /// The namespace.
    #[arg(long, env = "ONCEGATE_NAMESPACE", default_value = "default")]
    namespace: String,
}

#[derive(clap::Args)]
pub struct ReserveArgs {
    #[command(flatten)]
    target: Target,
    /// The idempotency key; omit it and give --part (with --bucket-ms) to derive one.
    key: Option<String>,
    /// A part of a derived key; repeat for each part.
    #[arg(long = "part")]
    parts: Vec<String>,
    /// The bucket width of a derived key.
    #[arg(long, default_value_t = 0)]
    bucket_ms: u64,
    /// Within this long after a bucket boundary, answer from the previous bucket's key
    /// while it holds a live record.
    #[arg(long, default_value_t = 0)]
    bucket_grace_ms: u64,
    /// 0 selects the server's default.
    #[arg(long, default_value_t = 0)]
    ttl_ms: u64,
    /// 0 selects the server's default.
    #[arg(long, default_value_t = 0)]
    lease_ms: u64,
    /// Wait this long if the key is in progress.
    #[arg(long, default_value_t = 0)]
    wait_ms: u64,
    /// A fingerprint of the payload (its UTF-8 bytes are sent).
    #[arg(long, default_value = "")]
    fingerprint: String,
}

#[derive(clap::Args)]
pub struct CommitArgs {
    #[command(flatten)]
    target: Target,
    /// The key.
    key: String,
    /// The fencing token the reserve granted.
    fencing_token: u64,
    /// Record the outcome as failed instead of succeeded.
    #[arg(long)]
    failed: bool,
    /// The response to store (its UTF-8 bytes).
    #[arg(long, default_value = "")]
    response: String,
}

#[derive(clap::Args)]
pub struct TokenArgs {
    #[command(flatten)]
    target: Target,
    /// The key.
    key: String,
    /// The fencing token the reserve granted.
    fencing_token: u64,
}

#[derive(clap::Args)]
pub struct HeartbeatArgs {
    #[command(flatten)]
    target: Target,
    /// The key.
    key: String,
    /// The fencing token the reserve granted.
    fencing_token: u64,
    /// The new lease; 0 selects the server's default.
    #[arg(long, default_value_t = 0)]
    lease_ms: u64,
}

#[derive(clap::Args)]
pub struct KeyArgs {
    #[command(flatten)]
    target: Target,
    /// The key.
    key: String,
}

/// Where the Admin service is, and its token.
#[derive(clap::Args)]
pub struct AdminTarget {
    #[command(flatten)]
    connection: Connection,
    /// A file holding the admin bearer token; without it, `ONCEGATE_ADMIN_TOKEN` (neither
    /// is needed when the server has no tenants and no admin token).
    #[arg(long, value_name = "PATH")]
    admin_token_file: Option<PathBuf>,
    /// Refused: the process list would show the token to every user of the machine.
    #[arg(long, hide = true)]
    admin_token: Option<String>,
}

impl Target {
    fn token(&self) -> anyhow::Result<Option<String>> {
        secret(self.token.is_some(), "--token", self.token_file.as_deref(), "ONCEGATE_TOKEN")
    }
}

impl AdminTarget {
    fn admin_token(&self) -> anyhow::Result<Option<String>> {
        let file = self.admin_token_file.as_deref();
        secret(self.admin_token.is_some(), "--admin-token", file, "ONCEGATE_ADMIN_TOKEN")
    }
}

/// A bearer token from `file`, else from the environment variable `var` (unset or empty:
/// none); refused when given on the command line as `flag`, where the process list shows
/// it to every user of the machine.
pub(crate) fn secret(
    given: bool,
    flag: &str,
    file: Option<&std::path::Path>,
    var: &str,
) -> anyhow::Result<Option<String>> {
    if given {
        anyhow::bail!("{flag} would show the token in the process list; set {var} or use {flag}-file");
    }
    if let Some(file) = file {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading the token in {flag}-file {}", file.display()))?;
        let token = text.trim();
        anyhow::ensure!(!token.is_empty(), "{flag}-file {} is empty", file.display());
        return Ok(Some(token.to_owned()));
    }
    Ok(std::env::var(var).ok().filter(|token| !token.is_empty()))
}

#[derive(clap::Args)]
pub struct InspectArgs {
    #[command(flatten)]
    target: AdminTarget,
    /// The tenant that owns the key.
    #[arg(long, default_value = "default")]
    tenant: String,
    /// The namespace.
    #[arg(long, env = "ONCEGATE_NAMESPACE", default_value = "default")]
    namespace: String,
    /// The key.
    key: String,
}

#[derive(clap::Args)]
pub struct AdminKeyArgs {
    #[command(flatten)]
    inspect: InspectArgs,
    /// Why: required, and logged by the server with the action.
    #[arg(long)]
    reason: String,
}

#[derive(clap::Subcommand)]
pub enum AdminAction {
    /// Frees a pending or abandoned key whatever its token.
    Release(AdminKeyArgs),
    /// Deletes a key's record in any state, completion included.
    Purge(AdminKeyArgs),
    /// Adds shards to the running server and moves slots to them, one at a time, while
    /// it serves.
    AddShards(crate::add_shards::AddShardsArgs),
    /// Writes a consistent copy of the running server's data directory into a new
    /// directory on its machine, while it serves; restoring is starting a server on it.
    Backup(crate::backup::BackupArgs),
}

pub enum Call {
    Reserve(ReserveArgs),
    Commit(CommitArgs),
    Release(TokenArgs),
    Heartbeat(HeartbeatArgs),
    Get(KeyArgs),
    Status(AdminTarget),
    Inspect(InspectArgs),
    Admin(AdminAction),
}

/// A verb's answer: the outer error is a local problem (usage, connection); the inner
/// one is the server's refusal.
/// A verb's answer: JSON, a refusal (exit 1), or a usage or connection problem (exit 2).
pub(crate) type Answer = anyhow::Result<Result<Value, Refusal>>;

/// Follows a streamed admin call on a progress bar (`template`, indicatif's) until its
/// message with `done` set, which it returns; `at` reads a message's position and length.
/// A stream that ends before that message is an error naming `what`.
pub(crate) async fn follow<M>(
    stream: &mut tonic::Streaming<M>,
    template: &str,
    what: &str,
    at: impl Fn(&M) -> (bool, u64, u64),
) -> anyhow::Result<Result<M, Refusal>> {
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    let last = loop {
        match stream.message().await {
            Ok(Some(message)) => {
                let (done, position, length) = at(&message);
                if done {
                    break Ok(message);
                }
                bar.set_length(length);
                bar.set_position(position);
            }
            Ok(None) => anyhow::bail!("the server ended the stream before {what}"),
            Err(status) => break Err(Refusal::of_status(status)),
        }
    };
    bar.finish_and_clear();
    Ok(last)
}

fn with_token<T>(token: Option<&String>, message: T) -> anyhow::Result<Request<T>> {
    let mut request = Request::new(message);
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse()?);
    }
    Ok(request)
}

pub(crate) fn admin_request<T>(target: &AdminTarget, message: T) -> anyhow::Result<Request<T>> {
    with_token(target.admin_token()?.as_ref(), message)
}

/// The client crate's `Client` for one call: unary, no retries (an operator sees what the
/// server answered to exactly one call).
async fn gate(target: &Target) -> anyhow::Result<Client> {
    let connection = &target.connection;
    let token = target.token()?;
    connection.check(token.as_ref())?;
    let mut builder =
        Client::builder(connection.addr.clone()).transport(Transport::Unary).retry(RetryPolicy::NONE);
    if let Some(token) = &token {
        builder = builder.token(token);
    }
    if let Some(ca) = &connection.tls_ca {
        builder = builder.tls_ca(ca);
    }
    if let (Some(cert), Some(key)) = (&connection.tls_cert, &connection.tls_key) {
        builder = builder.tls_identity(cert, key);
    }
    if let Some(domain) = &connection.tls_domain {
        builder = builder.tls_domain(domain);
    }
    Ok(builder.connect().await?)
}

pub(crate) async fn admin(target: &AdminTarget) -> anyhow::Result<AdminClient<Channel>> {
    Ok(AdminClient::new(target.connection.channel(target.admin_token()?.as_ref()).await?))
}

fn state_name(value: i32) -> &'static str {
    match pb::State::try_from(value) {
        Ok(pb::State::Free) => "free",
        Ok(pb::State::Pending) => "pending",
        Ok(pb::State::Abandoned) => "abandoned",
        Ok(pb::State::Completed) => "completed",
        _ => "unspecified",
    }
}

fn bytes_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => json!(text),
        Err(_) => json!({ "hex": bytes.iter().map(|b| format!("{b:02x}")).collect::<String>() }),
    }
}

fn outcome_name(value: i32) -> &'static str {
    match pb::Outcome::try_from(value) {
        Ok(pb::Outcome::Succeeded) => "succeeded",
        Ok(pb::Outcome::Failed) => "failed",
        _ => "unspecified",
    }
}

fn transition_name(value: i32) -> &'static str {
    match pb::TransitionKind::try_from(value) {
        Ok(pb::TransitionKind::TransitionGranted) => "granted",
        Ok(pb::TransitionKind::TransitionHeartbeat) => "heartbeat",
        Ok(pb::TransitionKind::TransitionAbandoned) => "abandoned",
        Ok(pb::TransitionKind::TransitionRegranted) => "regranted",
        Ok(pb::TransitionKind::TransitionCommitted) => "committed",
        _ => "unspecified",
    }
}

/// The canonical gRPC name of a code, such as `FAILED_PRECONDITION`.
fn refusal_json(refusal: &Refusal) -> Value {
    json!({ "error": {
        "grpc": refusal.grpc.name(),
        "code": refusal.code.as_str(),
        "field": refusal.field,
        "limit": refusal.limit,
        "message": refusal.message,
        "causes": refusal.causes,
    } })
}

pub fn run(call: Call) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let answer = runtime.block_on(call_once(call));
    match answer {
        Ok(Ok(value)) => {
            println!("{value}");
            Ok(())
        }
        Ok(Err(refusal)) => {
            println!("{}", refusal_json(&refusal));
            std::process::exit(1);
        }
        Err(error) => {
            eprintln!("oncegate: {error:#}");
            std::process::exit(2);
        }
    }
}

async fn call_once(call: Call) -> Answer {
    match call {
        Call::Reserve(a) => reserve(a).await,
        Call::Commit(a) => commit(a).await,
        Call::Release(a) => release(a).await,
        Call::Heartbeat(a) => heartbeat(a).await,
        Call::Get(a) => get(a).await,
        Call::Status(target) => status(target).await,
        Call::Inspect(a) => inspect(a).await,
        Call::Admin(AdminAction::Release(a)) => remove(Removal::Release, a).await,
        Call::Admin(AdminAction::Purge(a)) => remove(Removal::Purge, a).await,
        Call::Admin(AdminAction::AddShards(a)) => crate::add_shards::run(a).await,
        Call::Admin(AdminAction::Backup(a)) => crate::backup::run(a).await,
    }
}

fn reserve_json(r: Reserved) -> Value {
    let mut out = match r.reply {
        ReserveReply::Granted { token, attempt, lease_until_ms, lease_ms, expires_at_ms, previous } => {
            json!({
                "outcome": "granted", "token": token, "attempt": attempt,
                "lease_until_ms": lease_until_ms, "lease_ms": lease_ms, "expires_at_ms": expires_at_ms,
                "previous": if previous == Previous::Abandoned { "abandoned" } else { "none" },
            })
        }
        ReserveReply::InProgress { attempt, lease_until_ms, retry_after_ms } => json!({
            "outcome": "in_progress", "attempt": attempt,
            "lease_until_ms": lease_until_ms, "retry_after_ms": retry_after_ms,
        }),
        ReserveReply::Completed { token, outcome, response, completed_at_ms, expires_at_ms } => json!({
            "outcome": "completed", "token": token, "result": outcome_str(Some(outcome)),
            "response": bytes_json(&response), "completed_at_ms": completed_at_ms,
            "expires_at_ms": expires_at_ms,
        }),
        ReserveReply::Mismatch { expires_at_ms } => {
            json!({ "outcome": "mismatch", "expires_at_ms": expires_at_ms })
        }
    };
    out["key"] = json!(r.key.as_str());
    out
}

fn outcome_str(outcome: Option<Outcome>) -> &'static str {
    match outcome {
        Some(Outcome::Succeeded) => "succeeded",
        Some(Outcome::Failed) => "failed",
        None => "unspecified",
    }
}

fn state_str(state: State) -> &'static str {
    match state {
        State::Free => "free",
        State::Pending => "pending",
        State::Abandoned => "abandoned",
        State::Completed => "completed",
    }
}

/// One call of the client crate's `Gate`: a refusal is the verb's answer (exit 1), a
/// connection or setup problem its failure (exit 2).
async fn gate_call<T>(
    target: &Target,
    call: impl AsyncFnOnce(Client) -> Result<T, ClientError>,
    json: impl FnOnce(T) -> Value,
) -> Answer {
    match call(gate(target).await?).await {
        Ok(answer) => Ok(Ok(json(answer))),
        Err(ClientError::Refused(refusal)) => Ok(Err(refusal)),
        Err(error) => Err(error.into()),
    }
}

async fn reserve(a: ReserveArgs) -> Answer {
    let request = ReserveRequest {
        namespace: a.target.namespace.clone(),
        key: a.key.clone().unwrap_or_default(),
        key_parts: a.parts.clone(),
        bucket_ms: a.bucket_ms,
        bucket_grace_ms: a.bucket_grace_ms,
        ttl_ms: a.ttl_ms,
        lease_ms: a.lease_ms,
        fingerprint: a.fingerprint.clone().into_bytes(),
        wait_ms: a.wait_ms,
    };
    gate_call(&a.target, async |gate| gate.reserve(request).await, reserve_json).await
}

async fn commit(a: CommitArgs) -> Answer {
    let request = CommitRequest {
        namespace: a.target.namespace.clone(),
        key: a.key.clone(),
        token: a.fencing_token,
        outcome: if a.failed { Outcome::Failed } else { Outcome::Succeeded },
        response: a.response.clone().into_bytes(),
    };
    let json = |expires_at_ms| json!({ "committed": true, "expires_at_ms": expires_at_ms });
    gate_call(&a.target, async |gate| gate.commit(request).await, json).await
}

async fn release(a: TokenArgs) -> Answer {
    let request = KeyRequest {
        namespace: a.target.namespace.clone(),
        key: a.key.clone(),
        token: a.fencing_token,
        lease_ms: 0,
    };
    gate_call(&a.target, async |gate| gate.release(request).await, |()| json!({ "released": true })).await
}

async fn heartbeat(a: HeartbeatArgs) -> Answer {
    let request = KeyRequest {
        namespace: a.target.namespace.clone(),
        key: a.key.clone(),
        token: a.fencing_token,
        lease_ms: a.lease_ms,
    };
    let json = |r: Renewed| json!({ "lease_until_ms": r.lease_until_ms, "expires_at_ms": r.expires_at_ms });
    gate_call(&a.target, async |gate| gate.heartbeat(request).await, json).await
}

async fn get(a: KeyArgs) -> Answer {
    let request =
        KeyRequest { namespace: a.target.namespace.clone(), key: a.key.clone(), token: 0, lease_ms: 0 };
    let json = |v: View| {
        json!({
            "state": state_str(v.state), "token": v.token, "attempt": v.attempt,
            "lease_until_ms": v.lease_until_ms, "expires_at_ms": v.expires_at_ms,
            "result": outcome_str(v.outcome), "response": bytes_json(&v.response),
        })
    };
    gate_call(&a.target, async |gate| gate.get(request).await, json).await
}

fn moving_json(m: Option<pb::SlotMove>) -> Value {
    m.map_or(Value::Null, |m| json!({ "slot": m.slot, "from_shard": m.from_shard, "to_shard": m.to_shard }))
}

fn shard_json(s: pb::ShardStats) -> Value {
    json!({
        "shard": s.shard, "slots": s.slots, "state": s.state, "mailbox_depth": s.mailbox_depth,
        "batches": s.batches, "commands": s.commands, "batch_len_mean": s.batch_len_mean,
        "commits": s.commits, "failures": s.failures, "reclaimed": s.reclaimed,
        "waiters": s.waiters, "records_pending": s.records_pending,
        "records_completed": s.records_completed,
        "last_error": if s.last_error.is_empty() { Value::Null } else { json!(s.last_error) },
    })
}

async fn status(target: AdminTarget) -> Answer {
    let answer = admin(&target).await?.shard_stats(admin_request(&target, pb::ShardStatsRequest {})?).await;
    Ok(answer
        .map(|r| {
            let r = r.into_inner();
            let shards: Vec<Value> = r.shards.into_iter().map(shard_json).collect();
            json!({ "shards": shards, "moving": moving_json(r.moving) })
        })
        .map_err(Refusal::of_status))
}

fn inspect_json(r: pb::InspectResponse) -> Value {
    let history: Vec<Value> = r
        .history
        .iter()
        .map(|e| json!({ "kind": transition_name(e.kind), "at_ms": e.at_ms, "token": e.token }))
        .collect();
    json!({
        "shard": r.shard, "state": state_name(r.state), "token": r.token, "attempt": r.attempt,
        "lease_until_ms": r.lease_until_ms, "expires_at_ms": r.expires_at_ms, "ttl_ms": r.ttl_ms,
        "fingerprint": bytes_json(&r.fingerprint), "result": outcome_name(r.outcome),
        "response": bytes_json(&r.response), "completed_at_ms": r.completed_at_ms,
        "history": history,
    })
}

async fn inspect(a: InspectArgs) -> Answer {
    let message =
        pb::InspectRequest { tenant: a.tenant.clone(), namespace: a.namespace.clone(), key: a.key.clone() };
    let answer = admin(&a.target).await?.inspect(admin_request(&a.target, message)?).await;
    Ok(answer.map(|r| inspect_json(r.into_inner())).map_err(Refusal::of_status))
}

/// What an operator does to a key's record.
#[derive(Clone, Copy)]
enum Removal {
    Release,
    Purge,
}

async fn remove(removal: Removal, a: AdminKeyArgs) -> Answer {
    let mut client = admin(&a.inspect.target).await?;
    let message = pb::AdminKeyRequest {
        tenant: a.inspect.tenant.clone(),
        namespace: a.inspect.namespace.clone(),
        key: a.inspect.key.clone(),
        reason: a.reason.clone(),
    };
    let request = admin_request(&a.inspect.target, message)?;
    let (verb, answer) = match removal {
        Removal::Release => ("release", client.force_release(request).await),
        Removal::Purge => ("purge", client.purge(request).await),
    };
    Ok(answer
        .map(|r| {
            let r = r.into_inner();
            json!({ "removed": true, "action": verb, "previous": state_name(r.previous), "token": r.token })
        })
        .map_err(Refusal::of_status))
}
