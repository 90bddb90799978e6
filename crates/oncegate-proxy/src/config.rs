//! The proxy's settings: [`ProxyConfig`] as the library takes it, and [`ProxyFile`], the
//! `[proxy]` section of the configuration file, checked as a whole so that an operator
//! sees every problem at once, each naming its key.

use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use oncegate_core::{Problem, Problems, Unit};
use serde::Deserialize;

/// How the proxy guards, forwards and stores.
#[derive(Clone, Debug, PartialEq)]
pub struct ProxyConfig {
    /// The service behind the proxy, `http://host:port`.
    pub upstream: String,
    /// The gate's namespace for the proxy's keys.
    pub namespace: String,
    /// Methods whose requests are guarded.
    pub guarded_methods: Vec<Method>,
    /// The header that carries the key.
    pub key_header: HeaderName,
    /// Path prefixes whose guarded requests must carry a key (`400` without one).
    pub key_required_prefixes: Vec<String>,
    /// The header naming the caller's tenant; `None` scopes keys by a hash of the
    /// caller's `caller_headers` instead.
    pub tenant_header: Option<HeaderName>,
    /// The headers that tell callers apart (without `tenant_header`): their values,
    /// hashed together, are part of every key, so that one caller's key never answers
    /// another's request. Those the upstream authenticates by: `Authorization`, a cookie,
    /// an `X-Api-Key`.
    pub caller_headers: Vec<HeaderName>,
    /// Whether a guarded request carrying none of `caller_headers` is served, its key
    /// shared with every other such caller; otherwise it is refused with `400`.
    pub anonymous_callers_share_keys: bool,
    /// The longest key accepted, in bytes.
    pub key_bytes_max: usize,
    /// The most bytes of request headers (names and values) a guarded request may carry.
    pub headers_bytes_max: usize,
    /// The largest request body, in bytes (the fingerprint needs all of it).
    pub body_bytes_max: usize,
    /// The largest answer that is stored whole, in bytes (at least 256); a larger one goes
    /// whole to its caller and is stored without its body.
    pub stored_bytes_max: usize,
    /// How long a retry waits for the first request's answer before `409`.
    pub wait_ms: u64,
    /// How long the upstream may take; the key's lease is renewed meanwhile.
    pub upstream_timeout_ms: u64,
    /// How long a passed-through answer's body may pause between two of its frames
    /// before the proxy gives it up (the caller's connection is then closed).
    pub upstream_body_idle_ms: u64,
    /// How long a guarded request's body may take to arrive (`408` past it): the proxy
    /// reads it whole, for the fingerprint, before the key is reserved.
    pub body_read_timeout_ms: u64,
    /// Callers' connections open at once; one more is closed as soon as it is accepted.
    pub connections_max: usize,
    /// Guarded requests in flight at once, each holding up to `body_bytes_max` of its
    /// body and its answer (up to the larger of `body_bytes_max` and `stored_bytes_max`)
    /// until its answer is sent and its work is done (which outlives a caller that went
    /// away): one more is answered `503`.
    pub guarded_requests_max: usize,
    /// A caller's request head (its first, and each later one once it starts) must arrive
    /// within this; otherwise the connection is closed.
    pub header_read_timeout_ms: u64,
    /// A caller's connection that carries no request for this long is closed; 0 keeps
    /// idle connections.
    pub idle_timeout_ms: u64,
    /// A caller's connection is closed once an answer's data has waited this long for
    /// the caller to read any of it (a caller that stopped reading); 0 waits for ever.
    pub send_timeout_ms: u64,
    /// How long an answer is kept for replays.
    pub ttl_ms: u64,
    /// Request headers that are part of the payload (its fingerprint).
    pub fingerprint_headers: Vec<HeaderName>,
    /// Response headers stored and replayed with the body, every value of each. Never
    /// `set-cookie`, `content-length` or a hop-by-hop header: the
    /// file refuses them and the proxy skips them.
    pub stored_headers: Vec<HeaderName>,
    /// Which upstream statuses are stored (and replayed); the others release the key.
    pub stored_statuses: StoredStatuses,
    /// A `2xx` whose JSON body has this value at this pointer failed (a trading gateway's
    /// `{"success": false}`): released like a `5xx`.
    pub soft_failure: Option<(String, serde_json::Value)>,
    /// Where the key policy (retention, scope) is published: sent on every guarded
    /// answer as `Link: <...>; rel="describedby"`, as the draft asks resources to
    /// publish their expiry policy.
    pub key_policy_url: Option<HeaderValue>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            upstream: "http://127.0.0.1:9000".to_owned(),
            namespace: "proxy".to_owned(),
            guarded_methods: vec![Method::POST, Method::PATCH],
            key_header: HeaderName::from_static("idempotency-key"),
            key_required_prefixes: Vec::new(),
            tenant_header: None,
            caller_headers: vec![header::AUTHORIZATION],
            anonymous_callers_share_keys: false,
            key_bytes_max: 255,
            headers_bytes_max: 16 * 1024,
            body_bytes_max: 1 << 20,
            stored_bytes_max: 60 * 1024,
            wait_ms: 5_000,
            upstream_timeout_ms: 25_000,
            upstream_body_idle_ms: 25_000,
            body_read_timeout_ms: 10_000,
            connections_max: 1_024,
            guarded_requests_max: 256,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            send_timeout_ms: 60_000,
            ttl_ms: 86_400_000,
            fingerprint_headers: vec![header::CONTENT_TYPE],
            stored_headers: vec![header::CONTENT_TYPE, header::LOCATION],
            stored_statuses: StoredStatuses::default(),
            soft_failure: None,
            key_policy_url: None,
        }
    }
}

