//! The server's configuration file: typed, with every default in one place, unknown keys
//! refused, and every problem reported at once.

use std::net::SocketAddr;
use std::path::Path;

use oncegate_core::{Problem, Problems, Tenant, Unit};
use oncegate_engine::EngineConfig;
use serde::{Deserialize, Serialize};

/// The whole configuration file (`config/oncegate.toml` documents every key).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The network front.
    pub server: ServerConfig,
    /// The shard engine and its request limits.
    pub engine: EngineConfig,
    /// Logging.
    pub log: LogConfig,
    /// The operator's service.
    pub admin: AdminConfig,
    /// Tenants and the SHA-256 of their bearer tokens. Empty: one `default` tenant, no
    /// authentication, loopback only.
    pub tenants: Vec<TenantConfig>,
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
    /// Concurrent HTTP/2 streams per connection.
    pub streams_per_connection_max: u32,
    /// A call that takes longer is cancelled; must exceed the longest wait.
    pub request_timeout_ms: u64,
    /// Calls served at once across all connections; more are refused with
    /// `RESOURCE_EXHAUSTED` (load shedding).
    pub requests_in_flight_max: usize,
    /// How often the health service looks at the shards' states.
    pub health_poll_ms: u64,
    /// After SIGTERM, how long in-flight calls (and watch streams) may run before their
    /// connections are closed.
    pub shutdown_grace_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            message_bytes_max: 256 * 1024,
            metadata_bytes_max: 16 * 1024,
            streams_per_connection_max: 1024,
            request_timeout_ms: 60_000,
            requests_in_flight_max: 16_384,
            health_poll_ms: 1_000,
            shutdown_grace_ms: 10_000,
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

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: LogFormat::Text, filter: "info".to_owned() }
    }
}

/// One tenant: its name and the SHA-256 (hex) of its bearer token, never the token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// 1 to 64 bytes of `[A-Za-z0-9._-]`.
    pub name: String,
    /// `oncegate hash-token` prints it.
    pub token_sha256: TokenSha256,
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

/// Lists the keys of `user` that `known` does not have, as dotted paths. `known` is the
/// default configuration serialised, so it holds every key the file may use.
fn unknown_keys(user: &toml::Table, known: &toml::Table, prefix: &str, out: &mut Vec<String>) {
    for (key, value) in user {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match known.get(key) {
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

impl Config {
    /// Reads a configuration file. Unknown keys are all reported together; a value of
    /// the wrong type is reported with its line.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Config, ConfigError> {
        let error = |problems| ConfigError { source_name: source_name.to_owned(), problems };
        let table: toml::Table = toml::from_str(text).map_err(|e| error(vec![e.to_string()]))?;
        let mut problems = Vec::new();
        let known = toml::Table::try_from(Config::default()).expect("the defaults serialise");
        unknown_keys(&table, &known, "", &mut problems);
        if let Some(toml::Value::Array(tenants)) = table.get("tenants") {
            let sample =
                toml::Table::try_from(TenantConfig { name: String::new(), token_sha256: TokenSha256::Unset })
                    .expect("a tenant serialises");
            for (i, tenant) in tenants.iter().enumerate() {
                if let toml::Value::Table(tenant) = tenant {
                    unknown_keys(tenant, &sample, &format!("tenants[{i}]"), &mut problems);
                }
            }
        }
        if !problems.is_empty() {
            return Err(error(problems));
        }
        toml::from_str(text).map_err(|e| error(vec![e.to_string().trim_end().to_owned()]))
    }

    /// Reads a configuration file from disk.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError { source_name: name.clone(), problems: vec![e.to_string()] })?;
        Config::from_toml(&text, &name)
    }

    /// Checks every setting and every relation between settings; returns all problems.
    pub fn check(&self) -> Result<(), Vec<Problem>> {
        let mut problems = Problems::default();
        if let Err(engine) = self.engine.check() {
            problems.extend_under("engine", engine);
        }
        self.check_server(&mut problems);
        self.check_credentials(&mut problems);
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
        problems.within(&field("health_poll_ms"), server.health_poll_ms, 10, 60_000, Unit::Ms);
        problems.within(&field("shutdown_grace_ms"), server.shutdown_grace_ms, 0, 600_000, Unit::Ms);
        if self.tenants.is_empty() && !server.listen.ip().is_loopback() {
            problems.push(Problem::new(
                "server.listen",
                format!(
                    "is {}, but no tenants are configured: without tenants oncegate runs one unauthenticated \
                     `default` tenant and listens on loopback only. Add a [[tenants]] entry with a name and the \
                     token_sha256 that `oncegate hash-token` prints for its token",
                    server.listen
                ),
            ));
        }
    }

    fn check_credentials(&self, problems: &mut Problems) {
        let mut names = std::collections::HashSet::new();
        let mut hashes = std::collections::HashSet::new();
        for (i, tenant) in self.tenants.iter().enumerate() {
            if let Err(e) = Tenant::new(&tenant.name) {
                problems.push(Problem::new(format!("tenants[{i}].name"), format!("is invalid: {e}")));
            }
            if !names.insert(tenant.name.as_str()) {
                problems.push(Problem::new(
                    format!("tenants[{i}].name"),
                    format!("is {:?}, which an earlier tenant already uses", tenant.name),
                ));
            }
            match tenant.token_sha256.hash() {
                None => problems.push(Problem::new(format!("tenants[{i}].token_sha256"), TOKEN_SHA256_RULE)),
                Some(hash) if !hashes.insert(*hash) => problems.push(Problem::new(
                    format!("tenants[{i}].token_sha256"),
                    "is the same as another tenant's",
                )),
                Some(_) => {}
            }
        }
        match &self.admin.token_sha256 {
            TokenSha256::Unset => {}
            TokenSha256::Malformed(_) => problems.push(Problem::new("admin.token_sha256", TOKEN_SHA256_RULE)),
            TokenSha256::Hash(hash) if hashes.contains(hash) => problems.push(Problem::new(
                "admin.token_sha256",
                "is the same as a tenant's; the admin token must be its own",
            )),
            TokenSha256::Hash(_) => {}
        }
    }
}
