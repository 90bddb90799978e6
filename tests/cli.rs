//! The built `oncegate` binary as a child process: `serve` on port 0, the client verbs
//! against it, authentication from a config file, SIGTERM keeping acknowledged data, and
//! the start-up refusal of a non-loopback address without tenants, and the verbs over TLS
//! and mutual TLS.

#[path = "../crates/oncegate-server/tests/common/certs.rs"]
mod certs;
mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{BIN, Server};
use serde_json::Value;

/// Runs the client verbs against a server.
trait Call {
    fn call(&self, args: &[&str]) -> (i32, Value);
    fn call_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, Value);
    /// A call that may fail before the server answers: its exit code and its JSON answer,
    /// if it printed one.
    fn call_quietly(&self, args: &[&str]) -> (i32, Option<Value>);
}

impl Call for Server {
    fn call_quietly(&self, args: &[&str]) -> (i32, Option<Value>) {
        let (verb, rest) = args.split_first().expect("a verb");
        let out = Command::new(BIN)
            .arg(verb)
            .args(["--addr", &self.addr, "--namespace", "live"])
            .args(rest)
            .output()
            .expect("client runs");
        let value = serde_json::from_slice(&out.stdout).ok();
        (out.status.code().expect("exit code"), value)
    }

    fn call(&self, args: &[&str]) -> (i32, Value) {
        self.call_with_env(args, &[])
    }

    fn call_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, Value) {
        let (verb, rest) = args.split_first().expect("a verb");
        let mut command = Command::new(BIN);
        command.arg(verb).args(["--addr", &self.addr, "--namespace", "live"]).args(rest);
        command.env_remove("ONCEGATE_TOKEN");
        for (k, v) in env {
            command.env(k, v);
        }
        let out = command.output().expect("client runs");
        let text = String::from_utf8(out.stdout).expect("utf-8");
        let value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        (out.status.code().expect("exit code"), value)
    }
}

/// Under systemd (`Type=notify`) the server says READY=1 once it accepts calls and
/// STOPPING=1 at SIGTERM, on the socket `NOTIFY_SOCKET` names.
#[test]
fn systemd_hears_ready_then_stopping() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    // A bound on waiting for each message, not a pause: recv returns when one comes.
    socket.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("NOTIFY_SOCKET", &socket_path)
        .env_remove("ONCEGATE_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut buffer = [0u8; 512];
    let mut next = || {
        let n = socket.recv(&mut buffer).expect("a notification");
        String::from_utf8_lossy(&buffer[..n]).into_owned()
    };
    let ready = std::iter::from_fn(|| Some(next())).find(|m| m.contains("READY=1")).unwrap();
    assert!(ready.contains("STATUS=serving; 2 of 2 shards serving"), "{ready}");
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let stopping = std::iter::from_fn(|| Some(next())).find(|m| m.contains("STOPPING=1"));
    assert!(stopping.is_some());
    assert!(child.wait().unwrap().success(), "a clean stop");
}

/// `--version` names the version, the commit and the stores the binary was built with.
#[test]
fn version_names_the_commit_and_the_stores() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let expected = format!("oncegate {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(line.starts_with(&expected), "{line}");
    assert!(line.trim_end().ends_with("stores sqlite,postgres)"), "{line}");
}

#[test]
fn client_verbs_walk_through_the_double_fill() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);

    let (code, first) = server.call(&["reserve", "fill-1"]);
    assert_eq!((code, first["outcome"].as_str()), (0, Some("granted")), "{first}");
    let token = first["token"].as_u64().unwrap().to_string();
    let (_, dup) = server.call(&["reserve", "fill-1"]);
    assert_eq!(dup["outcome"], "in_progress", "{dup}");
    let (code, committed) = server.call(&["commit", "fill-1", &token, "--response", "order A-77"]);
    assert_eq!((code, committed["committed"].as_bool()), (0, Some(true)), "{committed}");
    let (_, replay) = server.call(&["reserve", "fill-1"]);
    assert_eq!(
        (replay["outcome"].as_str(), replay["response"].as_str()),
        (Some("completed"), Some("order A-77"))
    );
    let (_, view) = server.call(&["get", "fill-1"]);
    assert_eq!(view["state"], "completed");

    let (code, refused) = server.call(&["release", "fill-1", &token]);
    assert_eq!(code, 1);
    assert_eq!(refused["error"]["code"], "already_completed", "{refused}");
    assert_eq!(refused["error"]["grpc"], "FAILED_PRECONDITION");

    let (_, other) = server.call(&["reserve", "other", "--lease-ms", "5000"]);
    let other_token = other["token"].as_u64().unwrap().to_string();
    let (code, beat) = server.call(&["heartbeat", "other", &other_token, "--lease-ms", "10000"]);
    assert_eq!(code, 0, "{beat}");
    assert!(beat["lease_until_ms"].as_u64().unwrap() > other["lease_until_ms"].as_u64().unwrap());
    let (code, released) = server.call(&["release", "other", &other_token]);
    assert_eq!((code, released["released"].as_bool()), (0, Some(true)));

    let (code, bad) = server.call(&["reserve", "--part", "a:b", "--bucket-ms", "1000"]);
    assert_eq!((code, bad["error"]["field"].as_str()), (1, Some("key_parts")), "{bad}");

    assert!(server.terminate(), "SIGTERM ends the server cleanly");

    // Acknowledged data survived the shutdown.
    let server = Server::start(dir.path(), &[]);
    let (_, view) = server.call(&["get", "fill-1"]);
    assert_eq!((view["state"].as_str(), view["response"].as_str()), (Some("completed"), Some("order A-77")));
    assert!(server.terminate());
}

