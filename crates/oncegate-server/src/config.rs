//! The server's configuration file: typed, with every default in one place, unknown keys
//! refused, and every problem reported at once.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use oncegate_core::{Problem, Problems, Tenant, Unit};
use oncegate_engine::{EngineConfig, PostgresConfig, StoreConfig};
use serde::{Deserialize, Serialize};

/// The whole configuration file (`config/oncegate.toml` documents every key).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The network front.
    pub server: ServerConfig,
    /// The shard engine and its request limits.
    pub engine: EngineConfig,
    /// Where the records live: the data directory's SQLite files, or PostgreSQL.
    pub store: StoreConfig,
    /// Logging.
    pub log: LogConfig,
    /// Trace export.
    pub telemetry: TelemetryConfig,
    /// The operator's service.
    pub admin: AdminConfig,
    /// Tenants and the SHA-256 of their bearer tokens. Empty: one `default` tenant, no
    /// authentication, loopback only.
    pub tenants: Vec<TenantConfig>,
    /// The Idempotency-Key proxy's settings, read and checked by `oncegate proxy`
    /// (`oncegate_proxy::ProxyFile`); the server does not use them.
    #[serde(skip_serializing_if = "toml::Table::is_empty")]
    pub proxy: toml::Table,
}

/// The SHA-256 of a bearer token, parsed once from its 64 hex digits when the file is
/// read. What does not parse is kept as written, so that `Config::check` reports it with
/// every other problem.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TokenSha256 {
    /// Not set (an empty string in the file).
    #[default]
    Unset,
    /// A well-formed hash.
    Hash([u8; 32]),
    /// Anything else, as written.
    Malformed(String),
}

impl TokenSha256 {
    /// Parses 64 hex digits (either case); empty is `Unset`.
    pub fn parse(text: &str) -> TokenSha256 {
        let mut hash = [0u8; 32];
        match text {
            "" => TokenSha256::Unset,
            _ if hex::decode_to_slice(text, &mut hash).is_ok() => TokenSha256::Hash(hash),
            _ => TokenSha256::Malformed(text.to_owned()),
        }
    }

    /// The hash, when well-formed.
    pub fn hash(&self) -> Option<&[u8; 32]> {
        match self {
            TokenSha256::Hash(hash) => Some(hash),
            TokenSha256::Unset | TokenSha256::Malformed(_) => None,
        }
    }
}

impl std::fmt::Display for TokenSha256 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSha256::Unset => Ok(()),
            TokenSha256::Hash(hash) => f.write_str(&hex::encode(hash)),
            TokenSha256::Malformed(text) => f.write_str(text),
        }
    }
}

impl Serialize for TokenSha256 {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TokenSha256 {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(TokenSha256::parse(&String::deserialize(deserializer)?))
    }
}

const TOKEN_SHA256_RULE: &str =
    "must be 64 hex digits (the SHA-256 of the token, as `oncegate hash-token` prints it)";

/// The `Admin` service's credentials.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// The SHA-256 (hex) of the admin bearer token. Empty: the admin service is open when
    /// no tenants are configured (loopback only), and refuses every call otherwise.
    pub token_sha256: TokenSha256,
}

