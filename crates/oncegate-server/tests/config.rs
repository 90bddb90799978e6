//! Configuration: every file under `config/` loads and passes its checks; the documented
//! file holds exactly the defaults; problems are reported together.

use oncegate_engine::{SqliteConfig, StoreConfig};
use oncegate_server::Config;

fn config_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config")
}

#[test]
fn every_file_under_config_loads_and_checks() {
    let mut seen = 0;
    for entry in std::fs::read_dir(config_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let config = Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
        config.check().unwrap_or_else(|p| {
            panic!("{}: {}", path.display(), p.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
        });
        seen += 1;
    }
    assert!(seen >= 2, "config/ holds the documented file and an example");
}

#[test]
fn the_documented_file_is_exactly_the_defaults() {
    let documented = Config::load(&config_dir().join("oncegate.toml")).unwrap();
    assert_eq!(documented, Config::default(), "config/oncegate.toml must list the true defaults");
}

/// The Debian package's conffile is the documented file with every setting commented out
/// but the data directory, which is `/var/lib/oncegate`: the same defaults, and it cannot
/// drift from them.
#[test]
fn the_package_s_conffile_is_the_documented_file_commented_out() {
    let documented = std::fs::read_to_string(config_dir().join("oncegate.toml")).unwrap();
    let packaged = std::fs::read_to_string(config_dir().join("deb/oncegate.toml")).unwrap();
    let setting = |line: &str| {
        line.split_once(" = ").is_some_and(|(key, _)| {
            !key.is_empty() && key.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
    };
    let expected: Vec<String> = documented
        .lines()
        .skip_while(|line| line.starts_with('#'))
        .map(|line| match line {
            _ if line.starts_with("data_dir = ") => "data_dir = \"/var/lib/oncegate\"".to_owned(),
            _ if setting(line) => format!("# {line}"),
            _ => line.to_owned(),
        })
        .collect();
    let body: Vec<&str> = packaged.lines().skip_while(|line| line.starts_with('#')).collect();
    assert_eq!(body, expected, "regenerate config/deb/oncegate.toml from config/oncegate.toml");
    let config = Config::load(&config_dir().join("deb/oncegate.toml")).unwrap();
    let mut defaults = Config::default();
    defaults.engine.data_dir = "/var/lib/oncegate".into();
    assert_eq!(config, defaults);
}

#[test]
fn unknown_keys_are_all_reported_at_once() {
    let text = "
        colour = 1
        [server]
        listen = \"127.0.0.1:1\"
        listne = \"x\"
        [engine.limits]
        key_bytes = 3
        [[tenants]]
        name = \"a\"
        token = \"plain\"
    ";
    let error = Config::from_toml(text, "test").unwrap_err();
    assert_eq!(
        error.problems,
        [
            "colour: unknown key",
            "engine.limits.key_bytes: unknown key",
            "server.listne: unknown key",
            "tenants[0].token: unknown key"
        ]
    );
}

/// Keys whose default is unset are known keys all the same.
#[test]
fn optional_keys_load() {
    let text = "
        [store]
        kind = \"postgres\"
        postgres_url = \"host=db\"
        postgres_tls_ca_path = \"/etc/oncegate/ca.crt\"
    ";
    let config = Config::from_toml(text, "test").unwrap();
    let StoreConfig::Postgres(postgres) = config.store else { panic!("{:?}", config.store) };
    assert_eq!(postgres.postgres_tls_ca_path, Some("/etc/oncegate/ca.crt".into()));
}

/// `[store]` takes the keys of its kind, SQLite when `kind` is absent; a key of the
/// other kind is refused, naming it, unless it holds its default (files made from the
/// sample of earlier versions list every key).
#[test]
fn the_store_section_takes_the_keys_of_its_kind() {
    let sqlite = Config::from_toml("[store]\npage_cache_bytes_max = 8388608\n", "test").unwrap();
    assert_eq!(
        sqlite.store,
        StoreConfig::Sqlite(SqliteConfig { page_cache_bytes_max: 8 << 20, ..Default::default() })
    );
    let old_sample = "[store]\npostgres_url = \"\"\npostgres_pool_size = 16\n";
    assert_eq!(Config::from_toml(old_sample, "test").unwrap().store, StoreConfig::default());
    for (text, says) in [
        (
            "[store]\npostgres_pool_size = 32\n",
            "store.postgres_pool_size applies to kind = \"postgres\", and this store's kind is \"sqlite\"",
        ),
        (
            "[store]\nkind = \"postgres\"\npostgres_url = \"host=db\"\nwal_checkpoint_pages = 100\n",
            "store.wal_checkpoint_pages applies to kind = \"sqlite\", and this store's kind is \"postgres\"",
        ),
        (
            "[engine]\nshard_file_bytes_max = 1048576\n",
            "engine.shard_file_bytes_max: moved to [store] (store.shard_file_bytes_max)",
        ),
        ("[store]\nkind = \"log\"\n", "unknown variant"),
    ] {
        let error = Config::from_toml(text, "test").unwrap_err().to_string();
        assert!(error.contains(says), "{text:?}: {error}");
    }
}

#[test]
fn semantic_problems_are_all_reported_at_once() {
    let text = "
        [server]
        listen = \"0.0.0.0:50051\"
        request_timeout_ms = 10
        [engine]
        shards = 0
        [engine.limits]
        response_bytes_max = 2000000
    ";
    let config = Config::from_toml(text, "test").unwrap();
    let problems = config.check().unwrap_err();
    let joined = problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    for expected in [
        "engine.shards is 0",
        "engine.limits.response_bytes_max is 2000000",
        "server.request_timeout_ms is 10 ms",
        "no tenants are configured",
        "oncegate hash-token",
    ] {
        assert!(joined.contains(expected), "missing {expected:?} in:\n{joined}");
    }
}

#[test]
fn tenant_problems_name_the_entry() {
    let text = "
        [[tenants]]
        name = \"bad name\"
        token_sha256 = \"abc\"
        [[tenants]]
        name = \"ok\"
        token_sha256 = \"c695b42d79a2420ca858fe997c67cab0749a72f3875834c654113b9cb2219478\"
        [[tenants]]
        name = \"ok\"
        token_sha256 = \"c695b42d79a2420ca858fe997c67cab0749a72f3875834c654113b9cb2219478\"
    ";
    let problems = Config::from_toml(text, "test").unwrap().check().unwrap_err();
    let joined = problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    for expected in [
        "tenants[0].name",
        "tenants[0].token_sha256 must be 64 hex digits",
        "tenants[2].name is \"ok\", which an earlier tenant already uses",
        "tenants[2].token_sha256 is the same",
    ] {
        assert!(joined.contains(expected), "missing {expected:?} in:\n{joined}");
    }
}

#[test]
fn a_wrong_type_names_its_line() {
    let error = Config::from_toml("[engine]\nshards = \"two\"\n", "test").unwrap_err();
    assert!(error.to_string().contains("line 2"), "{error}");
}

/// A line toml cannot read is named by its number and column, never quoted: it may hold
/// the PostgreSQL password or a tenant's token, and the error reaches the terminal.
#[test]
fn a_malformed_line_is_named_without_quoting_its_secret() {
    let texts = [
        "[store]\npostgres_url = \"host=db password=pa\\ss\"\n",
        "[store]\npostgres_url = \"postgres://u:se\"cret@db/x\"\n",
        "[[tenants]]\nname = \"a\"\ntoken = \"tok-secret\" x\n",
        "[engine]\nshards = [1, \"tok-secret\"\n",
    ];
    for text in texts {
        let error = Config::from_toml(text, "test").unwrap_err().to_string();
        for secret in ["pa\\ss", "se\"cret", "tok-secret", "password"] {
            assert!(!error.contains(secret), "{secret:?} in: {error}");
        }
        assert!(error.contains("line "), "{error}");
    }
}

fn fields(text: &str) -> Vec<String> {
    match Config::from_toml(text, "test").unwrap().check() {
        Ok(()) => Vec::new(),
        Err(problems) => problems.into_iter().map(|p| p.field).collect(),
    }
}

const ONE_TENANT: &str = "
    [[tenants]]
    name = \"acme\"
    token_sha256 = \"c695b42d79a2420ca858fe997c67cab0749a72f3875834c654113b9cb2219478\"
";

#[test]
fn tenants_off_loopback_need_tls_or_plaintext_allowed_in_so_many_words() {
    let public = format!("[server]\nlisten = \"0.0.0.0:50051\"\n{ONE_TENANT}");
    assert_eq!(fields(&public), ["server.tls_cert_path"]);
    let allowed = public.replace("[server]\n", "[server]\nplaintext_allowed = true\n");
    assert_eq!(fields(&allowed), Vec::<String>::new());
    let tls = public.replace("[server]\n", "[server]\ntls_cert_path = \"s.crt\"\ntls_key_path = \"s.key\"\n");
    assert_eq!(fields(&tls), Vec::<String>::new());
    // An empty path (an unfilled template) is no TLS, everywhere.
    let empty = public.replace("[server]\n", "[server]\ntls_cert_path = \"\"\n");
    assert_eq!(fields(&empty), ["server.tls_cert_path"]);
    let loopback = format!("[server]\nlisten = \"127.0.0.1:50051\"\n{ONE_TENANT}");
    assert_eq!(fields(&loopback), Vec::<String>::new());
}

#[test]
fn tls_settings_come_as_a_set() {
    assert_eq!(fields("[server]\ntls_cert_path = \"s.crt\""), ["server.tls_key_path"]);
    assert_eq!(fields("[server]\ntls_key_path = \"s.key\""), ["server.tls_cert_path"]);
    assert_eq!(fields("[server]\ntls_client_ca_path = \"ca.crt\""), ["server.tls_client_ca_path"]);
    assert_eq!(fields("[server]\nhandshake_timeout_ms = 0"), ["server.handshake_timeout_ms"]);
    assert_eq!(
        fields("[server]\nconnections_max = 0\nconnections_per_peer_max = 1"),
        ["server.connections_max"]
    );
    assert_eq!(
        fields("[server]\nconnections_max = 10\nconnections_per_peer_max = 11"),
        ["server.connections_per_peer_max"]
    );
}

#[test]
fn tenant_limits_are_checked_naming_the_entry() {
    let limits = "requests_in_flight_max = 0\nwaiters_max = 2000000\nrequests_burst_max = 5\n";
    let text = format!("{ONE_TENANT}{limits}");
    assert_eq!(
        fields(&text),
        ["tenants[0].requests_in_flight_max", "tenants[0].waiters_max", "tenants[0].requests_burst_max"]
    );
    let over_server =
        format!("[server]\nrequests_in_flight_max = 10\n{ONE_TENANT}requests_in_flight_max = 11\n");
    assert_eq!(fields(&over_server), ["tenants[0].requests_in_flight_max"]);
    let slow_finishes = format!("{ONE_TENANT}requests_per_s = 100\nfinishes_per_s = 99\n");
    assert_eq!(fields(&slow_finishes), ["tenants[0].finishes_per_s"], "commits would fall behind grants");
    let unlimited = format!("{ONE_TENANT}requests_per_s = 100\nfinishes_per_s = 0\n");
    assert!(fields(&unlimited).is_empty(), "0 is no limit");
}