#[test]
fn tenants_from_a_config_file_and_tokens_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let hash = |token: &str| {
        let out = Command::new(BIN).args(["hash-token", token]).output().unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let config = dir.path().join("oncegate.toml");
    std::fs::write(
        &config,
        format!(
            "[[tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n[[tenants]]\nname = \"globex\"\ntoken_sha256 = \"{}\"\n",
            hash("acme-secret"),
            hash("globex-secret")
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &["--config", config.to_str().unwrap()]);

    let (code, refused) = server.call(&["reserve", "k"]);
    assert_eq!((code, refused["error"]["code"].as_str()), (1, Some("unauthenticated")), "{refused}");
    let (_, acme) = server.call_with_env(&["reserve", "k"], &[("ONCEGATE_TOKEN", "acme-secret")]);
    assert_eq!(acme["outcome"], "granted", "{acme}");
    let token_file = dir.path().join("globex.token");
    std::fs::write(&token_file, "globex-secret\n").unwrap();
    let (_, globex) = server.call(&["reserve", "k", "--token-file", token_file.to_str().unwrap()]);
    assert_eq!(globex["outcome"], "granted", "another tenant's equal key is its own: {globex}");
    // A token on the command line is refused: `ps` would show it to every user.
    let out = Command::new(BIN)
        .args(["reserve", "k", "--addr", &server.addr, "--token", "globex-secret"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("set ONCEGATE_TOKEN or use --token-file"), "{stderr}");
    assert!(server.terminate());
}

#[test]
fn operator_verbs_status_inspect_and_admin() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .args(["--addr", &server.addr])
            .env_remove("ONCEGATE_ADMIN_TOKEN")
            .output()
            .unwrap();
        let value: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        (out.status.code().unwrap(), value)
    };
    let (code, status) = run(&["status"]);
    assert_eq!(code, 0, "{status}");
    let shards = status["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2, "every shard is listed: {status}");
    assert!(shards.iter().all(|s| s["state"] == "serving"));

    let (_, granted) = server.call(&["reserve", "stuck"]);
    let token = granted["token"].as_u64().unwrap();
    let (code, view) = run(&["inspect", "--namespace", "live", "stuck"]);
    assert_eq!(
        (code, view["state"].as_str(), view["token"].as_u64()),
        (0, Some("pending"), Some(token)),
        "{view}"
    );
    let (code, removed) =
        run(&["admin", "release", "--namespace", "live", "stuck", "--reason", "worker died"]);
    assert_eq!((code, removed["previous"].as_str()), (0, Some("pending")), "{removed}");
    let (_, again) = server.call(&["reserve", "stuck"]);
    assert!(again["token"].as_u64().unwrap() > token, "{again}");
    let (code, missing) = run(&["admin", "purge", "--namespace", "live", "never", "--reason", "typo"]);
    assert_eq!((code, missing["error"]["code"].as_str()), (1, Some("not_found")), "{missing}");
    assert!(server.terminate());
}

#[test]
fn hash_token_makes_a_new_token_when_given_none() {
    let out = Command::new(BIN).arg("hash-token").output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let token = text.lines().find_map(|l| l.strip_prefix("token:")).unwrap().trim().to_owned();
    let hash = text.lines().find_map(|l| l.strip_prefix("token_sha256:")).unwrap().trim().to_owned();
    assert_eq!(token.len(), 64);
    let again = Command::new(BIN).args(["hash-token", &token]).output().unwrap();
    assert_eq!(String::from_utf8(again.stdout).unwrap().trim(), hash);
}

#[test]
fn no_tenants_and_a_public_address_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let message = String::from_utf8(out.stderr).unwrap();
    assert!(message.contains("no tenants are configured") && message.contains("[[tenants]]"), "{message}");
}