/// Settings of the gRPC listener.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// The address to listen on.
    pub listen: SocketAddr,
    /// The largest request or response message, in bytes (decoded).
    pub message_bytes_max: usize,
    /// The largest header (metadata) list of a request, in bytes.
    pub metadata_bytes_max: u32,
    /// Concurrent HTTP/2 streams per connection (unary calls and `Session` streams
    /// alike); a client asking for more waits for one to end.
    pub streams_per_connection_max: u32,
    /// A call that takes longer is cancelled; must exceed the longest wait.
    pub request_timeout_ms: u64,
    /// Calls served at once across all connections; more are refused with
    /// `RESOURCE_EXHAUSTED` (load shedding).
    pub requests_in_flight_max: usize,
    /// Calls in flight on one `Session` stream, an answer not yet sent counted with its
    /// call; the server reads no further request of the stream until an answer goes out
    /// (backpressure: what a stream holds is bounded by this, whatever its client does).
    pub session_calls_in_flight_max: usize,
    /// Bytes of a `Session` stream's answers made and not yet handed to the transport
    /// (its client reads slowly, or not at all); past it the stream starts no new call
    /// until answers drain. The calls already in flight still finish, so a stream holds
    /// at most this plus the answers of its calls in flight.
    pub session_unsent_bytes_max: usize,
    /// How often the health service looks at the shards' states.
    pub health_poll_ms: u64,
    /// After SIGTERM, how long in-flight calls (and watch streams) may run before their
    /// connections are closed.
    pub shutdown_grace_ms: u64,
    /// Open connections; a connection past it is closed as soon as it is accepted.
    pub connections_max: usize,
    /// The listener of `/metrics`, `/healthz` and `/readyz`, kept off the gRPC port
    /// because the metrics name every tenant and its traffic.
    pub metrics_listen: SocketAddr,
    /// Open connections to the metrics listener; one more is closed as soon as it is
    /// accepted. Its connections have the gRPC port's `handshake_timeout_ms` and
    /// `idle_timeout_ms`.
    pub metrics_connections_max: usize,
    /// The server's certificate chain (PEM); with `tls_key_path`, the gRPC port speaks
    /// TLS only.
    pub tls_cert_path: Option<PathBuf>,
    /// The private key of `tls_cert_path` (PEM).
    pub tls_key_path: Option<PathBuf>,
    /// CA certificates (PEM) that must have signed every client's certificate (mutual
    /// TLS); unset, clients present none.
    pub tls_client_ca_path: Option<PathBuf>,
    /// A new connection must send its first complete request head (its TLS handshake and
    /// HTTP/2 preface included) within this; otherwise it is closed, so that silent or
    /// slow sockets cannot hold connection slots.
    pub handshake_timeout_ms: u64,
    /// A connection that has carried no request for this long is closed; 0 keeps idle
    /// connections open (HTTP/2 pings alone do not count as requests).
    pub idle_timeout_ms: u64,
    /// A connection is closed once an answer's data has waited this long for the peer
    /// to read any of it (a `Session`, Admin or HTTP/JSON answer: a unary `Gate` call's
    /// answer is not counted once ready); 0 waits for ever.
    pub send_timeout_ms: u64,
    /// A connection older than this is asked to go (HTTP/2 GOAWAY: the client opens
    /// another), and closed `connection_age_grace_ms` later; 0 sets no age limit.
    pub connection_age_max_ms: u64,
    /// How long the requests of a connection past its age may still run.
    pub connection_age_grace_ms: u64,
    /// Open connections from one peer (an IPv4 address, or an IPv6 /64 network); one
    /// more is closed as soon as it is accepted, so that no single host can take every
    /// connection slot.
    pub connections_per_peer_max: usize,
    /// How often an HTTP/2 keepalive ping goes to a connection; 0 sends none.
    pub keepalive_interval_ms: u64,
    /// A connection whose peer does not answer a keepalive ping within this is closed:
    /// a crashed client's half-open connection gives its slot back.
    pub keepalive_timeout_ms: u64,
    /// Serve tenants in plaintext on a non-loopback address (their bearer tokens then
    /// cross the network readable); only behind something that encrypts the hop.
    pub plaintext_allowed: bool,
}

impl ServerConfig {
    /// The deadlines of a connection to the gRPC port or the metrics listener.
    pub fn connection_deadlines(&self) -> oncegate_listen::activity::Limits {
        use oncegate_listen::activity::{Limits, Timeout};
        let within = std::time::Duration::from_millis(self.handshake_timeout_ms);
        Limits {
            request_head: Timeout { within, setting: "server.handshake_timeout_ms" },
            idle: Timeout::ms(self.idle_timeout_ms, "server.idle_timeout_ms"),
            send: Timeout::ms(self.send_timeout_ms, "server.send_timeout_ms"),
        }
    }

    /// Whether the gRPC port speaks TLS.
    pub fn tls_enabled(&self) -> bool {
        self.tls_files().is_some()
    }

    /// The certificate and key, when both are set: the one test of "TLS is configured"
    /// that the checks and the listener share. An empty path counts as unset.
    pub fn tls_files(&self) -> Option<(&Path, &Path)> {
        Some((set(&self.tls_cert_path)?, set(&self.tls_key_path)?))
    }