impl ProxyConfig {
    /// How long a stopped proxy lets its requests finish: the longest a guarded request
    /// can take (its body, a wait behind the same key, the upstream, and storing the
    /// answer), so that none is cut off after its upstream ran.
    pub fn shutdown_grace(&self) -> std::time::Duration {
        let ms = self.body_read_timeout_ms + self.wait_ms + self.upstream_timeout_ms + LEASE_MARGIN_MS;
        std::time::Duration::from_millis(ms)
    }
}

/// Which statuses are stored: whole classes (`2xx`), single statuses (`503`), and
/// exclusions (`!409`), which win.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredStatuses {
    classes: Vec<u16>,
    statuses: Vec<u16>,
    excluded: Vec<u16>,
}

impl Default for StoredStatuses {
    /// `2xx`, and `4xx` other than `408`, `409` and `429`: those say "try again", which a
    /// replay would contradict.
    fn default() -> Self {
        StoredStatuses { classes: vec![2, 4], statuses: Vec::new(), excluded: vec![408, 409, 429] }
    }
}

/// Why a `stored_statuses` list was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StatusRuleError {
    /// No entry: nothing would ever be replayed.
    #[error("is empty: no answer would be stored, and every retry would run again")]
    Empty,
    /// An entry that is none of the three forms.
    #[error("{0:?} is not a status (`503`), a class (`5xx`) or an exclusion (`!409`)")]
    Entry(String),
}

impl StoredStatuses {
    /// Reads `["2xx", "4xx", "!409", "503"]`; `Err` names the entry that is none of these.
    /// An empty list is refused: nothing would ever be replayed.
    pub fn parse(entries: &[String]) -> Result<StoredStatuses, StatusRuleError> {
        if entries.is_empty() {
            return Err(StatusRuleError::Empty);
        }
        let mut rule = StoredStatuses { classes: Vec::new(), statuses: Vec::new(), excluded: Vec::new() };
        for entry in entries {
            let bad = || StatusRuleError::Entry(entry.clone());
            let status = |text: &str| match text.as_bytes() {
                [b'1'..=b'5', b'0'..=b'9', b'0'..=b'9'] => text.parse::<u16>().map_err(|_| bad()),
                _ => Err(bad()),
            };
            match entry.as_bytes() {
                [class @ b'1'..=b'5', b'x', b'x'] => rule.classes.push(u16::from(class - b'0')),
                [b'!', ..] => rule.excluded.push(status(&entry[1..])?),
                _ => rule.statuses.push(status(entry)?),
            }
        }
        Ok(rule)
    }