/// `oncegate hash-token TOKEN`.
fn hash_token(token: &str) -> String {
    let out = Command::new(BIN).args(["hash-token", token]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn client_verbs_speak_tls_and_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = certs::Pki::new(dir.path(), "ours");
    let config = dir.path().join("tls.toml");
    let text = format!(
        "[server]\ntls_cert_path = {:?}\ntls_key_path = {:?}\ntls_client_ca_path = {:?}\n\
         [[tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n",
        pki.server.cert,
        pki.server.key,
        pki.ca,
        hash_token("acme-token")
    );
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let plaintext = server.addr.clone();
    server.addr = plaintext.replace("http://", "https://");
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let (ca, cert, key) = (path(&pki.ca), path(&pki.client.cert), path(&pki.client.key));

    let token_file = dir.path().join("acme.token");
    std::fs::write(&token_file, "acme-token").unwrap();
    let token_file = path(&token_file);
    let tls = ["--token-file", &token_file, "--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key];
    let (code, granted) = server.call(&[&["reserve", "over-tls"][..], &tls].concat());
    assert_eq!((code, granted["outcome"].as_str()), (0, Some("granted")), "{granted}");
    let (code, view) = server.call(&[&["get", "over-tls"][..], &tls].concat());
    assert_eq!((code, view["state"].as_str()), (0, Some("pending")), "{view}");

    // Without a client certificate the server does not serve the call. (Under TLS 1.3
    // the client may see the server's alert or only the closed connection, so the cause
    // is not asserted.)
    let (code, answer) =
        server.call_quietly(&["get", "over-tls", "--token-file", &token_file, "--tls-ca", &ca]);
    assert_ne!(code, 0, "{answer:?}");
    assert!(answer.as_ref().is_none_or(|a| a.get("state").is_none()), "{answer:?}");
    // Nor to a plaintext client.
    server.addr = plaintext;
    let (code, answer) = server.call_quietly(&["get", "over-tls", "--token-file", &token_file]);
    assert_ne!(code, 0, "{answer:?}");
    assert!(answer.as_ref().is_none_or(|a| a.get("state").is_none()), "{answer:?}");
    assert!(server.terminate());
}

/// Twenty keys reserved and committed with their name as the response: (key, token).
fn commit_orders(server: &Server) -> Vec<(String, u64)> {
    (0..20)
        .map(|i| {
            let key = format!("order-{i}");
            let (_, granted) = server.call(&["reserve", &key]);
            let token = granted["token"].as_u64().unwrap();
            server.call(&["commit", &key, &token.to_string(), "--response", &key]);
            (key, token)
        })
        .collect()
}

/// Each key is replayed as completed with its token.
fn assert_replayed(server: &Server, tokens: &[(String, u64)]) {
    for (key, token) in tokens {
        let (code, replay) = server.call(&["reserve", key]);
        assert_eq!(
            (code, replay["outcome"].as_str(), replay["token"].as_u64()),
            (0, Some("completed"), Some(*token)),
            "{replay}"
        );
    }
}

/// `oncegate reshard` on a stopped directory of the server's store (`store` are its
/// flags): refused while the server runs, then every key answers on the new count. The
/// command finds the directory's store itself.
fn reshard_keeps_keys_answered(store: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), store);
    let tokens = commit_orders(&server);
    // The running server holds the directory's lock.
    let locked =
        Command::new(BIN).args(["reshard", "--to", "4", "--data-dir"]).arg(dir.path()).output().unwrap();
    assert!(!locked.status.success());
    assert!(String::from_utf8_lossy(&locked.stderr).contains("locked"), "{locked:?}");
    assert!(server.terminate());

    let out =
        Command::new(BIN).args(["reshard", "--to", "4", "--data-dir"]).arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (summary["shards_after"].as_u64(), summary["slots_moved"].as_u64()),
        (Some(4), Some(8_192)),
        "{summary}"
    );

    let server = Server::start(dir.path(), &[&["--shards", "4"], store].concat());
    assert_replayed(&server, &tokens);
    assert!(server.terminate());
}

#[test]
fn reshard_adds_shards_to_a_stopped_directory_and_keys_stay_answered() {
    reshard_keeps_keys_answered(&[]);
}

