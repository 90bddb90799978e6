//! Durability across a real crash: a child process grants and commits as fast as it can
//! and prints each acknowledgement; the parent kills it with SIGKILL at an arbitrary
//! moment, reopens the data directory and checks that every acknowledged grant and commit
//! is there. Several kill cycles run on the same directory.
//!
//! A second run does the same while the child adds shards online (`add_shards` to
//! [`GROW_TO`]): each kill lands after a random number of slot moves, every restart
//! resumes the moves, and at the end the slots are spread and every acknowledged grant
//! and commit is where the map says, once.
//!
//! This target has its own `main` (no libtest harness) because the same binary plays
//! the child when `ONCEGATE_CRASH_CHILD` names a data directory.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use oncegate_core::{Outcome, ReserveReply, State, Tenant};
use oncegate_engine::{CommitRequest, Engine, EngineConfig, KeyRequest, ReserveRequest};

const CHILD_ENV: &str = "ONCEGATE_CRASH_CHILD";
/// Set in the child of the second run: it adds shards up to this count under the load.
const GROW_ENV: &str = "ONCEGATE_CRASH_GROW";
const GROW_TO: u32 = 8;
/// The parent kills a growing child after a number of slot moves below this.
const MOVES_BEFORE_KILL_SPREAD: usize = 300;
const CYCLES: usize = 3;
const THREADS: usize = 8;
/// The parent kills the child after a number of commit acknowledgements between these,
/// different in each cycle, so the kill lands at different points of the write path.
const COMMITS_BEFORE_KILL_MIN: usize = 100;
const COMMITS_BEFORE_KILL_SPREAD: usize = 500;

fn config(dir: &Path) -> EngineConfig {
    EngineConfig {
        data_dir: dir.to_owned(),
        shards: 2,
        slot_moves_per_second_max: 0,
        ..EngineConfig::default()
    }
}

fn child(dir: &Path, cycle: &str, grow: bool) {
    let engine = Engine::open(config(dir)).expect("child opens the engine");
    let tenant = Tenant::default_tenant();
    std::thread::scope(|s| {
        if grow {
            let engine = &engine;
            s.spawn(move || {
                engine.add_shards(GROW_TO, &mut |moved, _| println!("M {moved} 0")).expect("shards added");
                println!("D - 0");
            });
        }
        for thread in 0..THREADS {
            let (engine, tenant) = (&engine, &tenant);
            s.spawn(move || {
                for i in 0.. {
                    let key = format!("{cycle}-{thread}-{i}");
                    // A lease far longer than any run: an acknowledged grant must read as held
                    // after the kill however slowly a loaded machine ran the child (with the
                    // default 30 s, a commit stalled behind a slot move on a busy disk could
                    // see its lease end before the kill, and the check below would fail).
                    let request = ReserveRequest {
                        namespace: "live".into(),
                        key: key.clone(),
                        lease_ms: 600_000,
                        ..Default::default()
                    };
                    let token = match engine.reserve_blocking(tenant, request).expect("reserve").reply {
                        ReserveReply::Granted { token, .. } => token,
                        other => panic!("fresh keys are granted, got {other:?}"),
                    };
                    // Printed only after the grant was acknowledged, so only after it was durable.
                    println!("G {key} {token}");
                    let commit = CommitRequest {
                        namespace: "live".into(),
                        key: key.clone(),
                        token,
                        outcome: Outcome::Succeeded,
                        response: key.as_bytes().to_vec(),
                    };
                    engine.commit_blocking(tenant, commit).expect("commit");
                    println!("C {key} {token}");
                }
            });
        }
    });
}

/// Acknowledgements the child printed: key -> (token, committed).
type Acks = HashMap<String, (u64, bool)>;