    /// Whether an answer with `status` is stored.
    pub fn stores(&self, status: StatusCode) -> bool {
        let status = status.as_u16();
        !self.excluded.contains(&status)
            && (self.statuses.contains(&status) || self.classes.contains(&(status / 100)))
    }
}

/// The `[proxy]` section of the configuration file: every key optional, defaults as
/// [`ProxyConfig::default`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyFile {
    upstream: Option<String>,
    namespace: Option<String>,
    guarded_methods: Option<Vec<String>>,
    key_header: Option<String>,
    key_required_prefixes: Vec<String>,
    tenant_header: Option<String>,
    caller_headers: Option<Vec<String>>,
    anonymous_callers_share_keys: Option<bool>,
    key_bytes_max: Option<u64>,
    headers_bytes_max: Option<u64>,
    body_bytes_max: Option<u64>,
    stored_bytes_max: Option<u64>,
    wait_ms: Option<u64>,
    upstream_timeout_ms: Option<u64>,
    upstream_body_idle_ms: Option<u64>,
    body_read_timeout_ms: Option<u64>,
    connections_max: Option<u64>,
    guarded_requests_max: Option<u64>,
    header_read_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    send_timeout_ms: Option<u64>,
    ttl_ms: Option<u64>,
    fingerprint_headers: Option<Vec<String>>,
    stored_headers: Option<Vec<String>>,
    stored_statuses: Option<Vec<String>>,
    soft_failure: Option<SoftFailure>,
    key_policy_url: Option<String>,
}

/// `[proxy.soft_failure]`: `pointer = "/success"`, `equals = false`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SoftFailure {
    pointer: String,
    equals: serde_json::Value,
}

/// Bounds the file may set. A request body is held in memory while it runs.
const BYTES_CEILING: u64 = 64 << 20;
const MS_CEILING: u64 = 7 * 86_400_000;
/// What the key's lease adds to the upstream timeout: the time to store the answer.
pub(crate) const LEASE_MARGIN_MS: u64 = 5_000;
/// The lease (timeout plus margin) must fit a gate's default longest lease, an hour.
const UPSTREAM_TIMEOUT_MS_MAX: u64 = 3_600_000 - LEASE_MARGIN_MS;

impl ProxyFile {
    /// Reads the section from the file's `[proxy]` table.
    pub fn from_table(table: toml::Table) -> Result<ProxyFile, Vec<Problem>> {
        table.try_into().map_err(|e: toml::de::Error| vec![Problem::new("proxy", e.message().to_owned())])
    }

    /// The checked configuration, or every problem, each naming its `proxy.` key.
    pub fn into_config(self) -> Result<ProxyConfig, Vec<Problem>> {
        let mut config = ProxyConfig::default();
        let mut problems = Problems::default();
        self.check_sizes(&mut config, &mut problems);
        let mut parse = Parse { problems };
        self.parse_names(&mut config, &mut parse);
        parse.problems.into_result().map(|()| config)
    }

