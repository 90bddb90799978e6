//! A throwaway PostgreSQL cluster for tests: made with the system's `initdb` and `pg_ctl`
//! (on PATH or under `/usr/lib/postgresql/*/bin`) in a temporary directory, on a free
//! loopback port, and removed when the test process exits (a watchdog shell stops it
//! even if the process is killed).
//!
//! Where PostgreSQL is not installed the tests that need it print one line saying so and
//! pass, unless `ONCEGATE_REQUIRE_POSTGRES=1` (set by `.ci/run`), which fails them.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// A running cluster.
pub struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    socket_dir: PathBuf,
    pub port: u16,
    /// Kept so the directory lives as long as the cluster.
    _dir: tempfile::TempDir,
}

/// Where the server binaries are: the newest `/usr/lib/postgresql/*/bin`, else PATH.
fn bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort_by_key(|p| {
        p.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok())
    });
    if let Some(bin) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|dir| dir.join("initdb").exists() && dir.join("pg_ctl").exists())
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

/// Runs a server binary, as the `postgres` user when we are root (initdb refuses root).
fn run(bin: &Path, args: &[&str]) -> Result<(), String> {
    let mut command = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    };
    let output = command.args(args).output().map_err(|e| format!("{}: {e}", bin.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} {args:?}: {}{}",
            bin.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Cluster {
    /// Makes and starts a new cluster; `None` when PostgreSQL is not installed.
    pub fn start() -> Option<Cluster> {
        Cluster::start_with(None)
    }

    /// A cluster that takes TLS connections only, serving `cert` and `key` (PEM).
    pub fn start_tls(cert: &Path, key: &Path) -> Option<Cluster> {
        Cluster::start_with(Some((cert, key)))
    }

    fn start_with(tls: Option<(&Path, &Path)>) -> Option<Cluster> {
        let Some(bin) = bin_dir() else {
            if std::env::var("ONCEGATE_REQUIRE_POSTGRES").is_ok_and(|v| v == "1") {
                panic!(
                    "ONCEGATE_REQUIRE_POSTGRES=1 but no initdb/pg_ctl found (apt-get install -y postgresql)"
                );
            }
            eprintln!(
                "skipped: PostgreSQL is not installed (apt-get install -y postgresql runs these tests)"
            );
            return None;
        };
        let dir = tempfile::Builder::new().prefix("oncegate-pg-").tempdir().unwrap();
        let data = dir.path().join("data");
        if is_root() {
            Command::new("chown").args(["-R", "postgres:postgres"]).arg(dir.path()).status().unwrap();
        }
        run(&bin.join("initdb"), &["-D", data.to_str().unwrap(), "-A", "trust", "-U", "postgres", "-N"])
            .expect("initdb");
        if let Some((cert, key)) = tls {
            std::fs::copy(cert, data.join("server.crt")).unwrap();
            std::fs::copy(key, data.join("server.key")).unwrap();
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )
            .unwrap();
            std::fs::write(
                data.join("postgresql.auto.conf"),
                "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n",
            )
            .unwrap();
            if is_root() {
                Command::new("chown").args(["-R", "postgres:postgres"]).arg(&data).status().unwrap();
            }
            Command::new("chmod").arg("600").arg(data.join("server.key")).status().unwrap();
        }
        let cluster = Cluster { bin, socket_dir: dir.path().to_owned(), data, port: free_port(), _dir: dir };
        cluster.start_server().expect("postgres starts");
        cluster.watch();
        Some(cluster)
    }

    fn start_server(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=on",
            self.port,
            self.socket_dir.display()
        );
        let log = self.socket_dir.join("postgres.log");
        run(
            &self.bin.join("pg_ctl"),
            &["-D", self.data.to_str().unwrap(), "-l", log.to_str().unwrap(), "-w", "-o", &options, "start"],
        )
    }

    /// Stops the server at once (as a crash or an outage would).
    pub fn stop(&self) {
        run(&self.bin.join("pg_ctl"), &["-D", self.data.to_str().unwrap(), "-m", "immediate", "-w", "stop"])
            .expect("postgres stops");
    }

    /// Starts the stopped server again, on the same port.
    pub fn restart(&self) {
        self.start_server().expect("postgres starts again");
    }

    /// The postmaster's process id (the first line of `postmaster.pid`).
    fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// Stops the server and removes its directory when this process ends, however it
    /// ends: a shell waits for this process to go, then sends the postmaster SIGQUIT (an
    /// immediate shutdown) and removes the directory.
    #[allow(clippy::zombie_processes, reason = "the watchdog outlives this process by design; init reaps it")]
    fn watch(&self) {
        let Some(postmaster) = self.postmaster_pid() else { return };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; kill -QUIT {postmaster} 2>/dev/null; sleep 1; rm -rf {dir}",
            pid = std::process::id(),
            dir = self.socket_dir.display(),
        );
        Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("watchdog");
    }

    /// A new database on this cluster; returns its connection string.
    pub fn database(&self, name: &str) -> String {
        // Over the cluster's socket: a cluster that takes TLS connections only still
        // takes these.
        let socket = self.socket_dir.to_str().unwrap();
        run(
            &self.bin.join("createdb"),
            &["-h", socket, "-p", &self.port.to_string(), "-U", "postgres", name],
        )
        .expect("createdb");
        self.url(name)
    }

    pub fn url(&self, name: &str) -> String {
        format!("host=127.0.0.1 port={} user=postgres dbname={name}", self.port)
    }
}

impl Drop for Cluster {
    /// A cluster a test made for itself stops with the test (its directory goes with it).
    fn drop(&mut self) {
        let _ = run(
            &self.bin.join("pg_ctl"),
            &["-D", self.data.to_str().unwrap(), "-m", "immediate", "-w", "stop"],
        );
    }
}

/// The cluster this test process shares, started on first use.
pub fn shared() -> Option<&'static Cluster> {
    static CLUSTER: OnceLock<Option<Cluster>> = OnceLock::new();
    CLUSTER.get_or_init(Cluster::start).as_ref()
}

/// The database of a data directory on the shared cluster: the same directory gets the
/// same database (reopen tests reopen the same records).
pub fn database_for(dir: &Path) -> Option<String> {
    static NAMES: OnceLock<Mutex<HashMap<PathBuf, String>>> = OnceLock::new();
    let cluster = shared()?;
    let mut names = NAMES.get_or_init(Default::default).lock().unwrap();
    if let Some(url) = names.get(dir) {
        return Some(url.clone());
    }
    let name = format!("og_{}", names.len() + 1);
    let url = cluster.database(&name);
    names.insert(dir.to_owned(), url.clone());
    Some(url)
}