    /// The client CA, when set (and not empty).
    pub fn tls_client_ca(&self) -> Option<&Path> {
        set(&self.tls_client_ca_path)
    }
}

/// A path setting, unless unset or empty (as an unfilled template leaves it).
fn set(path: &Option<PathBuf>) -> Option<&Path> {
    path.as_deref().filter(|p| !p.as_os_str().is_empty())
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            message_bytes_max: 256 * 1024,
            metadata_bytes_max: 16 * 1024,
            streams_per_connection_max: 100,
            request_timeout_ms: 60_000,
            requests_in_flight_max: 16_384,
            session_calls_in_flight_max: 256,
            session_unsent_bytes_max: 1 << 20,
            health_poll_ms: 1_000,
            shutdown_grace_ms: 10_000,
            connections_max: 4_096,
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            metrics_connections_max: 64,
            tls_cert_path: None,
            tls_key_path: None,
            tls_client_ca_path: None,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 300_000,
            send_timeout_ms: 60_000,
            connection_age_max_ms: 0,
            connection_age_grace_ms: 10_000,
            connections_per_peer_max: 256,
            keepalive_interval_ms: 30_000,
            keepalive_timeout_ms: 20_000,
            plaintext_allowed: false,
        }
    }
}

/// How logs are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Logging settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Text or JSON lines.
    pub format: LogFormat,
    /// A `tracing` env-filter directive, such as `info` or `oncegate=debug`; `RUST_LOG`
    /// overrides it.
    pub filter: String,
}

/// Where traces go (`[telemetry]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The OTLP/gRPC endpoint the request and batch spans are exported to, such as
    /// `http://collector:4317`. Unset: `OTEL_EXPORTER_OTLP_ENDPOINT`; neither: no export,
    /// and no cost.
    pub otlp_endpoint: Option<String>,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: LogFormat::Text, filter: "info".to_owned() }
    }
}

/// A tenant's default `finishes_per_s` as a multiple of its `requests_per_s`: a grant's
/// commit or release and a few heartbeats, with room to spare.
const FINISHES_PER_REQUEST: u32 = 10;

/// One tenant: its name, the SHA-256 (hex) of its bearer token (never the token), and
/// the limits that keep it from taking what all tenants share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantConfig {
    /// 1 to 64 bytes of `[A-Za-z0-9._-]`.
    pub name: String,
    /// `oncegate hash-token` prints it.
    pub token_sha256: TokenSha256,
    /// The tenant's reserves and gets served at once; more are refused with
    /// `resource_exhausted`. Heartbeats, commits and releases are not counted: they keep
    /// or end work already admitted.
    pub requests_in_flight_max: usize,
    /// The tenant's reserves that may wait (`wait_ms > 0`) at once. The tenants' sum may
    /// exceed what the shards hold (`engine.waiters_per_shard_max` each), as their
    /// in-flight limits may exceed the server's: tenants rarely wait all at once, and the
    /// shards' own limit still refuses a waiter past it, naming it. This limit keeps one
    /// tenant from taking every shard's waiting places.
    pub waiters_max: usize,
    /// The tenant's `Session` streams open at once; one more is refused with
    /// `resource_exhausted`.
    pub sessions_max: usize,
    /// Reserves and gets per second, refilled evenly; 0 sets no rate limit.
    pub requests_per_s: u32,
    /// Requests admitted at once after a quiet spell; 0 means one second's worth.
    pub requests_burst_max: u32,
    /// Finishes per second: heartbeats, and commits with releases, each counted apart
    /// (the calls that keep or end a grant, each a durable write). Unset, ten times
    /// `requests_per_s` (so no limit when that is 0); 0 sets no limit; never below
    /// `requests_per_s`. At least one second's worth, and the request burst, are admitted
    /// at once. Size it for the tenant's leases held at once times three over the lease
    /// in seconds (the clients heartbeat three times a lease): a heartbeat refused for a
    /// whole lease lets it lapse, and the work may be granted again.
    pub finishes_per_s: Option<u32>,
    /// Records the tenant may have stored on each shard (expired ones not yet reclaimed
    /// included); a reserve of a new key past it is refused. 0 sets no quota.
    pub records_per_shard_max: u64,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            name: String::new(),
            token_sha256: TokenSha256::Unset,
            requests_in_flight_max: 1_024,
            waiters_max: 256,
            sessions_max: 16,
            requests_per_s: 0,
            requests_burst_max: 0,
            finishes_per_s: None,
            records_per_shard_max: 0,
        }
    }
}