#[test]
fn admin_add_shards_spreads_the_slots_of_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fast-moves.toml");
    std::fs::write(&config, "[engine]\nslot_moves_per_second_max = 0\n").unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &["--config", config.to_str().unwrap()]);
    let tokens = commit_orders(&server);
    let add = |to: &str| {
        Command::new(BIN).args(["admin", "add-shards", "--addr", &server.addr, "--to", to]).output().unwrap()
    };
    let fewer = add("1");
    assert_eq!(fewer.status.code(), Some(1), "{fewer:?}");
    let refusal: Value = serde_json::from_slice(&fewer.stdout).unwrap();
    assert_eq!(refusal["error"]["field"].as_str(), Some("shards_total"), "{refusal}");

    let out = add("4");
    assert!(out.status.success(), "{out:?}");
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            summary["shards_before"].as_u64(),
            summary["shards_after"].as_u64(),
            summary["slots_moved"].as_u64()
        ),
        (Some(2), Some(4), Some(8_192)),
        "{summary}"
    );
    let status = Command::new(BIN).args(["status", "--addr", &server.addr]).output().unwrap();
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    let slots: Vec<u64> =
        status["shards"].as_array().unwrap().iter().map(|s| s["slots"].as_u64().unwrap()).collect();
    assert_eq!((slots, &status["moving"]), (vec![4_096; 4], &Value::Null), "{status}");
    assert!(server.terminate());

    // Restarted with its configured default of 2, the directory serves its 4 shards.
    let server = Server::start(&data, &[]);
    assert_replayed(&server, &tokens);
    assert!(server.terminate());
}

/// `oncegate admin backup --to DIR` writes a copy of a running server's directory with a
/// JSON summary; a directory that is not empty is refused naming the field; a server
/// started on the copy replays every order, and grants above the original's tokens.
#[test]
fn admin_backup_writes_a_copy_a_server_starts_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let tokens = commit_orders(&server);
    let backup = |to: &std::path::Path| {
        Command::new(BIN)
            .args(["admin", "backup", "--addr", &server.addr, "--to", to.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let copy = dir.path().join("copy");
    let out = backup(&copy);
    assert!(out.status.success(), "{out:?}");
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["shards"].as_u64(), Some(2), "{summary}");
    assert!(summary["bytes"].as_u64().unwrap() > 0, "{summary}");
    let again = backup(&copy);
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    let refusal: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(refusal["error"]["field"].as_str(), Some("to"), "{refusal}");
    let (_, granted) = server.call(&["reserve", "after-the-backup"]);
    let highest = granted["token"].as_u64().unwrap();
    assert!(server.terminate());

    let restored = Server::start(&copy, &[]);
    assert_replayed(&restored, &tokens);
    let (_, granted) = restored.call(&["reserve", "after-the-backup"]);
    assert!(granted["token"].as_u64().unwrap() > highest, "{granted}");
    assert!(restored.terminate());
}

/// `oncegate proxy --config` reads the `[proxy]` section and refuses it whole, naming
/// every bad key, before it binds or opens anything; `serve` ignores that section.
#[test]
fn the_proxy_section_of_a_config_file_is_checked_whole() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("oncegate.toml");
    let section = "[proxy]\nupstream = \"http://127.0.0.1:9\"\nkey_bytes_max = 0\nstored_statuses = [\"2xx\", \"6xx\"]\n";
    std::fs::write(&config, section).unwrap();
    let out = Command::new(BIN)
        .args(["proxy", "--config", config.to_str().unwrap(), "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("proxy.key_bytes_max") && stderr.contains("proxy.stored_statuses"), "{stderr}");
    assert!(!dir.path().join("data").exists(), "nothing was opened");
}

/// `oncegate proxy --token` is refused, with or without `--gate`, before anything is
/// opened: the process list would show the token. (It was accepted, and ignored, without
/// `--gate`.)
#[test]
fn the_proxy_refuses_a_token_on_its_command_line() {
    let dir = tempfile::tempdir().unwrap();
    for gate in [None, Some("http://127.0.0.1:9")] {
        let mut command = Command::new(BIN);
        command.args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "s",
        ]);
        if let Some(gate) = gate {
            command.args(["--gate", gate]);
        }
        let mut child =
            command.current_dir(dir.path()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        // A proxy that took the flag would serve on: it is killed after a minute.
        let mut status = None;
        for _ in 0..3_000 {
            status = child.try_wait().unwrap();
            if status.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let Some(status) = status else {
            child.kill().unwrap();
            panic!("the proxy took --token {gate:?} and served");
        };
        let mut stderr = String::new();
        child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        assert_eq!(status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("set ONCEGATE_TOKEN or use --token-file"), "{stderr}");
        assert!(!dir.path().join("data").exists(), "nothing was opened");
    }
}