    /// The sizes and times, each within its bounds (a value out of them is reported and
    /// the default kept, so the other checks still run).
    fn check_sizes(&self, config: &mut ProxyConfig, problems: &mut Problems) {
        let mut within = |field: &str, value: Option<u64>, default: u64, min: u64, max: u64, unit| {
            let value = value.unwrap_or(default);
            problems.within(&format!("proxy.{field}"), value, min, max, unit);
            value
        };
        let bytes = |value: usize| value as u64;
        config.key_bytes_max =
            within("key_bytes_max", self.key_bytes_max, bytes(config.key_bytes_max), 1, 4_096, Unit::Bytes)
                as usize;
        config.headers_bytes_max = within(
            "headers_bytes_max",
            self.headers_bytes_max,
            bytes(config.headers_bytes_max),
            1_024,
            1 << 20,
            Unit::Bytes,
        ) as usize;
        config.body_bytes_max = within(
            "body_bytes_max",
            self.body_bytes_max,
            bytes(config.body_bytes_max),
            1,
            BYTES_CEILING,
            Unit::Bytes,
        ) as usize;
        // A stored answer is one gate record's response: it must fit the gate's limit,
        // and hold at least the status and warning stored for an answer too large.
        let stored_ceiling = oncegate_core::RESPONSE_BYTES_CEILING as u64;
        config.stored_bytes_max = within(
            "stored_bytes_max",
            self.stored_bytes_max,
            bytes(config.stored_bytes_max),
            256,
            stored_ceiling,
            Unit::Bytes,
        ) as usize;
        config.wait_ms = within("wait_ms", self.wait_ms, config.wait_ms, 0, 30_000, Unit::Ms);
        config.upstream_timeout_ms = within(
            "upstream_timeout_ms",
            self.upstream_timeout_ms,
            config.upstream_timeout_ms,
            1,
            UPSTREAM_TIMEOUT_MS_MAX,
            Unit::Ms,
        );
        config.ttl_ms = within("ttl_ms", self.ttl_ms, config.ttl_ms, 1_000, MS_CEILING, Unit::Ms);
        let idle = config.upstream_body_idle_ms;
        config.upstream_body_idle_ms =
            within("upstream_body_idle_ms", self.upstream_body_idle_ms, idle, 100, 3_600_000, Unit::Ms);
        let body = config.body_read_timeout_ms;
        config.body_read_timeout_ms =
            within("body_read_timeout_ms", self.body_read_timeout_ms, body, 100, 600_000, Unit::Ms);
        let connections = config.connections_max as u64;
        config.connections_max =
            within("connections_max", self.connections_max, connections, 1, 1 << 20, Unit::Count) as usize;
        let guarded = config.guarded_requests_max as u64;
        config.guarded_requests_max =
            within("guarded_requests_max", self.guarded_requests_max, guarded, 1, 1 << 20, Unit::Count)
                as usize;
        let head = config.header_read_timeout_ms;
        config.header_read_timeout_ms =
            within("header_read_timeout_ms", self.header_read_timeout_ms, head, 100, 600_000, Unit::Ms);
        let idle = config.idle_timeout_ms;
        config.idle_timeout_ms =
            within("idle_timeout_ms", self.idle_timeout_ms, idle, 0, 86_400_000, Unit::Ms);
        let send = config.send_timeout_ms;
        config.send_timeout_ms =
            within("send_timeout_ms", self.send_timeout_ms, send, 0, 86_400_000, Unit::Ms);
    }

    /// Everything written as text: the upstream, methods, header names, statuses, the
    /// soft-failure pointer and the policy link.
    fn parse_names(self, config: &mut ProxyConfig, parse: &mut Parse) {
        config.upstream = parse.upstream(self.upstream.unwrap_or_else(|| config.upstream.clone()));
        if let Some(namespace) = self.namespace {
            config.namespace = namespace;
        }
        if let Some(methods) = self.guarded_methods {
            config.guarded_methods =
                parse.all("guarded_methods", &methods, |m| Method::from_bytes(m.as_bytes()).ok());
        }
        if let Some(name) = self.key_header.and_then(|name| parse.one("key_header", &name, header_name)) {
            config.key_header = name;
        }
        config.key_required_prefixes = parse.all("key_required_prefixes", &self.key_required_prefixes, |p| {
            p.starts_with('/').then(|| p.to_owned())
        });
        config.tenant_header =
            self.tenant_header.and_then(|name| parse.one("tenant_header", &name, header_name));
        if let Some(names) = self.caller_headers {
            config.caller_headers = parse.all("caller_headers", &names, header_name);
        }
        config.anonymous_callers_share_keys =
            self.anonymous_callers_share_keys.unwrap_or(config.anonymous_callers_share_keys);
        if config.caller_headers.is_empty() && !config.anonymous_callers_share_keys {
            let detail = "is empty, so every guarded request would be refused: name the headers that tell \
                          callers apart, or set anonymous_callers_share_keys = true";
            parse.problems.push(Problem::new("proxy.caller_headers", detail.to_owned()));
        }
        if let Some(names) = self.fingerprint_headers {
            config.fingerprint_headers = parse.all("fingerprint_headers", &names, header_name);
        }
        if let Some(names) = self.stored_headers {
            config.stored_headers = parse.all("stored_headers", &names, header_name);
            for name in &config.stored_headers {
                if let Some(reason) = never_stored(name) {
                    parse.problems.push(Problem::new("proxy.stored_headers", format!("{name}: {reason}")));
                }
            }
        }
        if let Some(entries) = self.stored_statuses {
            match StoredStatuses::parse(&entries) {
                Ok(rule) => config.stored_statuses = rule,
                Err(problem) => {
                    parse.problems.push(Problem::new("proxy.stored_statuses", problem.to_string()))
                }
            }
        }
        config.soft_failure = self.soft_failure.and_then(|soft| {
            let pointer = parse.one("soft_failure.pointer", &soft.pointer, |p| {
                (p.is_empty() || p.starts_with('/')).then(|| p.to_owned())
            })?;
            Some((pointer, soft.equals))
        });
        config.key_policy_url = self.key_policy_url.and_then(|url| {
            parse.one("key_policy_url", &url, |u| {
                let absolute = u.parse::<axum::http::Uri>().is_ok_and(|uri| uri.scheme().is_some());
                absolute.then(|| HeaderValue::from_str(&format!("<{u}>; rel=\"describedby\"")).ok()).flatten()
            })
        });
    }
}