impl TenantConfig {
    /// The burst the rate limiter allows.
    pub fn burst(&self) -> u32 {
        if self.requests_burst_max == 0 { self.requests_per_s } else { self.requests_burst_max }
    }

    /// The heartbeats, and the commits with releases, admitted per second: as set, or
    /// ten times the request rate; 0 is no limit.
    pub(crate) fn finishes_rate(&self) -> u32 {
        self.finishes_per_s.unwrap_or(self.requests_per_s.saturating_mul(FINISHES_PER_REQUEST))
    }

    /// How many finishes are admitted at once: a second's worth, or the request burst
    /// when that is larger (a burst of grants may all commit at once).
    pub(crate) fn finishes_burst(&self) -> u32 {
        self.finishes_rate().max(self.burst())
    }
}

/// A configured tenant whose name and token hash are valid: what authentication and the
/// per-tenant limits are built from, once `Config::check` has passed.
#[derive(Clone, Debug)]
pub struct TenantEntry {
    /// Its name.
    pub tenant: Tenant,
    /// The SHA-256 of its bearer token.
    pub token_sha256: [u8; 32],
    /// Its limits, as configured.
    pub config: TenantConfig,
}

/// Why a configuration was refused; every problem found, one per line.
#[derive(Debug, thiserror::Error)]
#[error("configuration {}:\n  {}", .source_name, .problems.join("\n  "))]
pub struct ConfigError {
    /// The file, or "defaults".
    pub source_name: String,
    /// Every problem, each naming the key.
    pub problems: Vec<String>,
}

/// SQLite's settings, which `[engine]` held before `[store]` had a section per kind.
const MOVED_TO_STORE: [&str; 3] =
    ["engine.shard_file_bytes_max", "engine.page_cache_bytes_max", "engine.wal_checkpoint_pages"];

/// Lists the keys of `user` that `known` does not have, as dotted paths. `known` is the
/// default configuration serialised, so it holds every key the file may use.
fn unknown_keys(user: &toml::Table, known: &toml::Table, prefix: &str, out: &mut Vec<String>) {
    for (key, value) in user {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match known.get(key) {
            None if MOVED_TO_STORE.contains(&path.as_str()) => {
                out.push(format!("{path}: moved to [store] (store.{key})"));
            }
            None => out.push(format!("{path}: unknown key")),
            Some(toml::Value::Table(inner)) => {
                if let toml::Value::Table(user_inner) = value {
                    unknown_keys(user_inner, inner, &path, out);
                }
            }
            Some(_) => {}
        }
    }
}

/// A TOML error as its line, column and message, without the text of the line: toml's
/// own rendering quotes the line, which may hold a secret (a tenant's token, the
/// PostgreSQL URL's password), and the error goes to the terminal and the logs.
fn toml_problem(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim_end();
    match error.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |at| at + 1) + 1;
            format!("line {line}, column {column}: {message}")
        }
        None => message.to_owned(),
    }
}