fn run_cycle(dir: &Path, cycle: usize, acks: &mut Acks, grow: bool) {
    let exe = std::env::current_exe().expect("own path");
    let mut command = Command::new(exe);
    if grow {
        command.env(GROW_ENV, "1");
    }
    let mut child = command
        .env(CHILD_ENV, dir)
        .env("ONCEGATE_CRASH_CYCLE", format!("c{cycle}"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("child starts");
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let mut commits = 0;
    let mut line = Vec::new();
    let mut killed = false;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let kill_after = COMMITS_BEFORE_KILL_MIN + (nanos as usize ^ (cycle * 7919)) % COMMITS_BEFORE_KILL_SPREAD;
    let moves_before_kill = 1 + (nanos as usize ^ (cycle * 104_729)) % MOVES_BEFORE_KILL_SPREAD;
    let mut moves = 0;
    loop {
        line.clear();
        if out.read_until(b'\n', &mut line).expect("read") == 0 {
            break;
        }
        // A line cut by the kill has no newline and is no acknowledgement.
        if line.last() != Some(&b'\n') {
            break;
        }
        let text = std::str::from_utf8(&line).expect("utf-8").trim_end();
        let mut parts = text.split(' ');
        let (kind, key, token) = (parts.next(), parts.next(), parts.next());
        let (Some(kind), Some(key), Some(token)) = (kind, key, token) else { panic!("bad line {text:?}") };
        let token: u64 = token.parse().expect("token");
        match kind {
            "G" => {
                acks.insert(key.to_owned(), (token, false));
            }
            "C" => {
                acks.insert(key.to_owned(), (token, true));
                commits += 1;
            }
            "M" => moves += 1,
            "D" => panic!("the add finished before the kill; raise the shard target"),
            _ => panic!("bad line {text:?}"),
        }
        let due = if grow { moves >= moves_before_kill } else { commits == kill_after };
        if due && !killed {
            // SIGKILL: no destructor, no flush, no shutdown protocol runs in the child.
            child.kill().expect("kill");
            killed = true;
        }
    }
    let status = child.wait().expect("wait");
    assert!(killed, "the child exited by itself: {status}");
}

fn verify(dir: &Path, acks: &Acks) -> Engine {
    let engine = Engine::open(config(dir)).expect("reopen after the crash");
    let tenant = Tenant::default_tenant();
    for (key, (token, committed)) in acks {
        let request = KeyRequest { namespace: "live".into(), key: key.clone(), ..Default::default() };
        let view = engine.get_blocking(&tenant, request).expect("get");
        assert_eq!(view.token, *token, "{key}: the acknowledged token is stored");
        if *committed {
            assert_eq!(view.state, State::Completed, "{key}: an acknowledged commit survives");
            assert_eq!(view.response, key.as_bytes(), "{key}: with its response");
        } else {
            assert!(
                matches!(view.state, State::Pending | State::Completed),
                "{key}: an acknowledged grant survives (and its lease outlived the downtime), got {:?}",
                view.state
            );
        }
    }
    engine
}

fn main() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        let cycle = std::env::var("ONCEGATE_CRASH_CYCLE").expect("cycle name");
        child(Path::new(&dir), &cycle, std::env::var_os(GROW_ENV).is_some());
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let mut acks = Acks::new();
    for cycle in 0..CYCLES {
        run_cycle(dir.path(), cycle, &mut acks, false);
        verify(dir.path(), &acks);
        let committed = acks.values().filter(|(_, c)| *c).count();
        println!(
            "crash cycle {cycle}: {} grants and {committed} commits acknowledged, all found after SIGKILL",
            acks.len()
        );
    }
    std::io::stdout().flush().expect("flush");
    println!("crash_durability: 1 passed, 0 failed");
    grow_under_kills();
    println!("crash_during_add_shards: 1 passed, 0 failed");
}

/// Kills the child while it adds shards under load; each restart checks every
/// acknowledgement, and the last one finishes the add and checks again.
fn grow_under_kills() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut acks = Acks::new();
    for cycle in 0..CYCLES {
        run_cycle(dir.path(), cycle, &mut acks, true);
        let engine = verify(dir.path(), &acks);
        let shards = engine.stats().len();
        println!("add-shards kill {cycle}: {} acknowledgements found on {shards} shards", acks.len());
    }
    let engine = verify(dir.path(), &acks);
    engine.add_shards(GROW_TO, &mut |_, _| {}).expect("the add resumes and finishes");
    let slots: Vec<u32> = engine.stats().iter().map(|s| s.slots).collect();
    assert_eq!(slots, vec![16_384 / GROW_TO; GROW_TO as usize]);
    engine.shutdown();
    drop(engine);
    verify(dir.path(), &acks);
}