/// Why a response header is never stored, if it is not: a replay goes to whoever retries
/// the key, and its body is framed anew.
pub(crate) fn never_stored(name: &HeaderName) -> Option<&'static str> {
    if name == header::SET_COOKIE {
        Some("is never stored: a replay would hand the first caller's cookie to whoever retries the key")
    } else if name == header::CONTENT_LENGTH || crate::HOP_BY_HOP.contains(&name.as_str()) {
        Some("is never stored: it describes one response's framing, and a replay is framed anew")
    } else {
        None
    }
}

fn header_name(name: &str) -> Option<HeaderName> {
    HeaderName::from_bytes(name.as_bytes()).ok()
}

/// Parses fields, keeping every problem.
struct Parse {
    problems: Problems,
}

impl Parse {
    fn one<T>(&mut self, field: &str, value: &str, parse: impl Fn(&str) -> Option<T>) -> Option<T> {
        let parsed = parse(value);
        if parsed.is_none() {
            self.problems.push(Problem::new(format!("proxy.{field}"), format!("{value:?} does not parse")));
        }
        parsed
    }

    fn all<T>(&mut self, field: &str, values: &[String], parse: impl Fn(&str) -> Option<T>) -> Vec<T> {
        values.iter().filter_map(|value| self.one(field, value, &parse)).collect()
    }