impl Config {
    /// Reads a configuration file. Unknown keys are all reported together; a value of
    /// the wrong type is reported with its line.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Config, ConfigError> {
        let error = |problems| ConfigError { source_name: source_name.to_owned(), problems };
        let table: toml::Table = toml::from_str(text).map_err(|e| error(vec![toml_problem(text, &e)]))?;
        let mut problems = Vec::new();
        // Optional keys are absent from the serialised defaults, so the sample sets them.
        let mut sample = Config::default();
        sample.server.tls_cert_path = Some(PathBuf::new());
        sample.server.tls_key_path = Some(PathBuf::new());
        sample.server.tls_client_ca_path = Some(PathBuf::new());
        let mut known = toml::Table::try_from(sample).expect("the defaults serialise");
        // `[store]` holds the keys of either kind.
        let postgres =
            PostgresConfig { postgres_tls_ca_path: Some(PathBuf::new()), ..PostgresConfig::default() };
        let postgres =
            toml::Table::try_from(StoreConfig::Postgres(postgres)).expect("the defaults serialise");
        if let Some(toml::Value::Table(store)) = known.get_mut("store") {
            store.extend(postgres);
        }
        let mut checked = table.clone();
        // `oncegate proxy` checks its own section.
        checked.remove("proxy");
        unknown_keys(&checked, &known, "", &mut problems);
        if let Some(toml::Value::Array(tenants)) = table.get("tenants") {
            // Its optional keys set, so that the sample names them.
            let every = TenantConfig { finishes_per_s: Some(0), ..TenantConfig::default() };
            let sample = toml::Table::try_from(every).expect("a tenant serialises");
            for (i, tenant) in tenants.iter().enumerate() {
                if let toml::Value::Table(tenant) = tenant {
                    unknown_keys(tenant, &sample, &format!("tenants[{i}]"), &mut problems);
                }
            }
        }
        if !problems.is_empty() {
            return Err(error(problems));
        }
        toml::from_str(text).map_err(|e| error(vec![toml_problem(text, &e)]))
    }

    /// Reads a configuration file from disk.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError { source_name: name.clone(), problems: vec![e.to_string()] })?;
        Config::from_toml(&text, &name)
    }

    /// The engine's configuration with the `[store]` section in it: what `Engine::open`
    /// takes.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig { store: self.store.clone(), ..self.engine.clone() }
    }

    /// Checks every setting and every relation between settings; returns all problems.
    pub fn check(&self) -> Result<(), Vec<Problem>> {
        self.check_serving_on(self.server.listen)
    }

    /// [`Config::check`] for a server whose gRPC listener is bound to `listen`, which may
    /// differ from `server.listen` (port 0, or a listener the embedding program bound):
    /// the exposure rules look at the address that really serves.
    pub fn check_serving_on(&self, listen: SocketAddr) -> Result<(), Vec<Problem>> {
        let mut problems = Problems::default();
        // The store is its own section: checked once, under its own name.
        let engine = EngineConfig { store: StoreConfig::default(), ..self.engine.clone() };
        if let Err(engine) = engine.check() {
            problems.extend_under("engine", engine);
        }
        if let Err(store) = self.store.check(self.engine.shards) {
            problems.extend_under("store", store);
        }
        self.check_server(&mut problems);
        self.check_exposure(listen, &mut problems);
        if let Err(tenants) = self.tenant_entries() {
            problems.extend(tenants);
        }
        self.check_admin(&mut problems);
        if let Some(endpoint) = &self.telemetry.otlp_endpoint
            && !endpoint.starts_with("http://")
        {
            problems.push(Problem::new(
                "telemetry.otlp_endpoint",
                format!("is {endpoint:?}; it needs http:// (this build exports without TLS)"),
            ));
        }
        problems.into_result()
    }

    fn check_server(&self, problems: &mut Problems) {
        let server = &self.server;
        let field = |name: &str| format!("server.{name}");
        // A commit carries the response plus key, namespace and a few numbers.
        let message_min = self.engine.limits.response_bytes_max as u64 + 4 * 1024;
        let message_why = " (engine.limits.response_bytes_max plus 4 KiB)";
        let message = server.message_bytes_max as u64;
        problems.within_because(
            &field("message_bytes_max"),
            message,
            message_min,
            64 << 20,
            Unit::Bytes,
            message_why,
        );
        let metadata = u64::from(server.metadata_bytes_max);
        problems.within(&field("metadata_bytes_max"), metadata, 1024, 1 << 20, Unit::Bytes);
        let streams = u64::from(server.streams_per_connection_max);
        problems.within(&field("streams_per_connection_max"), streams, 1, 65_536, Unit::Count);
        let timeout_min = self.engine.limits.wait_ms_max + 1_000;
        let timeout_why = " (engine.limits.wait_ms_max plus 1 s)";
        let timeout = server.request_timeout_ms;
        problems.within_because(
            &field("request_timeout_ms"),
            timeout,
            timeout_min,
            3_600_000,
            Unit::Ms,
            timeout_why,
        );
        let in_flight = server.requests_in_flight_max as u64;
        problems.within(&field("requests_in_flight_max"), in_flight, 1, 1 << 20, Unit::Count);
        let session = server.session_calls_in_flight_max as u64;
        problems.within(&field("session_calls_in_flight_max"), session, 1, 65_536, Unit::Count);
        let unsent = server.session_unsent_bytes_max as u64;
        problems.within(&field("session_unsent_bytes_max"), unsent, 4 << 10, 1 << 30, Unit::Bytes);
        problems.within(&field("health_poll_ms"), server.health_poll_ms, 10, 60_000, Unit::Ms);
        problems.within(&field("shutdown_grace_ms"), server.shutdown_grace_ms, 0, 600_000, Unit::Ms);
        problems.within(&field("connections_max"), server.connections_max as u64, 1, 1 << 20, Unit::Count);
        let metrics_connections = server.metrics_connections_max as u64;
        problems.within(&field("metrics_connections_max"), metrics_connections, 1, 65_536, Unit::Count);
        let handshake = server.handshake_timeout_ms;
        problems.within(&field("handshake_timeout_ms"), handshake, 100, 60_000, Unit::Ms);
        problems.within(&field("idle_timeout_ms"), server.idle_timeout_ms, 0, 86_400_000, Unit::Ms);
        problems.within(&field("send_timeout_ms"), server.send_timeout_ms, 0, 86_400_000, Unit::Ms);
        let age = server.connection_age_max_ms;
        problems.within(&field("connection_age_max_ms"), age, 0, 30 * 86_400_000, Unit::Ms);
        let grace = server.connection_age_grace_ms;
        problems.within(&field("connection_age_grace_ms"), grace, 0, 3_600_000, Unit::Ms);
        // One peer may have every connection, never more.
        let per_peer = server.connections_per_peer_max as u64;
        let connections = (server.connections_max as u64).max(1);
        problems.within(&field("connections_per_peer_max"), per_peer, 1, connections, Unit::Count);
        problems.within(
            &field("keepalive_interval_ms"),
            server.keepalive_interval_ms,
            0,
            3_600_000,
            Unit::Ms,
        );
        problems.within(
            &field("keepalive_timeout_ms"),
            server.keepalive_timeout_ms,
            1_000,
            600_000,
            Unit::Ms,
        );
        self.check_tls_paths(problems);
    }

    /// The TLS keys come as a set: a certificate needs its key, and a client CA needs
    /// the server to speak TLS at all.
    fn check_tls_paths(&self, problems: &mut Problems) {
        let server = &self.server;
        match (set(&server.tls_cert_path).is_some(), set(&server.tls_key_path).is_some()) {
            (true, false) => problems.push(Problem::new(
                "server.tls_key_path",
                "is not set, but server.tls_cert_path is; TLS needs the certificate's private key",
            )),
            (false, true) => problems.push(Problem::new(
                "server.tls_cert_path",
                "is not set, but server.tls_key_path is; TLS needs the certificate the key belongs to",
            )),
            _ => {}
        }
        if server.tls_client_ca().is_some() && !server.tls_enabled() {
            problems.push(Problem::new(
                "server.tls_client_ca_path",
                "is set, but server.tls_cert_path is not; client certificates are checked only over TLS",
            ));
        }
    }

    /// Who may reach the gRPC port, and how: without tenants, loopback only; with
    /// tenants on another address, TLS unless plaintext is allowed explicitly.
    fn check_exposure(&self, listen: SocketAddr, problems: &mut Problems) {
        let server = &self.server;
        if listen.ip().is_loopback() {
            return;
        }
        if self.tenants.is_empty() {
            problems.push(Problem::new(
                "server.listen",
                format!(
                    "is {listen}, but no tenants are configured: without tenants oncegate runs one unauthenticated \
                     `default` tenant and listens on loopback only. Add a [[tenants]] entry with a name and the \
                     token_sha256 that `oncegate hash-token` prints for its token"
                ),
            ));
        } else if !server.tls_enabled() && !server.plaintext_allowed {
            problems.push(Problem::new(
                "server.tls_cert_path",
                format!(
                    "is not set, and server.listen is {listen}: tenants' bearer tokens would cross the network in \
                     plaintext. Set server.tls_cert_path and server.tls_key_path (docs/operations.md shows how to \
                     make them), or set server.plaintext_allowed = true when something else encrypts the hop"
                ),
            ));
        }
    }

    /// The configured tenants with their names and token hashes parsed, or every problem
    /// with them: the one place tenant entries are validated.
    pub fn tenant_entries(&self) -> Result<Vec<TenantEntry>, Vec<Problem>> {
        let mut problems = Problems::default();
        let mut names = std::collections::HashSet::new();
        let mut hashes = std::collections::HashSet::new();
        let mut entries = Vec::with_capacity(self.tenants.len());
        for (i, config) in self.tenants.iter().enumerate() {
            let field = |name: &str| format!("tenants[{i}].{name}");
            let tenant = Tenant::new(&config.name)
                .map_err(|e| problems.push(Problem::new(field("name"), format!("is invalid: {e}"))))
                .ok();
            if !names.insert(config.name.as_str()) {
                problems.push(Problem::new(
                    field("name"),
                    format!("is {:?}, which an earlier tenant already uses", config.name),
                ));
            }
            let hash = match config.token_sha256.hash() {
                None => {
                    problems.push(Problem::new(field("token_sha256"), TOKEN_SHA256_RULE));
                    None
                }
                Some(hash) if !hashes.insert(*hash) => {
                    problems.push(Problem::new(field("token_sha256"), "is the same as another tenant's"));
                    None
                }
                Some(hash) => Some(*hash),
            };
            self.check_tenant_limits(config, &field, &mut problems);
            if let (Some(tenant), Some(token_sha256)) = (tenant, hash) {
                entries.push(TenantEntry { tenant, token_sha256, config: config.clone() });
            }
        }
        problems.into_result().map(|()| entries)
    }

    fn check_tenant_limits(
        &self,
        config: &TenantConfig,
        field: &dyn Fn(&str) -> String,
        problems: &mut Problems,
    ) {
        // A tenant may have the whole server's in-flight limit, never more.
        let server_in_flight = (self.server.requests_in_flight_max as u64).max(1);
        let in_flight = config.requests_in_flight_max as u64;
        problems.within(&field("requests_in_flight_max"), in_flight, 1, server_in_flight, Unit::Count);
        problems.within(&field("waiters_max"), config.waiters_max as u64, 0, 1 << 20, Unit::Count);
        problems.within(&field("sessions_max"), config.sessions_max as u64, 1, 65_536, Unit::Count);
        problems.within(
            &field("requests_per_s"),
            u64::from(config.requests_per_s),
            0,
            10_000_000,
            Unit::Count,
        );
        problems.within(
            &field("requests_burst_max"),
            u64::from(config.requests_burst_max),
            0,
            10_000_000,
            Unit::Count,
        );
        if let Some(finishes) = config.finishes_per_s {
            problems.within(&field("finishes_per_s"), u64::from(finishes), 0, 100_000_000, Unit::Count);
            if finishes != 0 && finishes < config.requests_per_s {
                problems.push(Problem::new(
                    field("finishes_per_s"),
                    "is below requests_per_s: grants would outpace their commits; set at least the request rate, or 0 for no limit",
                ));
            }
        }
        let records = config.records_per_shard_max;
        problems.within(&field("records_per_shard_max"), records, 0, 1 << 40, Unit::Count);
        if config.requests_per_s == 0 && config.requests_burst_max != 0 {
            problems.push(Problem::new(
                field("requests_burst_max"),
                "is set, but requests_per_s is 0 (no rate limit); set the rate the burst belongs to",
            ));
        }
    }

    fn check_admin(&self, problems: &mut Problems) {
        let tenant_hashes = || self.tenants.iter().filter_map(|t| t.token_sha256.hash());
        match &self.admin.token_sha256 {
            TokenSha256::Unset => {}
            TokenSha256::Malformed(_) => problems.push(Problem::new("admin.token_sha256", TOKEN_SHA256_RULE)),
            TokenSha256::Hash(hash) if tenant_hashes().any(|h| h == hash) => problems.push(Problem::new(
                "admin.token_sha256",
                "is the same as a tenant's; the admin token must be its own",
            )),
            TokenSha256::Hash(_) => {}
        }
    }
}