    /// The upstream must be `http://host[:port]`, with no path: the request's own path
    /// and query are appended to it.
    fn upstream(&mut self, url: String) -> String {
        let url = url.trim_end_matches('/').to_owned();
        let fine = url.parse::<axum::http::Uri>().is_ok_and(|uri| {
            uri.scheme_str() == Some("http") && uri.authority().is_some() && uri.path() == "/"
        });
        if !fine {
            let detail = format!("{url:?} must be http://HOST[:PORT], without a path");
            self.problems.push(Problem::new("proxy.upstream", detail));
        }
        url
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Result<ProxyConfig, Vec<Problem>> {
        ProxyFile::from_table(toml::from_str(text).unwrap())?.into_config()
    }

    #[test]
    fn an_empty_section_is_the_defaults() {
        assert_eq!(file("").unwrap(), ProxyConfig::default());
    }

    #[test]
    fn every_key_is_read() {
        let config = file(
            r#"
            upstream = "http://10.0.0.5:8000/"
            guarded_methods = ["POST", "PUT"]
            tenant_header = "X-Tenant"
            stored_statuses = ["2xx", "503", "!204"]
            wait_ms = 1000
            key_policy_url = "https://example.com/idempotency"
            [soft_failure]
            pointer = "/success"
            equals = false
            "#,
        )
        .unwrap();
        assert_eq!(config.upstream, "http://10.0.0.5:8000");
        assert_eq!(config.guarded_methods, vec![Method::POST, Method::PUT]);
        assert_eq!(config.tenant_header, Some(HeaderName::from_static("x-tenant")));
        assert!(config.stored_statuses.stores(StatusCode::SERVICE_UNAVAILABLE));
        assert!(!config.stored_statuses.stores(StatusCode::NO_CONTENT));
        assert!(!config.stored_statuses.stores(StatusCode::NOT_FOUND));
        assert_eq!(config.soft_failure, Some(("/success".to_owned(), serde_json::json!(false))));
        assert_eq!(config.key_policy_url.unwrap(), "<https://example.com/idempotency>; rel=\"describedby\"");
    }

    #[test]
    fn every_problem_is_reported_at_once_naming_its_key() {
        let problems = file(
            r#"
            upstream = "https://x/y"
            key_bytes_max = 0
            guarded_methods = ["PO ST"]
            stored_statuses = ["2xx", "6xx"]
            key_required_prefixes = ["orders"]
            stored_headers = ["Location", "Set-Cookie", "Transfer-Encoding"]
            [soft_failure]
            pointer = "success"
            equals = false
            "#,
        )
        .unwrap_err();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "proxy.key_bytes_max",
                "proxy.upstream",
                "proxy.guarded_methods",
                "proxy.key_required_prefixes",
                "proxy.stored_headers",
                "proxy.stored_headers",
                "proxy.stored_statuses",
                "proxy.soft_failure.pointer"
            ]
        );
        let cookie = &problems[4].detail;
        assert!(cookie.starts_with("set-cookie: is never stored"), "{cookie}");
        assert!(file("retries = 3").unwrap_err()[0].detail.contains("unknown field `retries`"));
    }

    /// No caller headers would refuse every guarded request, unless anonymous callers may
    /// share keys, which makes an empty list mean "one key space".
    #[test]
    fn an_empty_caller_list_needs_anonymous_callers_to_share_keys() {
        let refused = file("caller_headers = []").unwrap_err();
        assert_eq!(refused[0].field, "proxy.caller_headers", "{refused:?}");
        let shared = file("caller_headers = []\nanonymous_callers_share_keys = true").unwrap();
        assert!(shared.caller_headers.is_empty() && shared.anonymous_callers_share_keys);
    }

    /// config/oncegate.toml's `[proxy]` section, uncommented, is the defaults (and so
    /// documents every key truly).
    #[test]
    fn the_documented_section_is_the_defaults() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/oncegate.toml"))
                .unwrap();
        let section: String = text
            .lines()
            .skip_while(|line| *line != "# [proxy]")
            .skip(1)
            .filter_map(|line| line.strip_prefix("# "))
            .filter(|line| !line.starts_with('#') && !line.starts_with('['))
            .map(|line| format!("{line}\n"))
            .collect();
        assert!(section.contains("upstream ="), "{section}");
        assert_eq!(file(&section).unwrap(), ProxyConfig::default());
    }

    #[test]
    fn the_default_statuses_store_2xx_and_4xx_but_the_try_again_ones() {
        let rule = StoredStatuses::default();
        for (status, stored) in [
            (200, true),
            (201, true),
            (404, true),
            (408, false),
            (409, false),
            (429, false),
            (500, false),
            (503, false),
            (302, false),
        ] {
            assert_eq!(rule.stores(StatusCode::from_u16(status).unwrap()), stored, "{status}");
        }
        let parsed =
            StoredStatuses::parse(&["2xx".into(), "4xx".into(), "!408".into(), "!409".into(), "!429".into()])
                .unwrap();
        assert_eq!(parsed, rule);
        for bad in
            [&[][..], &["+200".to_owned()], &["0200".to_owned()], &["999".to_owned()], &["!5xx".to_owned()]]
        {
            assert!(StoredStatuses::parse(bad).is_err(), "{bad:?}");
        }
    }
}
